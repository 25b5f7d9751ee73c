"""Periodic conditions, from what the control plane already has: each node's heartbeat (offline, back), its
model store's free space (the heartbeat's figures), its host doctor's exposure audit (engines answering local
users without a key), its GPUs' last telemetry sample (ECC errors, temperature),
crash episodes that ended (a deployment up again long enough), and each SLO against its engine's last kept
figures (the agent's reading of the engine's own /metrics over 5 minutes). One pass is conditions_check(), run by beat
(schedule.py) on the control queue; a test calls it directly. A condition fires once and resolves once: seen
again while firing, it adds nothing."""
import logging
import time
from datetime import timedelta

import redis
from django.db import transaction
from django.utils import timezone

from deployments import payloads
from deployments.models import Deployment, Node
from deployments.notify.alerts import alert_raise, alert_resolve, in_savepoint, open_alert, setting
from deployments.notify.models import Alert, Slo
from plumbing.live import snapshots

log = logging.getLogger(__name__)


def conditions_check() -> None:
    """One pass over every node and every open crash episode."""
    nodes = list(Node.objects.all())
    try:
        samples = snapshots.kept([payloads.node_topic(n.pk) for n in nodes], "sample") if nodes else []
    except redis.RedisError as exc:  # the rows still tell offline and disk; the GPU readings wait for Redis
        log.warning("notifications: no telemetry samples (%s); GPU checks skipped this time", exc)
        samples = [None] * len(nodes)
    for node, sample in zip(nodes, samples):
        in_savepoint(node_check, node, sample)
    for alert in Alert.objects.filter(group_key__startswith="down:", resolved=None).select_related("deployment"):
        in_savepoint(down_check, alert)
    slos = list(Slo.objects.select_related("deployment__node"))
    try:
        figures = snapshots.kept([payloads.deployment_topic(o.deployment_id) for o in slos], "engine") if slos else []
    except redis.RedisError as exc:  # a breach's clock waits for Redis; nothing is resolved on no news
        log.warning("notifications: no engine figures (%s); SLO checks skipped this time", exc)
        return
    for objective, engine in zip(slos, figures):
        in_savepoint(slo_check, objective, engine)


def _condition(kind: str, group: str, node: Node, firing: bool, title: str, body: str, resolved: str, **data) -> None:
    if firing:
        alert_raise(kind, node=node, title=title, body=body, data=data, fold=False)
    else:
        alert_resolve(group, resolved, node=node)


def node_check(node: Node, sample: dict | None) -> None:
    """Offline or back; disk below the threshold; ECC errors; a GPU too hot."""
    if node.last_heartbeat is not None:  # a node that never reported is not "offline", it is not there yet
        age = (timezone.now() - node.last_heartbeat).total_seconds()
        _condition("node_offline", "offline", node, not node.online, f"Node {node.name} is offline",
                   f"No heartbeat for {age:.0f} s (the agent beats every {node.heartbeat_seconds:g} s).",
                   f"Node {node.name} is back: heartbeats again.")
    threshold = setting("NOTIFY_DISK_FREE_PERCENT", 10)
    if node.disk_total:
        percent = 100.0 * node.disk_free / node.disk_total
        low = percent < threshold if open_alert("disk", node=node) is None else percent < threshold + 1  # hysteresis
        _condition("disk_low", "disk", node, low, f"Node {node.name}: model store {percent:.1f} % free",
                   f"{node.disk_free / 2**30:.1f} GiB free of {node.disk_total / 2**30:.1f} GiB (threshold {threshold:g} %).",
                   f"Node {node.name}: model store {percent:.1f} % free again.", free_bytes=node.disk_free)
    exposure = next((c for c in (node.host_checks or {}).get("checks") or [] if c.get("name") == "exposure"), None)
    if exposure is not None:  # the host doctor's audit: engine routes any local user reached without a key
        _condition("engine_exposed", "exposure", node, exposure.get("status") == "fail",
                   f"Node {node.name}: engines answer local users without a key", exposure.get("summary", ""),
                   f"Node {node.name}: engine ports answer only the panel again.",
                   engines=sorted((exposure.get("data") or {}).get("open") or {}))
    if not sample or not node.online:
        return
    gpus = sample.get("gpus") or []
    uncorrected = {g["index"]: g.get("ecc_dbe_volatile") for g in gpus if g.get("ecc_dbe_volatile")}
    _condition("gpu_ecc", "ecc", node, bool(uncorrected), f"Node {node.name}: uncorrected ECC errors on GPU "
               + ", ".join(map(str, sorted(uncorrected))),
               "Uncorrected (double-bit) ECC errors since the driver loaded: " +
               ", ".join(f"GPU {i}: {n}" for i, n in sorted(uncorrected.items())) + ". Drain the GPU and reset it.",
               f"Node {node.name}: no uncorrected ECC errors (the driver was reloaded).", gpus=sorted(uncorrected))
    hot_c = setting("NOTIFY_GPU_TEMP_C", 85)
    limit = hot_c if open_alert("thermal", node=node) is None else hot_c - 5
    hot = {g["index"]: g["temperature_c"] for g in gpus if (g.get("temperature_c") or 0) >= limit}
    _condition("gpu_thermal", "thermal", node, bool(hot), f"Node {node.name}: GPU temperature high",
               ", ".join(f"GPU {i}: {t} °C" for i, t in sorted(hot.items())) + f" (threshold {hot_c:g} °C; "
               "the driver throttles clocks near its slowdown temperature).",
               f"Node {node.name}: GPU temperatures below {hot_c - 5:g} °C again.", gpus=sorted(hot))


