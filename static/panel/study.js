// Study page: the variant × level matrix fills in as trials finish; verdicts, Pareto view and winner
// once results exist; the variant being loaded or measured shows its load progress and live tok/s.
(function () {
  const S = window.STUDY;
  let study = JSON.parse(document.getElementById("initial").textContent);
  let runTopic = null;
  const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
  const fmt = (v, d = 1) => (v == null ? "—" : Number(v).toLocaleString(undefined, { maximumFractionDigits: d, minimumFractionDigits: d }));
  const pct = (v) => (v == null ? "—" : (v >= 0 ? "+" : "") + (100 * v).toFixed(1) + " %");
  const el = (id) => document.getElementById(id);
  const paretoEl = el("chart-pareto");
  const colors = ["#2563eb", "#16a34a", "#d97706", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
  let pareto = null;
  // A scatter as uPlot draws one in its ordinary mode: x is every output tok/s measured (sorted), one series
  // per variant with its per-user rate where it has a point and gaps elsewhere, drawn as points only.
  // (uPlot's mode 2 draws nothing without a hand-written paths function.)
  function drawPareto(points) {
    const names = [...new Map(points.map((p) => [p.variant, p.name])).entries()];
    const xs = [...new Set(points.map((p) => p.output_tok_s))].sort((a, b) => a - b);
    const data = [xs, ...names.map(([id]) => xs.map((x) => {
      const p = points.find((q) => q.variant === id && q.output_tok_s === x);
      return p ? p.per_user : null;
    }))];
    if (pareto) pareto.destroy();
    pareto = new uPlot({ width: Math.max(300, paretoEl.clientWidth), height: 240, scales: { x: { time: false } },
      legend: { live: false },
      series: [{ label: "output tok/s" }, ...names.map(([, name], i) => ({ label: name, stroke: colors[i % colors.length],
        paths: () => null, points: { show: true, size: 9, fill: colors[i % colors.length] } }))],
      axes: [{ label: "output tok/s" }, { label: "tok/s per user", size: 60 }] }, data, paretoEl);
    window.studyView.pareto = pareto;
  }
  window.studyView = { pareto, drawn: () => (pareto ? pareto.data.slice(1).flat().filter((v) => v != null).length : 0),
    cells: () => document.querySelectorAll("#matrix span[data-tok-s]").length };

  // A level's name as the page shows it: a concurrency "c=16", a rate ("4/s") "4 req/s".
  const levelLabel = (c) => String(c).endsWith("/s") ? `${String(c).slice(0, -2)} req/s` : `c=${c}`;

  function matrix() {
    const levels = study.levels;
    el("matrix").querySelector("thead").innerHTML = "<tr><th>Variant</th>" + levels.map((c) => `<th class="num">${esc(levelLabel(c))}</th>`).join("") + "<th>Trials</th></tr>";
    el("matrix").querySelector("tbody").innerHTML = study.variants.map((v) => {
      const trials = study.trials.filter((t) => t.variant === v.id);
      const cells = levels.map((c) => `<td class="num">` + trials.map((t) => {
        const p = t.points[String(c)];
        if (p && t.status === "done") return `<span data-tok-s="${p.tok_s}" data-repeat="${t.repeat}">${fmt(p.tok_s, 0)}</span>`;
        return `<span class="muted" title="${esc(t.error)}">${t.status === "pending" ? "·" : t.status === "skipped" ? "–" : t.status === "failed" ? "✗" : "…"}</span>`;
      }).join(" ") + "</td>");
      const flags = [...Object.entries(v.env).map(([k, x]) => `${k}=${x}`), ...Object.entries(v.engine_args).map(([k, x]) => `--${k} ${x}`)].join(", ");  // as studies.describe names them
      const debug = v.debug_vars.length ? ` <span class="badge failed" title="NCCL's documentation lists these for debugging, not production">debug: ${esc(v.debug_vars.join(", "))}</span>` : "";
      // The name, then the settings unless the name already says them (a variant named by its flags, "baseline").
      const said = v.is_baseline && v.name === "baseline" ? "" : v.is_baseline ? " (baseline)" : "";
      const settings = flags && flags !== v.name ? `<div class="muted">${esc(flags)}</div>` : "";
      return `<tr data-variant="${v.id}"><td><strong>${esc(v.name)}</strong>${said}${debug}${settings}` +
        (v.failed ? `<div class="errorlist">failed: ${esc(v.failed)}</div>` : "") + `</td>${cells.join("")}` +
        `<td>${trials.filter((t) => !["pending", "deploying", "benchmarking"].includes(t.status)).length}/${trials.length}</td></tr>`;
    }).join("");
    const runs = study.trials.filter((t) => t.run && t.status === "done").map((t) => t.run);
    el("compare-runs").href = "/benchmarks/compare/?runs=" + runs.slice(0, 12).join(",");
  }

  function verdicts() {
    const r = study.results;
    const body = el("verdicts").querySelector("tbody");
    if (!r) { body.innerHTML = `<tr><td colspan="5" class="muted">Once the study has finished.</td></tr>`; return; }
    const rows = [];
    for (const v of r.variants) {
      for (const [key, est] of Object.entries(v.estimates)) {
        if (!est) continue;
        const [metric, level] = key.split("@");
        const cmp = v.comparisons[key];
        const label = (r.metrics[metric] || metric) + (level ? ` at ${levelLabel(level)}` : "");
        // Too few repeats: the figure alone, no interval, and the row says why there is no verdict.
        const range = (lo, hi, f) => (lo == null || hi == null ? "" : ` [${f(lo)}, ${f(hi)}]`);
        rows.push(`<tr data-variant="${v.id}" data-key="${key}"><td>${esc(v.name)}</td><td>${esc(label)}</td>` +
          `<td class="num" title="${est.why ? esc(est.why) : "the mean over repeats and its 95 % interval"}">${fmt(est.value ?? est.median)}${range(est.low, est.high, fmt)}</td>` +
          `<td class="num">${cmp ? `${pct(cmp.rel)}${range(cmp.rel_low, cmp.rel_high, pct)}` : "—"}</td>` +
          `<td class="verdict" title="${cmp && cmp.why ? esc(cmp.why) : ""}">${cmp ? esc(cmp.verdict) + (cmp.why ? `<div class="muted">${esc(cmp.why)}</div>` : "") : v.is_baseline ? "baseline" : "—"}</td></tr>`);
      }
      if (v.failed) rows.push(`<tr data-variant="${v.id}"><td>${esc(v.name)}</td><td colspan="3" class="errorlist">${esc(v.failed)}</td><td class="verdict">failed</td></tr>`);
    }
    body.innerHTML = rows.join("");
    // Studies judged before the column was renamed stored output tok/s as "total".
    const points = (r.pareto || []).map((p) => ({ ...p, output_tok_s: p.output_tok_s ?? p.total }));
    drawPareto(points);
    const gpus = r.gpus > 0;  // per GPU only where there are GPUs
    el("pareto").querySelector("th[data-gpu]").hidden = !gpus;
    el("pareto").querySelector("tbody").innerHTML = points.map((p) => `<tr><td>${esc(p.name)}</td><td class="num">${esc(levelLabel(p.level))}</td>` +
      `<td class="num">${fmt(p.output_tok_s)}</td>${gpus ? `<td class="num">${fmt(p.per_gpu)}</td>` : ""}<td class="num">${fmt(p.per_user, 2)}</td><td>${p.front ? "★" : ""}${p.level_front ? " ◆" : ""}</td></tr>`).join("");
    const winner = r.variants.find((v) => v.id === r.winner);
    el("winner").textContent = winner ? `${winner.name}: ${r.winner_why}` : r.winner_why || "—";
    const perLevel = r.per_level || { levels: [] };  // studies judged before per-level winners have none
    el("crossover").textContent = perLevel.crossover || perLevel.note || "";
    el("level-winners").querySelector("tbody").innerHTML = perLevel.levels.map((w) => `<tr data-level="${w.level}">` +
      `<td class="num">${esc(w.label || levelLabel(w.level))}</td><td>${esc(w.name || "—")}</td><td class="muted">${esc(w.why)}</td></tr>`).join("");
    const form = el("apply-form");
    if (form && ["done", "cancelled", "failed"].includes(study.status)) {
      form.hidden = false;
      const select = el("apply-variant");
      const chosen = select.value;  // a live update redraws the options: keep what the user picked
      select.innerHTML = r.variants.filter((v) => !v.failed).map((v) => `<option value="${v.id}" ${v.id === r.winner ? "selected" : ""}>${esc(v.name)}${v.id === r.winner ? " (winner)" : ""}</option>`).join("");
      if (chosen && [...select.options].some((o) => o.value === chosen)) select.value = chosen;
      const levelSelect = el("apply-level");
      const pickedLevel = levelSelect.value;
      levelSelect.innerHTML = `<option value="">—</option>` + perLevel.levels.filter((w) => w.winner).map((w) =>
        `<option value="${esc(w.level)}">${esc(w.label || levelLabel(w.level))}: ${esc(w.name)}</option>`).join("");
      levelSelect.value = pickedLevel;
      levelSelect.onchange = () => {  // the level's winner is what will be applied: show it as the variant
        const w = perLevel.levels.find((x) => String(x.level) === levelSelect.value);
        if (w) select.value = String(w.winner);
        warn();
      };
      const warn = () => {
        const v = r.variants.find((x) => String(x.id) === select.value);
        const names = v ? v.debug_vars : [];
        el("debug-warning").hidden = el("confirm-label").hidden = !names.length;
        el("debug-warning").textContent = names.length ? `${v.name} sets ${names.join(", ")}: NCCL's documentation lists these for debugging, not for production.` : "";
      };
      select.onchange = () => { levelSelect.value = ""; warn(); };  // a variant picked by hand is what is applied
      warn();
    }
  }

  function status() {
    const badge = el("study-status");
    badge.textContent = study.status_display;
    badge.className = "badge " + study.status;
    el("study-error").textContent = study.error || "";
    if (study.estimate_s) el("estimate").textContent = `${(study.estimate_s / 60).toFixed(1)} min`
      + (study.estimate_basis ? ` (${study.estimate_basis})` : "") + (study.took_s ? `; took ${(study.took_s / 60).toFixed(1)} min` : "")
      + (study.left_s != null ? `; about ${(study.left_s / 60).toFixed(1)} min left, from its trials so far` : "");
    el("progress").textContent = `${study.trials_done} / ${study.trials_total} trials` + (study.pause_requested ? " · pausing after this trial" : "") + (study.cancel_requested ? " · cancelling" : "");
    document.querySelectorAll("#controls form[data-when]").forEach((f) => { f.hidden = !f.dataset.when.split(" ").includes(study.status); });
    const c = study.current;
    if (!c) { el("now").textContent = ["finishing"].includes(study.status) ? "restoring the deployment" : "—"; return; }
    const v = study.variants.find((x) => x.id === c.variant);
    el("now").dataset.variant = v ? v.name : "";
    if (v && c.status === "deploying" && !el("now").textContent.startsWith(v.name)) el("now").textContent = `${v.name}: redeploying…`;
    if (c.run && runTopic !== "run:" + c.run) {
      runTopic = "run:" + c.run;
      const topic = runTopic;
      Live.subscribe(topic, (msg) => {
        if (msg.kind !== "tick" || runTopic !== topic || !study.current) return;
        el("now").textContent = `${v.name}: concurrency ${msg.data.concurrency}, ${fmt(msg.data.tok_s)} tok/s, ${msg.data.completed} done`;
      });
    }
  }

  function draw() { status(); matrix(); verdicts(); }
  draw();
  Live.subscribe("study:" + S.id, (msg) => { if (msg.kind === "study") { study = msg.data; draw(); } });
  Live.subscribe("deployment:" + S.deployment, (msg) => {
    if (msg.kind !== "status" || !study.current || study.current.status !== "deploying") return;
    const v = study.variants.find((x) => x.id === study.current.variant);
    const d = msg.data;
    el("now").textContent = `${v ? v.name : ""}: ${d.status_display}` + (d.status === "loading" ? ` · ${d.load_phase || "starting"} ${fmt(d.load_percent || 0, 0)} %` : "");
  });
})();
