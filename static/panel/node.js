// Node page: live host charts (CPU, RAM, disk, network) on every node, per-GPU memory and utilization
// charts where there are GPUs, GPU table, process table, host figures.
// History comes with the page; live samples are appended; after a reconnect the gap is fetched
// from the history endpoint, so the chart never shows a hole or a stale value.
(function () {
  const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (ch) => `&#${ch.charCodeAt(0)};`);
  const N = window.NODE;
  const GiB = 2 ** 30;
  const fmtGiB = (b) => (b == null ? "unknown" : (b / GiB).toFixed(1) + " GiB");
  const unknown = (v, unit = "") => (v == null ? "unknown" : v + unit);
  let samples = JSON.parse(document.getElementById("recent-samples").textContent);
  let windowSeconds = 3600;
  let minuteMode = false;
  let minuteSamples = [];
  let lastT = samples.length ? samples[samples.length - 1].t : null;
  let shownT = 0; // time of the sample the tables show

  function seriesFor(list, field, scale) {
    const xs = list.map((s) => s.t);
    const ys = N.gpus.map((i) => list.map((s) => {
      const g = s.gpus.find((x) => x.index === i);
      return g && g[field] != null ? g[field] / scale : null;
    }));
    return [xs, ...ys];
  }

  function makeChart(el, field, scale) {
    if (!el) return null;
    const colors = ["#2563eb", "#16a34a", "#d97706", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
    const opts = {
      width: Math.max(300, el.clientWidth), height: 220,
      series: [{}, ...N.gpus.map((i, k) => ({ label: "GPU " + i, stroke: colors[k % colors.length], width: 1.5 }))],
      axes: [{}, { size: 50 }],
      scales: { x: { time: true } },
    };
    return new uPlot(opts, seriesFor(visible(), field, scale), el);
  }

  const charts = N.hasGpu ? {
    mem: makeChart(document.getElementById("chart-mem"), "memory_used", GiB),
    util: makeChart(document.getElementById("chart-util"), "util_gpu", 1),
  } : {};
  window.nodeCharts = charts;

  // Host charts: each line is a function of a compact sample (null where an older sample lacks it).
  const MiB = 2 ** 20;
  const diff = (a, b, scale) => (a == null || b == null ? null : (a - b) / scale);
  const HOST = {
    cpu: [["CPU %", "#2563eb", (s) => s.cpu_percent ?? null]],
    ram: [["RAM used GiB", "#16a34a", (s) => diff(s.ram_total, s.ram_available, GiB)]],
    disk: [["filesystem used GiB", "#d97706", (s) => diff(s.disk_total, s.disk_free, GiB)]],
    net: [["received MiB/s", "#7c3aed", (s) => (s.net_rx_bps == null ? null : s.net_rx_bps / MiB)],
          ["sent MiB/s", "#dc2626", (s) => (s.net_tx_bps == null ? null : s.net_tx_bps / MiB)]],
  };
  const hostSeries = (list, lines) => [list.map((s) => s.t), ...lines.map(([, , get]) => list.map(get))];
  // Each host chart's y range from 0 to what there is (the whole disk, all RAM, 100 %): a disk at 178.79 GiB
  // that moves by a few MiB otherwise gets ticks 178.79, 178.79 cut to "78.79" by the axis width.
  const latest = (field) => { for (let i = samples.length - 1; i >= 0; i--) if (samples[i][field]) return samples[i][field]; return null; };
  const TOP = { cpu: () => 100, ram: () => latest("ram_total") / GiB, disk: () => latest("disk_total") / GiB };
  const yRange = (key) => (u, min, max) => [0, (TOP[key] && TOP[key]()) || Math.max(1, (max || 0) * 1.2)];
  const yTicks = (u, splits) => splits.map((v) => (v == null ? "" : Math.abs(v) >= 100 || Number.isInteger(v) ? v.toFixed(0)
    : v.toFixed(Math.abs(v) >= 10 ? 1 : 2)));
  const hostCharts = {};
  for (const [key, lines] of Object.entries(HOST)) {
    const el = document.getElementById("chart-host-" + key);
    if (!el) continue;
    hostCharts[key] = new uPlot({ width: Math.max(300, el.clientWidth), height: 180,
      scales: { x: { time: true }, y: { range: yRange(key) } },
      series: [{}, ...lines.map(([label, stroke]) => ({ label, stroke, width: 1.5 }))],
      axes: [{}, { size: 60, values: yTicks }] },
    hostSeries(visible(), lines), el);
  }
  window.hostCharts = hostCharts;

  function visible() {
    if (minuteMode) return minuteSamples;
    const cutoff = Date.now() / 1000 - windowSeconds;
    return samples.filter((s) => s.t >= cutoff);
  }

  function redraw() {
    samples = samples.filter((s) => s.t >= Date.now() / 1000 - 3600); // the page keeps an hour
    const shown = visible();
    if (charts.mem) charts.mem.setData(seriesFor(shown, "memory_used", GiB));
    if (charts.util) charts.util.setData(seriesFor(shown, "util_gpu", 1));
    for (const [key, chart] of Object.entries(hostCharts)) chart.setData(hostSeries(shown, HOST[key]));
    document.documentElement.dataset.points = shown.length;
  }

  function compact(s) {
    return { t: s.t, disk_free: s.disk.free, disk_total: s.disk.total, ram_available: s.host.ram_available,
      ram_total: s.host.ram_total, load1: s.host.load1, cpu_percent: s.host.cpu_percent,
      net_rx_bps: s.host.net_rx_bps, net_tx_bps: s.host.net_tx_bps,
      gpus: s.gpus.map((g) => ({ index: g.index, memory_used: g.memory_used, memory_total: g.memory_total,
        util_gpu: g.util_gpu, temperature_c: g.temperature_c, power_w: g.power_w })) };
  }

  function merge(more) {
    const seen = new Set(samples.map((s) => s.t));
    for (const s of more) if (!seen.has(s.t)) samples.push(s);
    samples.sort((a, b) => a.t - b.t);
    if (samples.length) lastT = samples[samples.length - 1].t;
  }

  function showTables(s) {
    document.getElementById("disk").textContent = `${fmtGiB(s.disk.free)} free of ${fmtGiB(s.disk.total)}`;
    document.getElementById("ram").textContent = `${fmtGiB(s.host.ram_available)} of ${fmtGiB(s.host.ram_total)}`;
    document.getElementById("load").textContent = s.host.load1.toFixed(2) +
      (s.host.cpu_percent == null ? "" : ` · CPU ${s.host.cpu_percent.toFixed(0)} % of ${s.host.cpu_count} cores`);
    document.getElementById("last-sample").textContent = new Date(s.t * 1000).toLocaleTimeString();
    const procRows = [];
    for (const g of s.gpus) {
      const row = document.querySelector(`#gpu-table tr[data-gpu="${g.index}"]`);
      if (row) {
        row.querySelector('[data-f="mem"]').textContent = `${fmtGiB(g.memory_used)} / ${fmtGiB(g.memory_total)}`;
        row.querySelector('[data-f="util"]').textContent = unknown(g.util_gpu, " %");
        row.querySelector('[data-f="temp"]').textContent = unknown(g.temperature_c, " °C");
        row.querySelector('[data-f="power"]').textContent =
          `${g.power_w == null ? "unknown" : g.power_w.toFixed(0) + " W"} / ${g.power_limit_w == null ? "unknown" : g.power_limit_w.toFixed(0) + " W"}`;
        row.querySelector('[data-f="clock"]').textContent = unknown(g.sm_clock_mhz, " MHz");
        row.querySelector('[data-f="pcie"]').textContent = g.pcie_gen == null ? "unknown" : `gen ${g.pcie_gen} ×${unknown(g.pcie_width)}`;
      }
      if (g.processes == null) procRows.push(`<tr><td>${g.index}</td><td colspan="4" class="muted">unknown (the driver does not list processes)</td></tr>`);
      for (const p of g.processes || []) {
        const dep = p.deployment ? `<a href="${N.deploymentUrl}${p.deployment.id}/">${esc(p.deployment.name)}</a>` : '<span class="muted">not a deployment</span>';
        procRows.push(`<tr data-pid="${p.pid}"><td>${g.index}</td><td>${p.pid}</td><td>${esc(p.name || "unknown")}</td><td class="num">${fmtGiB(p.used_memory)}</td><td>${dep}</td></tr>`);
      }
    }
    const body = document.querySelector("#procs tbody");
    if (body) body.innerHTML = procRows.join("") || '<tr><td colspan="5" class="muted">No GPU processes.</td></tr>';
  }

  // A heartbeat late: asked every few seconds whether `./panel start` is starting the agent again (agent_restart).
  let restart = null, askedAt = 0;
  async function askRestart() {
    askedAt = Date.now();
    try {
      const r = await fetch(N.apiUrl, { headers: { Accept: "application/json" } });
      if (r.ok) restart = (await r.json()).agent_restart;
    } catch (e) { /* the web itself is away: the badge says offline */ }
  }
  function setState() {
    const el = document.getElementById("node-state");
    const last = lastT || N.lastHeartbeat;
    const online = last && Date.now() / 1000 - last < 3 * N.heartbeat;
    if (!last || Date.now() / 1000 - last < 1.5 * N.heartbeat) restart = null;
    else if (Date.now() - askedAt > 3000) askRestart();
    el.className = "badge " + (online && !restart ? "online" : "offline");
    const at = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });
    el.textContent = restart
      ? `node agent restarting (exited with code ${restart.code} at ${at(restart.exited)}; starting again at ${at(restart.next_start)})`
      : online ? "online" : last ? "offline since " + new Date(last * 1000).toLocaleString() : "never seen";
  }
  setInterval(setState, 1000);

  Live.subscribe("node:" + N.id, async (msg) => {
    if (msg.kind.startsWith("engine.")) {
      const el = document.querySelector(`[data-engine="${msg.data.id}"]`);
      if (el) el.textContent = `${msg.data.tok_s.toFixed(1)} tok/s, ${msg.data.running ?? "?"} running`;
      return;
    }
    if (msg.kind !== "sample") return;
    if (msg.snapshot && lastT) {
      // (Re)connected: fetch what was missed while away before appending the live stream.
      const res = await fetch(`${N.historyUrl}?since=${lastT}`);
      if (res.ok) merge((await res.json()).samples);
    }
    // A snapshot can arrive after a newer live sample (it is read just after joining the group):
    // anything not newer than what is shown only fills the chart, never the current figures.
    merge([compact(msg.data)]);
    if (msg.data.t > shownT) { shownT = msg.data.t; showTables(msg.data); }
    if (!minuteMode) redraw();
    setState();
  });

  for (const button of document.querySelectorAll("#ranges button")) {
    button.addEventListener("click", async () => {
      for (const b of document.querySelectorAll("#ranges button")) b.className = "secondary";
      button.className = "";
      if (button.dataset.days) {
        minuteMode = true;
        const res = await fetch(`${N.historyUrl}?days=${button.dataset.days}`);
        minuteSamples = (await res.json()).samples;
        redraw();
      } else {
        minuteMode = false;
        windowSeconds = 60 * Number(button.dataset.minutes);
        redraw();
      }
    });
  }
  redraw();
})();