def down_check(alert: Alert) -> None:
    """A crash episode ends when its deployment has stayed ready for NOTIFY_STABLE_S (5 min by default)."""
    with transaction.atomic():
        d = alert.deployment
        if d is None:
            Alert.objects.filter(pk=alert.pk).update(resolved=timezone.now(), resolve_note="The deployment was deleted.")
            return
        d.refresh_from_db(fields=["status", "ready_at"])
        stable = timedelta(seconds=setting("NOTIFY_STABLE_S", 300))
        if d.status == Deployment.Status.READY and d.ready_at and d.ready_at <= timezone.now() - stable:
            restarts = alert.data.get("restarts", 0)
            alert_resolve("down", f"{d.name} is ready again and stayed up for {stable.total_seconds() / 60:.0f} min"
                          + (f" after {restarts} automatic restart(s)." if restarts else "."), deployment=d)


FRESH_S = 60  # engine figures older than this say nothing (the agent reads every ready engine every 2 s)


def slo_breaches(slo: Slo, engine: dict) -> list[str]:
    """What of `slo` the engine's figures break, in words (empty: met). A figure the window has not got (no
    request finished) breaks nothing."""
    broken = []
    ttft = engine.get("ttft_p95_s")
    if slo.ttft_p95_ms is not None and ttft is not None and ttft * 1000 > slo.ttft_p95_ms:
        broken.append(f"TTFT p95 {ttft * 1000:,.0f} ms (objective {slo.ttft_p95_ms:,} ms)")
    errors = engine.get("error_share")
    if slo.error_pct is not None and errors is not None and errors * 100 > slo.error_pct:
        broken.append(f"{errors * 100:.1f} % of requests aborted or failed (objective {slo.error_pct:g} %)")
    refused, finished = engine.get("refused") or 0, engine.get("window_requests") or 0
    if slo.refused_pct is not None and refused + finished and refused / (refused + finished) * 100 > slo.refused_pct:
        broken.append(f"{refused / (refused + finished) * 100:.1f} % of requests refused for load: {refused:,} by the "
                      f"engine's admission caps (objective {slo.refused_pct:g} %)")
    return broken


def _slo_met(slo: Slo, note: str) -> None:
    """No breach now: its clock stops and a breach told before is resolved with `note`."""
    if slo.breach_since is not None:
        Slo.objects.filter(pk=slo.pk).update(breach_since=None)
    alert_resolve("slo", note, deployment=slo.deployment)


def slo_check(slo: Slo, engine: dict | None) -> None:
    """A breach that has lasted `minutes` fires slo_breached once; met again (or the deployment no longer
    serving), it resolves. Figures that are missing or stale change nothing."""
    d = slo.deployment
    if d.status != Deployment.Status.READY:
        _slo_met(slo, f"{d.name} is no longer serving ({d.status}).")
        return
    if not engine or engine.get("at", 0) < time.time() - FRESH_S:
        return
    broken = slo_breaches(slo, engine)
    window = f"over the last {engine.get('window_s', 0) / 60:.1f} min, {engine.get('window_requests', 0)} requests"
    if not broken:
        _slo_met(slo, f"{d.name} meets its objectives again ({window}).")
        return
    now = timezone.now()
    since = slo.breach_since or now
    if slo.breach_since is None:
        Slo.objects.filter(pk=slo.pk).update(breach_since=now)
    if now - since >= timedelta(minutes=slo.minutes):
        alert_raise("slo_breached", deployment=d, title=f"{d.name} breaks its SLO: " + "; ".join(broken),
                    body=f"For {max((now - since).total_seconds() / 60, 0):.0f} min ({window}).", fold=False,
                    data={"ttft_p95_s": engine.get("ttft_p95_s"), "error_share": engine.get("error_share"),
                          "refused": engine.get("refused"),
                          "window_requests": engine.get("window_requests")})
