// Comparison page: overlay the runs' throughput and TTFT against concurrency.
(function () {
  const el = document.getElementById("compare-data");
  if (!el) return;
  // Concurrency levels are overlaid; rate levels (another axis) are in each run's own page.
  const runs = JSON.parse(el.textContent).map((r) => ({ ...r, points: r.points.filter((p) => p.kind !== "rate") }));
  const colors = ["#2563eb", "#16a34a", "#d97706", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
  const levels = [...new Set(runs.flatMap((r) => r.points.map((p) => p.concurrency)))].sort((a, b) => a - b);
  function overlay(id, value) {
    const target = document.getElementById(id);
    const data = [levels, ...runs.map((r) => levels.map((c) => {
      const p = r.points.find((x) => x.concurrency === c);
      return p ? value(p) : null;
    }))];
    return new uPlot({ width: Math.max(300, target.clientWidth), height: 240, scales: { x: { time: false, distr: 3 } },
      // Labels without live values: a legend of "name: --" until the cursor is on the chart says nothing.
      legend: { live: false },
      series: [{ label: "concurrency" }, ...runs.map((r, i) => ({ label: r.label || r.name, stroke: colors[i % colors.length], width: 2, points: { size: 5 }, spanGaps: true }))],
      axes: [{ label: "concurrency" }, { size: 60 }] }, data, target);
  }
  window.compareCharts = { throughput: overlay("cmp-throughput", (p) => p.output_throughput), ttft: overlay("cmp-ttft", (p) => p.ttft_ms.median) };
})();
