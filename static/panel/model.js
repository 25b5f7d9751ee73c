// Model page: each copy's progress (bytes, rate, time left, per file) follows live messages.
(function () {
  const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (ch) => `&#${ch.charCodeAt(0)};`);
  const size = window.humanBytes;  // live.js
  const eta = (s) => (s == null ? "" : s > 3600 ? `${(s / 3600).toFixed(1)} h left` : s > 60 ? `${Math.round(s / 60)} min left` : `${Math.round(s)} s left`);
  Live.subscribe("model:" + MODEL.id, (msg) => {
    // Read while the page loaded (the snapshot says so, and the page was rendered unread): reload too.
    if (msg.kind === "model") { if (!msg.snapshot || (!MODEL.inspected && msg.data.inspected)) location.reload(); return; }
    if (!msg.kind.startsWith("copy.")) return;
    const c = msg.data;
    const card = document.querySelector(`.copy[data-copy="${c.id}"]`);
    if (!card) { if (!msg.snapshot && c.state !== "deleted") location.reload(); return; }
    if (c.state === "deleted") { card.remove(); return; }
    const state = card.querySelector('[data-f="state"]');
    state.textContent = c.state.charAt(0).toUpperCase() + c.state.slice(1);
    state.className = "badge " + c.state;
    // Only the actions that apply now: no Cancel/Retry/Delete on a ready copy but Delete, no Retry while it runs.
    const can = { cancel: ["queued", "downloading"], retry: ["failed", "cancelled"], delete: ["ready", "failed", "cancelled"] };
    for (const [action, states] of Object.entries(can)) {
      card.querySelector(`[data-action="${action}"]`)?.toggleAttribute("hidden", !states.includes(c.state));
    }
    const pct = c.bytes_total ? (100 * c.bytes_done) / c.bytes_total : 0;
    card.querySelector('[data-f="bar"]').style.width = pct.toFixed(1) + "%";
    const rate = c.state === "downloading" && c.rate ? ` · ${size(c.rate)}/s · ${eta(c.seconds_left)}` : "";
    card.querySelector('[data-f="text"]').textContent = `${size(c.bytes_done)} of ${size(c.bytes_total)} (${pct.toFixed(1)} %)${rate}`;
    card.querySelector('[data-f="error"]').textContent = c.error || "";
    // A transient failure being retried: why, and when the next try starts (it resumes from the kept bytes).
    const retry = card.querySelector('[data-f="retry"]');
    if (retry) {
      const left = c.retry ? Math.max(0, Math.round((Date.parse(c.retry.at) - Date.now()) / 1000)) : 0;
      retry.textContent = c.state === "downloading" && c.retry
        ? `${c.retry.reason} Trying again in ${left} s (try ${c.retries + 1}).` : "";
    }
    const files = Object.entries(c.files || {});
    if (!files.length) return;  // a snapshot without per-file progress: the page's rows stay
    const rows = files.map(([path, [done, total]]) => `<tr><td>${esc(path)}</td><td class="num">` +
      (c.state === "ready" ? `${size(total)} · verified` : `${size(done)} / ${size(total)}`) + "</td></tr>");
    card.querySelector('[data-f="files"]').innerHTML = rows.join("");
  });
})();
