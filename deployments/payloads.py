"""The deployments app's live messages: its topics ("fleet", "node:<id>", "deployment:<id>", "model:<id>"),
one frozen dataclass per message kind and one sender per message, so each payload goes to the same topics
every time. plumbing.live publishes them and keeps the snapshots; the browser code in static/panel/ reads
these field names. The topics are registered in DeploymentsConfig.ready().
"""
import json
from dataclasses import asdict, dataclass

from deployments.models import Deployment, DeploymentEvent, ModelCopy, ModelRepo, Node
from plumbing.live import fleetfeed, publishing
from plumbing.live.publishing import LiveMessage, pick
from plumbing.live.topics import Topic, exists_in

TIMELINE_STEPS = 200  # sent on subscribe when Redis forgot a deployment: the newest ones; a deploy has a few dozen


# --- topics: who may subscribe, what a subscriber gets beyond the kept snapshot --------------------

def _deployment_from_database(deployment_id: int, kept: list[LiveMessage]) -> list[LiveMessage]:
    """A deployment whose kept status is gone (Redis restarted empty keeps nothing): its status and timeline
    read from the database, so a page that reconnects after the restart redraws what is true, not what it had."""
    if any(m["kind"] == "status" for m in kept):
        return []
    d = Deployment.objects.filter(pk=deployment_id).first()
    if d is None:
        return []
    topic = deployment_topic(d.pk)
    events = DeploymentEvent.objects.filter(deployment=d).order_by("-started", "-pk")[:TIMELINE_STEPS]
    return [{"topic": topic, "kind": "status", "data": asdict(DeploymentStatus.of(d))}] + [
        {"topic": topic, "kind": f"event.{e.pk}", "data": asdict(TimelineStep.of(e))} for e in reversed(events)]


FLEET = Topic(fleetfeed.FLEET)  # the fleet page: FleetNode states through plumbing/live/fleetfeed.py
NODE = Topic("node", existing=exists_in(Node))
DEPLOYMENT = Topic("deployment", existing=exists_in(Deployment), snapshot=_deployment_from_database)
MODEL = Topic("model", existing=exists_in(ModelRepo))
TOPICS = (FLEET, NODE, DEPLOYMENT, MODEL)


def node_topic(node_id: int) -> str:
    return NODE.name(node_id)


def deployment_topic(deployment_id: int) -> str:
    return DEPLOYMENT.name(deployment_id)


def model_topic(model_id: int) -> str:
    return MODEL.name(model_id)


# --- payloads: what each kind of message carries -------------------------------------------------

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
        return pick(cls, d, id=d.pk, status_display=d.badge, message=d.status_message)


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
    refused: int = 0  # requests the engine refused for load (its admission caps) in the window
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
    retries: int  # transient failures retried so far
    retry: dict | None  # while a retry waits: {"at": ISO time of the next try, "reason": the failure}

    @classmethod
    def of(cls, copy: ModelCopy, state: str | None = None) -> "CopyProgress":
        return pick(cls, copy, id=copy.pk, model=copy.model_id, node=copy.node_id, node_name=copy.node.name,
                     state=state or copy.state, files=copy.progress.get("files", {}),
                     current_file=copy.progress.get("current_file"), retries=copy.progress.get("retries", 0),
                     retry=copy.progress.get("retry"))


# --- senders: one per message, so each payload goes to the same topics every time ---------------

def send_deployment_status(d: Deployment) -> None:
    data = asdict(DeploymentStatus.of(d))
    publishing.publish(deployment_topic(d.pk), "status", data)
    publishing.publish(node_topic(d.node_id), f"deployment.{d.pk}", data)


def send_timeline_step(event: DeploymentEvent) -> None:
    publishing.publish(deployment_topic(event.deployment_id), f"event.{event.pk}", asdict(TimelineStep.of(event)))


def send_log_lines(deployment_id: int, lines: list[str]) -> None:
    publishing.publish(deployment_topic(deployment_id), "log", asdict(LogLines(lines)), keep=False)


def send_engine_figures(node_id: int, figures: EngineFigures) -> None:
    data = asdict(figures)
    publishing.publish(deployment_topic(figures.id), "engine", data)
    publishing.publish(node_topic(node_id), f"engine.{figures.id}", data)


def send_node_sample(node_id: int, sample: dict) -> None:
    data = asdict(NodeSample(**sample))
    fleet_node = json.dumps(asdict(FleetNode.of(data)), separators=(",", ":"))
    publishing.publish(node_topic(node_id), "sample", data, also=fleetfeed.announce(node_id, fleet_node))


def send_model_inspected(model_id: int) -> None:
    publishing.publish(model_topic(model_id), "model", asdict(ModelInspected()))


def send_model_inspect_failed(model_id: int, error: str, code: str) -> None:
    publishing.publish(model_topic(model_id), "model", asdict(ModelInspectFailed(error, code)))


def send_copy(copy: ModelCopy) -> None:
    send_copy_progress(CopyProgress.of(copy))


def send_copy_progress(progress: CopyProgress) -> None:
    data = asdict(progress)
    publishing.publish(model_topic(progress.model), f"copy.{progress.id}", data)
    publishing.publish(node_topic(progress.node), f"copy.{progress.id}", data)
