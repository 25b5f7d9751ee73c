// Fleet dashboard: each node card's GPU memory bars and disk follow the node's live samples.
(function () {
  const gib = (b) => (b / 2 ** 30).toFixed(1) + " GiB";
  for (const card of document.querySelectorAll(".node-card")) {
    Live.subscribe("node:" + card.dataset.node, (msg) => {
      if (msg.kind !== "sample") return;
      for (const g of msg.data.gpus || []) {
        const row = card.querySelector(`.gpu-row[data-gpu="${g.index}"]`);
        if (!row || g.memory_used == null) continue;
        row.querySelector('[data-role="mem"]').textContent = `${gib(g.memory_used)} / ${gib(g.memory_total)}`;
        row.querySelector('[data-role="bar"]').style.width = (100 * g.memory_used / g.memory_total).toFixed(1) + "%";
      }
      if (msg.data.disk) card.querySelector('[data-role="disk"]').textContent = `${gib(msg.data.disk.free)} of ${gib(msg.data.disk.total)}`;
    });
  }
})();
