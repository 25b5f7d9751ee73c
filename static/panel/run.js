// Run page: tok/s over time and each finished level, live; charts rebuilt from a snapshot on reconnect.
(function () {
  const R = window.RUN;
  const initial = JSON.parse(document.getElementById("initial").textContent);
  const ticks = initial.ticks.map(([t, c, v]) => ({ t, c, v }));
  // A level is a concurrency or a request rate (open loop): keyed apart, each kind charted on its own axis.
  // Repeats of one level (the run's, or a capacity search's of one rate) are rows of their own.
  const key = (p) => (p.kind === "rate" ? "r" + p.rate + "/" + (p.repeat || 0) : "c" + p.concurrency + (p.repeat ? "/" + p.repeat : ""));
  const points = new Map(initial.points.map((p) => [key(p), p]));
  const byRate = R.axis === "rate";
  const axis = byRate ? "requests/s" : "concurrency";
  const x = (p) => (byRate ? p.rate : p.concurrency);
  // ITL per chunk far above ITL per token: several tokens came in each read, so per-token timings are an average
  // over a burst, not gaps a client saw (a busy client reads late, or the server coalesced its writes).
  const BURST = 4;
  function bursts(p) {  // about how many tokens came per read, when that many: 0 otherwise
    const chunk = (p.itl_ms || {}).median, token = (p.itl_per_token_ms || {}).median;
    return chunk && token && chunk >= BURST * token ? Math.round(chunk / token) : 0;
  }
  const fmt = (v, d = 1) => (v == null ? "—" : Number(v).toFixed(d));
  const width = (el) => Math.max(300, el.clientWidth);

  const tickEl = document.getElementById("chart-ticks");
  // Legends as labels only: live values read "s: --" until the cursor is on the chart.
  const legend = { live: false };
  const tickChart = new uPlot({ width: width(tickEl), height: 220, scales: { x: { time: false } }, legend,
    series: [{ label: "s" }, { label: "tok/s", stroke: "#2563eb", width: 1.5 }], axes: [{ label: "seconds" }, { size: 60 }] },
    [[], []], tickEl);
  const scaleEl = document.getElementById("chart-scaling");
  const scaleChart = new uPlot({ width: width(scaleEl), height: 220, scales: { x: { time: false, distr: 3 } }, legend,
    series: [{ label: axis }, { label: "output tok/s", stroke: "#16a34a", width: 2, points: { size: 6 } }],
    axes: [{ label: axis }, { size: 60 }] }, [[], []], scaleEl);
  const ttftEl = document.getElementById("chart-ttft");
  const ttftChart = new uPlot({ width: width(ttftEl), height: 220, scales: { x: { time: false, distr: 3 } }, legend,
    series: [{ label: axis }, { label: "TTFT median ms", stroke: "#d97706", width: 2, points: { size: 6 } }],
    axes: [{ label: axis }, { size: 60 }] }, [[], []], ttftEl);
  // SLOs: each one's metric at its percentile per level (solid) and its limit (dashed, the same colour).
  const slos = initial.slos || [];
  const colours = ["#dc2626", "#7c3aed", "#0891b2", "#65a30d", "#db2777", "#ca8a04"];
  const sloName = (s) => `p${s.percentile} ${s.metric.toUpperCase()}`;
  const sloEl = document.getElementById("chart-slo");
  const sloChart = sloEl && slos.length ? new uPlot({ width: width(sloEl), height: 220, scales: { x: { time: false, distr: 3 } }, legend,
    series: [{ label: axis }].concat(...slos.map((s, i) => [
      { label: sloName(s) + " ms", stroke: colours[i % colours.length], width: 2, points: { size: 6 } },
      { label: sloName(s) + " limit", stroke: colours[i % colours.length], width: 1, dash: [6, 4], points: { show: false } }])),
    axes: [{ label: axis }, { size: 60 }] }, [[]].concat(slos.flatMap(() => [[], []])), sloEl) : null;
  window.runCharts = { ticks: tickChart, scaling: scaleChart, ttft: ttftChart, slo: sloChart };

  function drawTicks() { tickChart.setData([ticks.map((x) => x.t), ticks.map((x) => x.v)]); }
  function drawPoints() {
    const ps = [...points.values()].sort((a, b) => (a.kind || "").localeCompare(b.kind || "") || a.rate - b.rate || a.concurrency - b.concurrency || (a.repeat || 0) - (b.repeat || 0));
    const charted = ps.filter((p) => (p.kind === "rate") === byRate);
    scaleChart.setData([charted.map(x), charted.map((p) => p.output_throughput)]);
    ttftChart.setData([charted.map(x), charted.map((p) => p.ttft_ms.median)]);
    if (sloChart) {
      const sloCharted = charted.filter((p) => !p.repeat);
      sloChart.setData([sloCharted.map(x)].concat(...slos.map((s, i) => [
        sloCharted.map((p) => (((p.slo || {}).each || [])[i] || {}).value_ms ?? null), sloCharted.map(() => s.max_ms)])));
    }
    document.querySelector("#points tbody").innerHTML = ps.map((p) => {
      const s = p.server_metrics || {};
      const gauge = (k) => (s[k] ? fmt(s[k].max, 0) : "—");
      const rate = p.kind === "rate";
      const level = (rate ? `${Number(p.rate.toFixed(2))} req/s${p.concurrency ? " ≤ " + p.concurrency : ""}` : p.concurrency) + (p.repeat ? " #" + (p.repeat + 1) : "");
      return `<tr data-concurrency="${p.concurrency}" data-kind="${p.kind}" data-rate="${p.rate}" data-repeat="${p.repeat || 0}"><td class="num">${level}</td><td class="num">${fmt(p.output_throughput)}</td>` +
        `<td class="num">${fmt(p.total_token_throughput)}</td><td class="num">${fmt(p.request_throughput, 2)}</td>` +
        `<td class="num" data-f="prompt-tokens" title="${p.prompt_tokens_counted_by ? "sized by " + p.prompt_tokens_counted_by : "prompts as written"}">${p.prompt_tokens_requested ?? "—"} / ${fmt(p.prompt_tokens_mean)}</td>` +
        `<td class="num">${fmt(p.ttft_ms.median)} / ${fmt(p.ttft_ms.p99)}</td><td class="num">${fmt((p.ttft_vllm_bench_ms || {}).median)}</td>` +
        `<td class="num">${fmt(p.ttfc_ms.median)}</td>` +
        `<td class="num">${fmt(p.tpot_ms.median, 2)}</td><td class="num">${fmt((p.itl_per_token_ms || {}).median, 2)}</td><td class="num"${bursts(p) ? ` data-bursts="${bursts(p)}" title="about ${bursts(p)} tokens per read"` : ""}>${fmt(p.itl_ms.median, 2)}</td><td class="num">${fmt(p.tok_s_per_user)}</td>` +
        `<td class="num">${p.reasoning_tokens} / ${p.content_tokens}</td><td class="num">${gauge("num_requests_running")} / ${gauge("num_requests_waiting")}</td>` +
        `<td class="num">${s.kv_cache_usage_perc ? fmt(100 * s.kv_cache_usage_perc.max, 0) + " %" : "—"}</td>` +
        `<td class="num" data-f="energy">${p.joules_per_token != null ? fmt(p.joules_per_token, 3) + (p.joules_per_token_net != null ? " (" + fmt(p.joules_per_token_net, 3) + " net)" : "") + " / " + fmt(p.watts_per_gpu, 0) : "—"}</td>` +
        `<td class="num" data-f="rate">${rate ? fmt(p.achieved_rate, 2) + " / " + fmt((p.lag_ms || {}).p99, 2) : "—"}</td>` +
        `<td class="num" data-f="requests">${p.num_requests} / ${p.warmup_requests ?? 0}` +
        (p.failed_requests ? ` <span class="errorlist" data-f="failed">${p.failed_requests} failed${p.timeouts ? ` (${p.timeouts} timed out)` : ""}${p.rejected ? ` (${p.rejected} refused for load)` : ""}</span>` : "") + "</td>" +
        (slos.length ? `<td class="num" data-f="goodput">${p.slo && p.slo.each ? fmt(p.goodput, 2) + " / " + fmt(p.slo.attainment_pct, 1) + " %" + (p.slo.met ? " ✓" : " ✗") : "—"}</td>` : "") + "</tr>";
    }).join("");
    const bursty = ps.filter((p) => bursts(p));
    const note = document.getElementById("bursts");
    note.hidden = !bursty.length;
    note.textContent = bursty.length ? "Tokens arrived in bursts at " + bursty.map((p) => (p.kind === "rate" ? Number(p.rate.toFixed(2)) + " req/s" : "c=" + p.concurrency) +
      ` (about ${bursts(p)} per read)`).join(", ") + ": ITL per chunk is several times ITL per token there, so TPOT and ITL per " +
      "token average over each burst rather than time gaps a client saw (a busy client reads late, or the server " +
      "coalesced its writes)." : "";
    const single = points.get("c1");
    if (single) document.getElementById("single-stream-output").textContent = fmt(single.output_throughput) + " tok/s";
  }
  drawTicks();
  drawPoints();

  // Where the sweep saturated and why: the API works it out from the stored levels once the run ends.
  function showSaturation() {
    fetch(`/api/runs/${R.id}/`, { headers: { Accept: "application/json" }, credentials: "same-origin" })
      .then((r) => (r.ok ? r.json() : null)).then((run) => {
        const el = document.getElementById("saturation");
        if (!run || !run.saturation || !el) return;
        el.textContent = run.saturation.text;
        el.hidden = false;
      }).catch(() => {});
  }

  let ended = ["done", "failed", "cancelled"].some((s) => document.getElementById("run-status")?.classList.contains(s));
  Live.subscribe("run:" + R.id, (msg) => {
    if (msg.kind === "tick") {
      if (ended) return;
      const d = msg.data;
      if (!ticks.length || d.t > ticks[ticks.length - 1].t) ticks.push({ t: d.t, c: d.concurrency, v: d.tok_s });
      drawTicks();
      const server = d.server && d.server.generation_tok_s != null ? ` · engine ${fmt(d.server.generation_tok_s)} tok/s` : "";
      const level = d.rate ? `${d.rate} req/s` : `concurrency ${d.concurrency}`;
      document.getElementById("now").textContent = `${level}: ${fmt(d.tok_s)} tok/s, ${d.in_flight} in flight, ${d.completed} done${server}`;
    } else if (msg.kind.startsWith("point.")) {
      points.set(key(msg.data), msg.data);
      drawPoints();
    } else if (msg.kind === "status") {
      const s = msg.data;
      const badge = document.getElementById("run-status");
      badge.textContent = s.status_display;
      badge.className = "badge " + s.status;
      document.getElementById("run-error").textContent = s.error || "";
      if (s.single_stream_tok_s != null) document.getElementById("single-stream").textContent = fmt(s.single_stream_tok_s) + " tok/s";
      const capacity = document.getElementById("capacity");
      if (capacity && s.capacity && s.capacity.text) { capacity.textContent = s.capacity.text; capacity.hidden = false; }
      document.getElementById("warnings").innerHTML = (s.warnings || []).map((w) => `<li>${w.replace(/[&<>]/g, "")}</li>`).join("");
      if (["done", "failed", "cancelled"].includes(s.status)) {
        document.getElementById("cancel")?.remove();
        showSaturation();
        document.getElementById("now").textContent = "—";  // nothing is in flight once the run has ended
        ended = true;
      }
    }
  });
})();
