"""The one place that knows live group names and payload shapes, and the only caller of group_send.

Browsers subscribe to topics ("fleet", "node:<id>", "deployment:<id>", "model:<id>", "run:<id>",
"study:<id>").
Each message is {"topic", "kind", "data"}, `data` being one of the payload dataclasses below as a
JSON object. The last message of each kind per topic is kept in Redis as that topic's snapshot, so
a browser that (re)connects first gets the current state, then deltas. Services call the send_*
functions; the browser code in static/panel/ reads these field names.
"""
import asyncio
import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, TypedDict

import redis
from channels.layers import get_channel_layer
from django.conf import settings

from deployments.models import Deployment, DeploymentEvent, ModelCopy
from plumbing import redisconn

TOPIC_RE = re.compile(r"^(fleet|(node|deployment|model|run|study):[0-9]{1,12})$")
SNAPSHOT_TTL = 3600


class LiveMessage(TypedDict):
    topic: str
    kind: str
    data: dict[str, Any]  # asdict() of one of the payload dataclasses below


def valid_topic(topic: str) -> bool:
    return bool(TOPIC_RE.match(topic or ""))


def group_name(topic: str) -> str:
    """Channels group for a topic (group names allow letters, digits, '-', '_', '.')."""
    return "live." + topic.replace(":", ".")


def node_topic(node_id: int) -> str:
    return f"node:{node_id}"


def deployment_topic(deployment_id: int) -> str:
    return f"deployment:{deployment_id}"


def model_topic(model_id: int) -> str:
    return f"model:{model_id}"


def run_topic(run_id: int) -> str:
    return f"run:{run_id}"


def study_topic(study_id: int) -> str:
    return f"study:{study_id}"


log = logging.getLogger(__name__)
FLEET = "fleet"


def _snapshot_key(topic: str) -> str:
    return redisconn.key("snapshot", topic)


def fleet_state_key() -> str:
    """Redis hash: node id -> that node's FleetNode (JSON), the fleet page's whole state."""
    return redisconn.key("fleet", "state")


def fleet_channel() -> str:
    """Redis pub/sub channel: "<node id> <FleetNode JSON>" each time a node's state changes; every web
    process's fleet feed (deployments/livefeed.py) coalesces them for its own fleet-page sockets."""
    return redisconn.channel("fleet", "changes")


def publish(topic: str, kind: str, data: dict[str, Any], keep: bool = True, also=None) -> None:
    """Send one message to every browser watching `topic`; keep it as the topic's snapshot of `kind`.
    `also(pipe)` adds commands to the same Redis round trip."""
    message: LiveMessage = {"topic": topic, "kind": kind, "data": data}
    try:
        if keep or also:
            pipe = redisconn.client().pipeline()
            if keep:
                key = _snapshot_key(topic)
                pipe.hset(key, kind, json.dumps(message))
                pipe.expire(key, SNAPSHOT_TTL)
            if also:
                also(pipe)
            pipe.execute()
    except (redis.RedisError, OSError) as exc:
        # Browsers miss this update (they get a fresh snapshot on reconnect); the caller's work,
        # recorded in the database, must not fail because Redis is away.
        log.warning("live update %s/%s not sent: %s", topic, kind, exc)
        return
    _group_send(group_name(topic), {"type": "live.message", "message": message}, f"update {topic}/{kind}")


_sender: dict = {"pid": None, "loop": None}
_sender_lock = threading.Lock()


