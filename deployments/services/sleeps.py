"""Sleep, wake and swap, as the control plane decides them: checked here, done by the node's agent
(deployments/node/sleep.py). Deployments started with sleep mode may share GPUs, one awake at a time; what a deploy
checks of sleep mode is sleepgate.py."""
from django.db import transaction

from deployments import claims, history, payloads
from deployments.dispatch import node_enqueue
from deployments.models import Deployment, SleepProbe
from deployments.node.sleepprobe import choose_level
from deployments.services import deploys
from deployments.timeline import deployment_event
from plumbing.errors import ServiceError

S = Deployment.Status


def shares(a: Deployment, b: Deployment) -> bool:
    """On one node and on a GPU of both (on a node without GPUs the whole host is one claim)."""
    return a.node_id == b.node_id and bool(set(a.gpu_indices) & set(b.gpu_indices) or not a.node.gpus.exists())


def swap_targets(d: Deployment) -> list[Deployment]:
    """What a serving sleep-mode deployment can be swapped to: sleep-mode deployments sharing its GPUs, asleep or
    stopped (a stopped one is deployed again)."""
    if not d.sleep_mode or d.status != S.READY:
        return []
    found = Deployment.objects.filter(node=d.node, sleep_mode=True, master_port=None,
                                      status__in=[S.SLEEPING, *Deployment.TERMINAL]).exclude(pk=d.pk)
    return [o for o in found.select_related("node") if shares(d, o)]


def sleep_fit(d: Deployment) -> str:
    """Which level a sleep would take now, in words, before the user picks one: the host's free RAM (its agent's
    last sample) against the weights, and what the sleep probe proved; "" when the host's RAM is not known."""
    available = (history.latest_many([d.node_id]).get(d.node_id) or {}).get("ram_available")
    if available is None:
        return ""
    level, why = choose_level(d.model.total_size or 0, available)
    probe = SleepProbe.latest_for(d)
    if probe is None:
        return f"A sleep now would take {why}; the first sleep is probed first."
    proven = probe.passed_levels()
    if level in proven:
        return f"A sleep now would take {why} (proven by the sleep probe)."
    if 2 in proven:
        return f"Level 1 was not proven by the sleep probe: a sleep now would take level 2 ({why})."
    return f"No level is proven by the sleep probe: a sleep is refused ({why})."


def refuse_unproven(d: Deployment) -> None:
    """A sleep-mode deployment whose combination's last sleep probe failed sleeps nowhere: refused with its figures.
    Never probed: the node probes it before its first sleep (deployments/node/sleepprobe.py)."""
    probe = SleepProbe.latest_for(d)
    if probe and probe.verdict == SleepProbe.Verdict.FAILED:
        raise ServiceError(f"Sleep refused for {d.name}: the sleep probe of {probe.created:%Y-%m-%d %H:%M} failed for "
                           f"this model, engine, memory flags and GPUs. {probe.reason} Probe it again after a change "
                           "(Probe sleep), or stop it instead.", code="sleep_probe_failed")


@transaction.atomic
def deployment_sleep_probe(d: Deployment) -> Deployment:
    """Probe a ready sleep-mode deployment's sleep now (each level slept and woken, memory and answer compared)."""
    d = _ready_in_sleep_mode(d, "there is no sleep to probe", "be probed")
    deployment_event(d, "sleep_probe", "Sleep probe requested: each level slept and woken, GPU memory and a fixed "
                     "answer compared.")
    node_enqueue(d.node, "deployments.deployment_sleep_probe", d.pk)
    return d


def _locked(d: Deployment) -> Deployment:
    claims.lock_node(d.node_id)
    return Deployment.objects.select_for_update().select_related("node", "model").get(pk=d.pk)


def _ready_in_sleep_mode(d: Deployment, without: str, able: str) -> Deployment:
    """`d` locked, or refused: not started with sleep mode (`without`: what that means here), or not ready (only a
    ready deployment can `able`)."""
    d = _locked(d)
    if not d.sleep_mode:
        raise ServiceError(f"{d.name} was not started with sleep mode: {without}.", code="no_sleep_mode")
    if d.status != S.READY:
        raise ServiceError(f"{d.name} is {d.get_status_display().lower()}; only a ready deployment can {able}.",
                           code="not_running")
    return d


@transaction.atomic
def deployment_sleep(d: Deployment, level: int | None = None) -> Deployment:
    d = _ready_in_sleep_mode(d, "redeploy it with sleep mode to put it to sleep", "sleep")
    if level not in (None, 1, 2):
        raise ServiceError("The sleep level is 1 (weights to host RAM) or 2 (weights dropped).", field="level")
    refuse_unproven(d)
    deployment_event(d, "sleep", "Sleep requested" + (f" at level {level}." if level else " (level chosen by free RAM)."))
    node_enqueue(d.node, "deployments.deployment_sleep", d.pk, level)
    return d


@transaction.atomic
def deployment_wake(d: Deployment) -> Deployment:
    d = _locked(d)
    if d.status != S.SLEEPING:
        raise ServiceError(f"{d.name} is {d.get_status_display().lower()}, not asleep.", code="not_sleeping")
    awake = claims.awake_holders(d.node, d.gpu_indices, exclude=d)
    if awake:
        raise ServiceError(f"{awake[0].name} ({awake[0].get_status_display().lower()}) holds {d.name}'s GPUs: "
                           f"swap to {d.name} instead, or stop it first.", code="gpus_busy")
    deployment_event(d, "wake", "Wake requested.")
    node_enqueue(d.node, "deployments.deployment_wake", d.pk)
    return d


@transaction.atomic
def deployment_swap(source: Deployment, target: Deployment) -> Deployment:
    """`source` (serving) sleeps and `target` (asleep on the same GPUs) wakes; a stopped or failed sleep-mode
    target is deployed again instead, its plan putting `source` to sleep first. Returns the target."""
    source, target = _locked(source), _locked(target)
    if source.pk == target.pk:
        raise ServiceError("Swap from a deployment to another one.", field="to")
    if not shares(source, target):
        raise ServiceError(f"{source.name} and {target.name} do not share GPUs on one node: nothing to swap.",
                           field="to", code="not_shared")
    if not (source.sleep_mode and target.sleep_mode):
        plain = source if not source.sleep_mode else target
        raise ServiceError(f"{plain.name} was not started with sleep mode: a swap needs both in sleep mode.",
                           code="no_sleep_mode")
    if source.status != S.READY:
        raise ServiceError(f"{source.name} is {source.get_status_display().lower()}, not serving.", code="not_running")
    refuse_unproven(source)
    if target.status in Deployment.TERMINAL:
        target = deploys.deployment_redeploy(target)
        Deployment.objects.filter(pk=target.pk).update(load_detail={"swap_from": source.pk})
        deployment_event(target, "swap", f"Swap from {source.name}: deploying it again; its plan puts {source.name} to sleep.")
        return target
    if target.status != S.SLEEPING:
        raise ServiceError(f"{target.name} is {target.get_status_display().lower()}: wait until it is loaded.",
                           code="busy")
    awake = [o for o in claims.awake_holders(target.node, target.gpu_indices, exclude=target) if o.pk != source.pk]
    if awake:
        raise ServiceError(f"{awake[0].name} ({awake[0].get_status_display().lower()}) also holds these GPUs.",
                           code="gpus_busy")
    deployment_event(target, "swap", f"Swap from {source.name} requested.")
    node_enqueue(target.node, "deployments.deployment_swap", source.pk, target.pk)
    payloads.send_deployment_status(target)
    return target
