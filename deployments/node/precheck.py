"""What the node checks before a deploy plan stops anything: the engine runs here and takes the flags, its Python has
the package a flag needs (--load-format fastsafetensors: enginemodules), the port is free (or held by an engine the
plan itself stops), and no process the panel did not start holds the chosen GPUs (unless the deploy asked to stop
them). A refusal here fails the deploy with the reason and leaves every serving deployment serving: a mistyped port
never costs the model that was up. The launch checks the port again (a process may take it meanwhile), and the
foreign holders are looked at again right before they would be stopped."""
from django.conf import settings

from deployments import claims
from deployments.host import enginemodules, listeners, ownership, processes, serveargv, supervisors
from deployments.models import Deployment
from deployments.node import sleep
from deployments.node.guards import foreign_holders
from deployments.node.steps import PlanFailed

__all__ = ["blocking_foreign", "checks", "engine_flags", "foreign_refusal", "to_stop"]


def to_stop(d: Deployment) -> list[Deployment]:
    """The deployments the plan stops for `d`: the active ones on its GPUs (those sharing them asleep excepted) and
    those it was asked to replace."""
    others = Deployment.objects.filter(node=d.node, status__in=Deployment.ACTIVE).exclude(pk=d.pk)
    sharing = {o.pk for o in sleep.sharing(d)}  # asleep now (make_way): they share the GPUs
    return [o for o in claims.deployment_holders(d.node, d.gpu_indices, exclude=d) if o.pk not in sharing] + list(
        others.filter(pk__in=d.replace))


def engine_flags() -> set[str]:
    """The flags the node's engine takes, or PlanFailed naming how to get an engine."""
    try:
        return serveargv.engine_flags(settings.VLLM_BIN)
    except processes.EngineError as exc:
        raise PlanFailed(f"Cannot run the engine: {exc}. To fix it, {serveargv.ENGINE_FIX}.") from exc


def checks(d: Deployment) -> str:
    """Every check of the launch that can fail before anything is stopped; PlanFailed with the first reason."""
    if errors := serveargv.validate_args(d.engine_args, engine_flags()):
        raise PlanFailed("; ".join(errors.values()))
    if lacking := enginemodules.missing(d.engine_args, settings.VLLM_BIN):
        raise PlanFailed("; ".join(lacking) + ". Nothing was stopped.")
    port = _port(d)
    blocking = blocking_foreign(d)
    if blocking and not d.stop_foreign:
        raise PlanFailed(foreign_refusal(blocking))
    return (f"The engine takes the flags; {port}"
            + (f"; {len(blocking)} other process(es) on the GPUs will be stopped, as asked" if blocking else "") + ".")


def _port(d: Deployment) -> str:
    if processes.port_free("0.0.0.0", d.port):
        return f"port {d.port} is free"
    own = [o for o in [d, *to_stop(d)] if o.port == d.port and (o.pid or o.systemd_unit or o.marker)]
    if own:  # the previous engine, or one being replaced, listens there: free once it is stopped
        return f"port {d.port} is {own[0].name}'s, free once it is stopped"
    pids, _ = listeners.listening(d.port)
    who = ownership.describe(min(pids)) if pids else None
    by = f" by PID {who['pid']} ({who['user']}: {ownership.short_command(who['command'])})" if who else ""
    raise PlanFailed(f"Port {d.port} is in use on {d.node}{by}: choose another port or stop what listens there. "
                     "Nothing was stopped.")


def blocking_foreign(d: Deployment) -> list[dict]:
    """Processes on the chosen GPUs (the whole host without GPUs) that the panel did not start, display servers left
    out (never stopped)."""
    return [p for p in foreign_holders(d.node_id, d.gpu_indices, spare=[d.pk, *d.replace]) if not p["display"]]


def foreign_refusal(blocking: list[dict]) -> str:
    return "Other processes hold the chosen GPUs: " + "; ".join(map(supervisors.holder_text, blocking)) + (
        ". Stop them, or deploy with \"stop other processes on these GPUs\".")
