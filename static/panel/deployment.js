// Deployment page: status, load phase and progress, GPU memory of its GPUs, timeline and log, live.
(function () {
  const D = window.DEPLOYMENT;
  const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (ch) => `&#${ch.charCodeAt(0)};`);
  const gib = (b) => (b / 2 ** 30).toFixed(1) + " GiB";
  const $ = (id) => document.getElementById(id);
  const logEl = $("log");
  let ended = $("status").classList.contains("stopped") || $("status").classList.contains("failed");
  // "Engine now" is a ready engine's: while a new start loads, the last engine's figures (kept for the page's first
  // snapshot too) are not this one's.
  let serving = $("status").classList.contains("ready");
  const PHASES = { starting: "Starting", loading_weights: "Loading weights", weights_loaded: "Weights loaded",
    profiling_kv_cache: "Profiling KV cache", graph_capture: "Capturing graphs", server_up: "Server up" };

  Live.subscribe("deployment:" + D.id, (msg) => {
    if (msg.kind === "status") {
      const s = msg.data;
      $("status").textContent = s.status_display;
      $("status").className = "badge " + s.status;
      $("status-message").textContent = s.message || "";
      $("status-message").className = s.status === "failed" ? "errorlist" : "muted";
      // A new engine (a redeploy, a restart): the previous one's log and smoke reply are not this one's.
      if (s.pid && String(s.pid) !== $("pid").textContent) logEl.textContent = "";
      if (s.status === "queued") $("smoke").innerHTML = '<span class="muted">After this start\'s load.</span>';
      $("expires")?.toggleAttribute("hidden", s.status !== "queued");  // "dropped unless…" is a queued plan's
      $("pid").textContent = s.pid || "—";
      // The start-up card: "Loading" only while it loads (views.deployments.start_title says the same).
      const titles = { ready: "Start-up", queued: "Start-up (queued)", stopped: "Last start-up", failed: "Last start-up",
        stopping: "Last start-up" };
      if ($("loading-title")) $("loading-title").textContent = titles[s.status] || "Loading";
      // What the page offers and shows follows the state: nothing to stop once stopped, no live rate either.
      ended = s.status === "stopped" || s.status === "failed";
      serving = s.status === "ready";
      if (!serving) $("engine-now").textContent = "—";
      document.querySelector('[data-action="stop"]')?.toggleAttribute("hidden", ended);
      if (ended) {
        document.querySelectorAll("#timeline td.num").forEach((td) => { if (td.textContent === "…") td.textContent = "—"; });
      }
      if (s.load_phase) $("load-phase").textContent = PHASES[s.load_phase] || s.load_phase;
      if (s.load_percent != null) $("load-bar").style.width = s.load_percent + "%";
      const d = s.load_detail || {};
      $("load-shards").textContent = d.shards_total ? `Weight shards ${d.shards_done} / ${d.shards_total}` : "";
      $("load-eta").textContent = d.seconds_left != null ? `~${Math.round(d.seconds_left)} s left` : "";
      if (d.nodes && $("nodes")) {  // a multi-node deployment: every node's load side by side
        $("nodes").querySelector("tbody").innerHTML = d.nodes.map((n) => `<tr data-rank="${esc(n.rank)}"><td>${esc(n.rank)}${n.rank ? "" : " (head)"}</td>` +
          `<td>${esc(n.node)}</td><td>${esc(n.state)}</td><td>${esc(PHASES[n.phase] || n.phase || "—")}</td>` +
          `<td class="num">${Math.round(n.percent || 0)} %</td></tr>`).join("");
      }
      if (s.smoke && s.smoke.reply !== undefined) {
        $("smoke").innerHTML = `<div><strong>Reply:</strong> <span id="smoke-reply">${esc(s.smoke.reply)}</span></div>` +
          (s.smoke.reasoning ? `<div class="muted"><strong>Reasoning:</strong> ${esc(s.smoke.reasoning.slice(0, 300))}</div>` : "") +
          `<div class="muted">${s.smoke.latency_s.toFixed(2)} s · ${s.smoke.prompt_tokens} prompt + ${s.smoke.completion_tokens} completion tokens</div>`;
      }
    } else if (msg.kind.startsWith("event.")) {
      const e = msg.data;
      const body = document.querySelector("#timeline tbody");
      body.querySelector(".empty-row")?.remove();
      let row = body.querySelector(`tr[data-event="${e.id}"]`);
      if (!row) {
        // Snapshots arrive in any order after a reconnect: keep the timeline in step order (by id).
        row = document.createElement("tr");
        row.dataset.event = e.id;
        const next = [...body.querySelectorAll("tr[data-event]")].find((r) => Number(r.dataset.event) > e.id);
        body.insertBefore(row, next || null);
      }
      row.className = e.level;
      row.innerHTML = `<td>${esc(e.step)}</td><td>${new Date(e.started).toLocaleTimeString([], { hour12: false })}</td>` +
        `<td class="num">${e.ended && e.ended === e.started ? "—" : e.duration != null ? e.duration.toFixed(1) + " s" : "…"}</td><td>${esc(e.message)}</td>`;
    } else if (msg.kind === "engine") {
      if (!serving) return;  // a last sample sent as the engine stopped, or the previous engine's, is not "now"
      const e = msg.data;
      $("engine-now").textContent = `${e.tok_s.toFixed(1)} tok/s · ${e.running ?? "?"} running, ${e.waiting ?? "?"} waiting` +
        (e.kv_cache != null ? ` · KV cache ${(100 * e.kv_cache).toFixed(0)} %` : "") +
        (e.refused ? ` · ${e.refused} refused for load in ${Math.round(e.window_s / 60) || 1} min (its admission caps)` : "");
    } else if (msg.kind === "log") {
      const atBottom = logEl.scrollTop + logEl.clientHeight >= logEl.scrollHeight - 20;
      logEl.textContent += (logEl.textContent ? "\n" : "") + msg.data.lines.join("\n");
      if (logEl.textContent.length > 400000) logEl.textContent = logEl.textContent.slice(-300000);
      if (atBottom) logEl.scrollTop = logEl.scrollHeight;
    }
  });
  // A multi-node deployment: every node's GPUs (its RAM without GPUs), each from its own node's feed.
  const size = window.humanBytes;  // live.js
  for (const node of D.nodes) {
    Live.subscribe("node:" + node, (msg) => {
      if (msg.kind !== "sample") return;
      document.querySelectorAll(`#node-gpus tr[data-node="${node}"]`).forEach((row) => {
        const cell = row.querySelector('[data-f="mem"]');
        if (row.dataset.ram) {
          const h = msg.data.host || {};
          cell.textContent = h.ram_total && h.ram_available != null ? `RAM ${size(h.ram_total - h.ram_available)} / ${size(h.ram_total)}` : "RAM —";
          return;
        }
        const g = msg.data.gpus.find((x) => x.index === Number(row.dataset.gpu));
        if (g) cell.textContent = (g.memory_used == null ? "—" : size(g.memory_used)) + (g.memory_total ? " / " + size(g.memory_total) : "");
      });
    });
  }
  if (D.gpus.length) {
    Live.subscribe("node:" + D.node, (msg) => {
      if (msg.kind !== "sample") return;
      const mine = msg.data.gpus.filter((g) => D.gpus.includes(g.index));
      $("gpu-memory").textContent = "GPU memory: " + mine.map((g) => `GPU ${g.index} ${g.memory_used == null ? "unknown" : gib(g.memory_used)}`).join(" · ");
    });
  }
})();
