// Fleet dashboard: each node card's GPU memory bars, disk and online state follow live samples.
(function () {
  const gib = (b) => (b / 2 ** 30).toFixed(1) + " GiB";
  for (const card of document.querySelectorAll(".node-card")) {
    const heartbeat = Number(card.dataset.heartbeat);
    let lastT = card.dataset.lastHeartbeat ? Number(card.dataset.lastHeartbeat) : null;
    const badge = card.querySelector('[data-role="online"]');
    setInterval(() => {
      if (lastT == null) return;
      const online = Date.now() / 1000 - lastT < 3 * heartbeat;
      badge.className = "badge " + (online ? "online" : "offline");
      badge.textContent = online ? "online" : "offline since " + new Date(lastT * 1000).toLocaleString();
    }, 1000);
    Live.subscribe("node:" + card.dataset.node, (msg) => {
      if (msg.kind !== "sample" || (lastT && msg.data.t < lastT)) return;  // a late, older snapshot
      lastT = msg.data.t;
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
