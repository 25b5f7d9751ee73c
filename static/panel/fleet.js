// Fleet dashboard: each node card's GPU memory bars, disk and online state follow live samples.
// One subscription for the whole fleet: each message of kind "nodes" carries only the nodes that
// changed since the last one ({"nodes": {"<id>": {t, gpus, disk}}}), the first one all of them.
(function () {
  const gib = (b) => (b / 2 ** 30).toFixed(1) + " GiB";
  const cards = new Map(); // node id (text) -> {card, lastT}
  for (const card of document.querySelectorAll(".node-card")) {
    const state = { card, lastT: card.dataset.lastHeartbeat ? Number(card.dataset.lastHeartbeat) : null };
    cards.set(card.dataset.node, state);
    const heartbeat = Number(card.dataset.heartbeat);
    const badge = card.querySelector('[data-role="online"]');
    setInterval(() => {
      if (state.lastT == null) return;
      const online = Date.now() / 1000 - state.lastT < 3 * heartbeat;
      badge.className = "badge " + (online ? "online" : "offline");
      badge.textContent = online ? "online" : "offline since " + new Date(state.lastT * 1000).toLocaleString();
    }, 1000);
  }
  if (!cards.size) return;
  Live.subscribe("fleet", (msg) => {
    if (msg.kind !== "nodes") return;
    for (const [id, node] of Object.entries(msg.data.nodes)) {
      const state = cards.get(id);
      if (!state || (state.lastT && node.t < state.lastT)) continue;  // not on this page, or older than shown
      state.lastT = node.t;
      for (const g of node.gpus || []) {
        const row = state.card.querySelector(`.gpu-row[data-gpu="${g.index}"]`);
        if (!row || g.memory_used == null) continue;
        row.querySelector('[data-role="mem"]').textContent = `${gib(g.memory_used)} / ${gib(g.memory_total)}`;
        row.querySelector('[data-role="bar"]').style.width = (100 * g.memory_used / g.memory_total).toFixed(1) + "%";
      }
      if (node.disk && node.disk.total) state.card.querySelector('[data-role="disk"]').textContent = `${gib(node.disk.free)} of ${gib(node.disk.total)}`;
    }
  });
})();
