// The one WebSocket helper for live data.
//   Live.subscribe("node:3", (msg) => { ... msg.kind, msg.data, msg.snapshot ... });
// One socket per page; it reconnects with backoff and re-subscribes, and the server sends each
// topic's snapshot first, so a chart rebuilt from snapshot + deltas never shows stale values.
// While the page cannot get live data a banner says so ("Live updates paused: reconnecting…").
(function () {
  const handlers = new Map(); // topic -> [fn]
  let socket = null;
  let retry = 0;
  let timer = null;
  let closedForGood = false;
  // The server sends {"beat": seconds} through the Channels layer every `seconds` (plumbing/live/consumer.py).
  // No beat for three periods means the layer lost this socket's groups (Redis restarted empty) or the
  // connection is dead without a close: reconnect, which joins the groups again and redraws from snapshots.
  let beatEvery = 5;  // seconds, until the server says
  let lastBeat = 0;
  let banner = null;

  function showBanner(shown) {
    if (!banner && !shown) return;
    if (!banner) {
      banner = document.createElement("div");
      banner.id = "live-banner";
      banner.setAttribute("role", "status");
      banner.textContent = "Live updates paused: reconnecting…";
      banner.style.cssText = "position:sticky;top:0;z-index:50;padding:6px 12px;background:#78350f;color:#fde68a;" +
        "font-size:13px;text-align:center";
      document.body.prepend(banner);
    }
    banner.hidden = !shown;
  }

  function setState(state) {
    document.documentElement.dataset.live = state;
    const badge = document.getElementById("live-state");
    if (badge) { badge.textContent = state; badge.className = "live-state " + state; }
    // The page cannot get live data: say so until a new connection is accepted (a first load's connecting is no outage).
    if (state === "live" || state === "denied") showBanner(false);
    else if (state === "reconnecting") showBanner(true);
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    timer = null;
    socket = new WebSocket(`${scheme}://${location.host}/ws/live/`);
    if (document.documentElement.dataset.live !== "reconnecting") setState("connecting");  // first load: no banner
    socket.onopen = () => {
      retry = 0;
      lastBeat = Date.now();
      setState("live");  // the server joined this socket's groups before accepting it
      const topics = [...handlers.keys()];
      for (let i = 0; i < topics.length; i += 50) {  // the server reads at most 50 topics a message
        socket.send(JSON.stringify({ subscribe: topics.slice(i, i + 50) }));
      }
    };
    socket.onmessage = (event) => {
      const msg = JSON.parse(event.data);
      if (msg.beat) {
        beatEvery = msg.beat;
        lastBeat = Date.now();
        return;
      }
      if (msg.error) { console.warn("live:", msg.error); return; }
      for (const fn of handlers.get(msg.topic) || []) {
        try { fn(msg); } catch (err) { console.error(err); }
      }
    };
    socket.onclose = (event) => {
      // 4401/4403: not logged in / no role; reconnecting would not help.
      if (event.code === 4401 || event.code === 4403) { closedForGood = true; setState("denied"); return; }
      later();
    };
  }

  function later() {
    setState("reconnecting");
    const delay = Math.min(5000, 500 * 2 ** retry++);  // at most 5 s: back soon after Redis or the server is
    timer = setTimeout(connect, delay);
  }

  // A socket open but without beats is given up (its close handshake may never come) and replaced.
  setInterval(() => {
    if (!socket || socket.readyState !== WebSocket.OPEN || Date.now() - lastBeat < (3 * beatEvery + 1) * 1000) return;
    const old = socket;
    old.onclose = old.onmessage = null;
    try { old.close(4000, "no heartbeat"); } catch (err) { /* already closing */ }
    later();
  }, 1000);

  // After an action (a click, a submit, the tab shown again, the network back) a socket waiting out
  // its backoff reconnects at once: the indicator never sits on "reconnecting" while the server is up.
  function reconnectNow() {
    if (closedForGood || !timer || !socket || socket.readyState === WebSocket.OPEN) return;
    clearTimeout(timer);
    timer = null;
    retry = 0;
    connect();
  }
  for (const type of ["click", "submit", "focus", "online"]) window.addEventListener(type, reconnectNow, true);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) reconnectNow(); });

  window.Live = {
    socket() { return socket; },  // for tests that simulate a dropped connection
    subscribe(topic, fn) {
      const first = !handlers.has(topic);
      if (first) handlers.set(topic, []);
      handlers.get(topic).push(fn);
      if (!socket && !closedForGood) connect();
      else if (first && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ subscribe: [topic] }));
    },
  };
})();

// A size as every page writes it (modelfit.human_bytes): "2,048 B", "302 MiB", "3.6 MiB", "1.5 GiB", "509 GiB".
window.humanBytes = (b) => {
  if (b < 1e5) return `${Math.round(b).toLocaleString("en")} B`;
  const [value, unit] = b >= 2 ** 30 ? [b / 2 ** 30, "GiB"] : [b / 2 ** 20, "MiB"];
  return Math.round(value * 10) / 10 < 100 ? `${value.toFixed(1)} ${unit}` : `${Math.round(value).toLocaleString("en")} ${unit}`;
};

// A destructive button (Stop, Delete) says what it does and asks first: <button data-confirm="Stop x?">.
document.addEventListener("submit", (event) => {
  const button = event.submitter;
  if (button?.dataset.confirm && !window.confirm(button.dataset.confirm)) event.preventDefault();
}, true);