def _sender_loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for sends from sync code (started on first use, again in a forked child)."""
    with _sender_lock:
        if _sender["pid"] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="live-sender", daemon=True).start()
            _sender.update(pid=os.getpid(), loop=loop)
        return _sender["loop"]


def _group_send(group: str, event: dict, what: str) -> None:
    """group_send from sync code, on one event loop per process kept for it: its Redis connections stay
    open (async_to_sync made a thread, a loop and a new connection for every message, ~1 ms each for
    each of a fleet's samples), and a caller whose thread runs a loop (ORM signals in async code,
    Playwright's sync API in the tests) is served the same way."""
    future = asyncio.run_coroutine_threadsafe(get_channel_layer().group_send(group, event), _sender_loop())
    try:
        future.result(5)
    except (redis.RedisError, OSError, TimeoutError) as exc:
        future.cancel()
        log.warning("live %s not sent: %s", what, exc or "timed out")


def user_group(user_id: int) -> str:
    return f"live.user.{int(user_id)}"


def session_group(session_key: str) -> str:
    return f"live.session.{session_key}"


def socket_group(channel_name: str) -> str:
    """A group of one socket alone, for its heartbeat (group names allow no "!")."""
    return "live.socket." + channel_name.replace("!", ".")


async def beat(layer, channel_name: str, every: float) -> None:
    """A socket's heartbeat, through the layer as updates go: it arrives only while the layer still holds
    the socket's groups, which Redis restarted empty (or flushed) forgets without a word."""
    try:
        await asyncio.wait_for(layer.group_send(socket_group(channel_name), {"type": "live.beat", "every": every}), 5)
    except (redis.RedisError, OSError, TimeoutError):
        pass  # the browser notices the missing beat


def _send_control(group: str, kind: str) -> None:
    _group_send(group, {"type": kind}, f"{kind} to {group}")


def end_session(session_key: str) -> None:
    """Close the WebSockets opened with this session (its user logged out)."""
    _send_control(session_group(session_key), "session.end")


def recheck_user(user_id: int) -> None:
    """Make the user's WebSockets check their role again now (groups or account changed)."""
    _send_control(user_group(user_id), "session.recheck")


def snapshot(topic: str) -> list[LiveMessage]:
    """The last kept message of each kind for a topic (read by the consumer on subscribe)."""
    raw = redisconn.client().hgetall(_snapshot_key(topic))
    return [json.loads(value) for value in raw.values()]


def kept(topics: list[str], kind: str) -> list[dict[str, Any] | None]:
    """The data of each topic's kept message of `kind` (None where none is kept), in one round trip."""
    pipe = redisconn.client().pipeline(transaction=False)  # reads only: no MULTI/EXEC needed
    for topic in topics:
        pipe.hget(_snapshot_key(topic), kind)
    return [json.loads(raw)["data"] if raw else None for raw in pipe.execute()]


# --- payloads: what each kind of message carries -------------------------------------------------

def pick(cls, obj, **given):
    """An instance of the payload dataclass `cls` from obj's attributes of the same names, plus `given`."""
    return cls(**{f.name: given[f.name] if f.name in given else getattr(obj, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class DeploymentStatus:
    """kind "status" on deployment:<id>, "deployment.<id>" on node:<id>."""

    id: int
    name: str
    status: str
    status_display: str
    message: str
    load_phase: str
    load_percent: float | None
    load_detail: dict
    pid: int | None
    smoke: dict

    @classmethod
    def of(cls, d: Deployment) -> "DeploymentStatus":
        return pick(cls, d, id=d.pk, status_display=d.get_status_display(), message=d.status_message)


@dataclass(frozen=True)
class TimelineStep:
    """kind "event.<id>" on deployment:<id>: one step of the deploy timeline."""

    id: int
    step: str
    message: str
    level: str
    started: str  # ISO 8601
    ended: str | None
    duration: float | None

    @classmethod
    def of(cls, event: DeploymentEvent) -> "TimelineStep":
        return pick(cls, event, id=event.pk, started=event.started.isoformat(),
                     ended=event.ended.isoformat() if event.ended else None)


@dataclass(frozen=True)
class LogLines:
    """kind "log" on deployment:<id>, not kept: new engine log lines while it loads."""

    lines: list[str]


@dataclass(frozen=True)
class EngineFigures:
    """kind "engine" on deployment:<id>, "engine.<id>" on node:<id>: a ready engine's own /metrics."""

    id: int
    name: str
    tok_s: float  # generation tokens per second since the previous reading
    running: float | None
    waiting: float | None
    kv_cache: float | None  # fraction of the KV cache in use
    # Over the last `window_s` seconds (at most 5 minutes, deployments/host/slo.py): the notifications' SLO check
    # reads these from the kept message.
    ttft_p95_s: float | None = None
    error_share: float | None = None  # aborted or failed / finished
    window_requests: int = 0
    window_s: float = 0.0
    at: float = 0.0  # Unix time of the reading


@dataclass(frozen=True)
class NodeSample:
    """kind "sample" on node:<id>: one telemetry sample (the agent's dict, checked against these keys)."""

    t: float  # Unix time
    gpus: list[dict]  # host/gpu.py's GpuSample as a dict; processes carry "pgid" and "deployment"
    nvml_error: str
    disk: dict  # total, free, used
    host: dict  # ram_total, ram_available, load1, cpu_count, cpu_percent, net_rx_bps, net_tx_bps (None at first)


@dataclass(frozen=True)
class FleetNode:
    """One node in kind "nodes" on fleet ({"nodes": {"<node id>": FleetNode}}, only the nodes that
    changed since the socket's last message): what a fleet card shows, from the node's sample."""

    t: float
    gpus: list[dict]  # index, memory_used, memory_total, util_gpu
    disk: dict  # total, free

    @classmethod
    def of(cls, sample: dict) -> "FleetNode":
        return cls(t=sample["t"], disk={"total": sample["disk"].get("total"), "free": sample["disk"].get("free")},
                   gpus=[{"index": g["index"], "memory_used": g.get("memory_used"), "memory_total": g.get("memory_total"),
                          "util_gpu": g.get("util_gpu")} for g in sample["gpus"]])


@dataclass(frozen=True)
class ModelInspected:
    """kind "model" on model:<id>: the Hub (or the node) answered; the page reloads its details."""

    inspected: bool = True


@dataclass(frozen=True)
class ModelInspectFailed:
    """kind "model" on model:<id>: inspecting failed, with the reason."""

    error: str
    code: str


@dataclass(frozen=True)
class CopyProgress:
    """kind "copy.<id>" on model:<id> and node:<id>: a download's progress, or its removal (state "deleted")."""

    id: int
    model: int
    node: int
    node_name: str
    state: str
    bytes_done: int
    bytes_total: int
    rate: float
    seconds_left: float | None
    files: dict  # path -> [bytes done, bytes total]
    current_file: str | None
    error: str
    path: str

    @classmethod
    def of(cls, copy: ModelCopy, state: str | None = None) -> "CopyProgress":
        return pick(cls, copy, id=copy.pk, model=copy.model_id, node=copy.node_id, node_name=copy.node.name,
                     state=state or copy.state, files=copy.progress.get("files", {}),
                     current_file=copy.progress.get("current_file"))


# --- senders: one per message, so each payload goes to the same topics every time ---------------

def send_deployment_status(d: Deployment) -> None:
    data = asdict(DeploymentStatus.of(d))
    publish(deployment_topic(d.pk), "status", data)
    publish(node_topic(d.node_id), f"deployment.{d.pk}", data)


def send_timeline_step(event: DeploymentEvent) -> None:
    publish(deployment_topic(event.deployment_id), f"event.{event.pk}", asdict(TimelineStep.of(event)))


def send_log_lines(deployment_id: int, lines: list[str]) -> None:
    publish(deployment_topic(deployment_id), "log", asdict(LogLines(lines)), keep=False)


def send_engine_figures(node_id: int, figures: EngineFigures) -> None:
    data = asdict(figures)
    publish(deployment_topic(figures.id), "engine", data)
    publish(node_topic(node_id), f"engine.{figures.id}", data)


def stamp(text: str, key: str) -> str:
    """A JSON object's text with `key`: now (epoch seconds) added when LIVE_TRACE is on (perf/fleet_scale.py
    times the fleet feed's stages with it), else the text as it is."""
    return f'{text[:-1]},"{key}":{time.time()}}}' if settings.LIVE_TRACE else text


def send_node_sample(node_id: int, sample: dict) -> None:
    data = asdict(NodeSample(**sample))
    fleet_node = stamp(json.dumps(asdict(FleetNode.of(data)), separators=(",", ":")), "pub")

    def to_fleet(pipe):  # in the node topic's round trip: the fleet page's state, then its change
        pipe.hset(fleet_state_key(), str(node_id), fleet_node)
        pipe.expire(fleet_state_key(), SNAPSHOT_TTL)
        pipe.publish(fleet_channel(), f"{node_id} {fleet_node}")

    publish(node_topic(node_id), "sample", data, also=to_fleet)


def fleet_state() -> dict[str, str]:
    """Every node's FleetNode as JSON text, by node id (text): the fleet page's snapshot."""
    return {k.decode(): v.decode() for k, v in redisconn.client().hgetall(fleet_state_key()).items()}


def fleet_message(nodes: dict[str, str], snapshot: bool = False) -> str:
    """The WebSocket text of kind "nodes" on fleet from FleetNode JSON texts, without decoding them."""
    body = ",".join(f'"{node_id}":{text}' for node_id, text in nodes.items())
    tail = ',"snapshot":true' if snapshot else ""
    return f'{{"topic":"{FLEET}","kind":"nodes","data":{{"nodes":{{{body}}}}}{tail}}}'


def send_model_inspected(model_id: int) -> None:
    publish(model_topic(model_id), "model", asdict(ModelInspected()))


def send_model_inspect_failed(model_id: int, error: str, code: str) -> None:
    publish(model_topic(model_id), "model", asdict(ModelInspectFailed(error, code)))


def send_copy(copy: ModelCopy) -> None:
    send_copy_progress(CopyProgress.of(copy))


def send_copy_progress(progress: CopyProgress) -> None:
    data = asdict(progress)
    publish(model_topic(progress.model), f"copy.{progress.id}", data)
    publish(node_topic(progress.node), f"copy.{progress.id}", data)
