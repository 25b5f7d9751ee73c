// Deployment page, load time: start-up phases as a Gantt bar, the predicted time to
// ready, the loader's read rate against the disk's own, page-cache residency and free RAM.
(function () {
  const D = window.DEPLOYMENT;
  const $ = (id) => document.getElementById(id);
  const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (ch) => `&#${ch.charCodeAt(0)};`);
  const LABELS = { process: "process start", p2p_check: "P2P check", weights: "weights", compile: "torch.compile",
    kv_cache: "KV cache", graph_capture: "CUDA graphs", api_up: "API up", smoke_test: "smoke test" };
  const COLORS = { process: "#94a3b8", p2p_check: "#f59e0b", weights: "#2563eb", compile: "#9333ea",
    kv_cache: "#059669", graph_capture: "#db2777", api_up: "#0891b2", smoke_test: "#65a30d" };
  const secs = (s) => (s < 90 ? `${Math.round(s)} s` : `${(s / 60).toFixed(1)} min`);
  const size = window.humanBytes;  // live.js

  function render(d) {
    if (!d || !d.phases) return;
    const segs = d.phases.segments || [];
    const end = segs.length ? segs[segs.length - 1][2] : 0;
    const span = Math.max(end, (d.prediction && d.prediction.total_s) || 0, 1);
    $("load-gantt").innerHTML = segs.map(([p, s, e]) =>
      `<span data-phase="${esc(p)}" title="${esc(LABELS[p] || p)} ${secs(e - s)}" style="position:absolute;top:0;bottom:0;` +
      `left:${(100 * s / span).toFixed(2)}%;width:${Math.max(0.3, 100 * (e - s) / span).toFixed(2)}%;background:${COLORS[p] || "#666"}"></span>`).join("");
    const totals = d.phases.totals || {};
    $("load-legend").innerHTML = Object.entries(totals).map(([p, s]) => {
      const prev = d.previous && d.previous[p];
      const delta = prev != null && Math.abs(s - prev) > 1 ? ` (${s < prev ? "−" : "+"}${secs(Math.abs(s - prev))} vs last)` : "";
      return `<span class="phase-total" data-phase="${esc(p)}"><i style="display:inline-block;width:10px;height:10px;background:${COLORS[p] || "#666"}"></i> ` +
        `${esc(LABELS[p] || p)} ${secs(s)}${delta}</span>`;
    }).join(" · ");
    const shards = d.phases.shards_total ? ` · shards ${d.phases.shards_done}/${d.phases.shards_total}` : "";
    $("load-forecast").textContent = d.prediction
      ? `Ready in ~${secs(d.prediction.seconds_left)} (expected ${secs(d.prediction.total_s)} in all, ${d.prediction.percent} %) · from ${d.basis}${shards}`
      : (d.basis || "No earlier load: phases only") + shards;
    const disk = [];
    if (d.read_bps != null) disk.push(`loader reads ${size(d.read_bps)}/s` + (d.disk_bps ? ` of the disk's ${size(d.disk_bps)}/s` : " (disk not measured yet)"));
    if (d.resident_bytes != null && d.model_bytes) disk.push(`in page cache ${size(d.resident_bytes)} of ${size(d.model_bytes)}`);
    if (d.ram_available != null && d.model_bytes) disk.push(`free RAM ${size(d.ram_available)} for a ${size(d.model_bytes)} model`);
    $("load-disk").textContent = disk.join(" · ");
    $("load-recommend").innerHTML = (d.recommend || []).map((r) => `<li>${esc(r)}</li>`).join("");
    if (d.prediction && D.status !== "ready") $("load-bar").style.width = d.prediction.percent + "%";
  }

  const initial = $("load-detail");
  if (initial) render(JSON.parse(initial.textContent));
  Live.subscribe("deployment:" + D.id, (msg) => {
    if (msg.kind === "status") { D.status = msg.data.status; render(msg.data.load_detail); }
  });
})();
