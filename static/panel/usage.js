// Usage page: one chart per measure, a line per key / model name / deployment, by hour or day (uPlot, as the
// other pages). Output tokens are drawn twice per name: reasoning dashed, content solid.
(function () {
  const el = document.getElementById("usage-data");
  if (!el) return;
  const data = JSON.parse(el.textContent);
  const colors = ["#2563eb", "#16a34a", "#d97706", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
  function chart(id, lines) {
    const target = document.getElementById(id);
    if (!target) return null;
    // x: Unix seconds of each hour or day of the window (uPlot's time scale), every one present, zero where unused.
    return new uPlot({ width: Math.max(300, target.clientWidth), height: 220, legend: { live: false },
      scales: { x: { time: true } },
      series: [{ label: data.by }, ...lines.map((l) => ({ label: l.label, stroke: l.color, dash: l.dash, width: 2,
        points: { size: 5 }, spanGaps: false }))],
      axes: [{}, { size: 60 }] }, [data.periods, ...lines.map((l) => l.values)], target);
  }
  const lines = (measure, suffix, dash) => data.labels.map((label, i) => ({
    label: label + (suffix || ""), color: colors[i % colors.length], dash: dash,
    values: data.series[measure][label] }));
  window.usageCharts = {
    requests: chart("chart-requests", lines("requests")),
    errors: chart("chart-errors", lines("errors")),
    prompt: chart("chart-prompt_tokens", lines("prompt_tokens")),
    output: chart("chart-output", [...lines("reasoning_tokens", " · reasoning", [6, 4]), ...lines("content_tokens", " · content")]),
  };
})();
