"""Persist: a ready deployment made a service that survives crashes and reboots, with no second load. Its running
engine keeps serving; what brings it back from its next start is a systemd unit written with the same command,
environment and marker (engines as processes), or, with engines as containers (compose), Docker's restart policy on
the engine's own container (host/keepers.py). A multi-node deployment restarts every rank under a unit."""
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from deployments import payloads, warmstart
from deployments.gateway import media
from deployments.host import containers, keepers, serveargv, systemd
from deployments.models import Deployment, DeploymentEvent, ModelCopy
from deployments.node import lifecycle, plan
from deployments.node.steps import PlanFailed, unit_install
from deployments.timeline import deployment_event

S = Deployment.Status


def deployment_persist_here(deployment_id: int) -> Deployment:
    """Make the ready deployment a service: a systemd unit, or its engine container kept (engines as containers)."""
    with lifecycle.driving(deployment_id):
        return _persist(deployment_id)


def _persist(deployment_id: int) -> Deployment:
    """The running engine keeps serving: its unit is written with the same command, environment and marker, and
    enabled, not started; systemd runs the engine from its next start (a boot, or a crash: units.engine_exited starts
    the unit), and whichever it starts is the deployment's by its marker. No second load."""
    d = Deployment.objects.select_related("model", "node").get(pk=deployment_id)
    if containers.enabled():
        return _persist_container(d)
    if d.master_port:
        return _persist_group(d)
    copy = ModelCopy.objects.get(model=d.model, node=d.node)
    name = systemd.unit_name(d.name)
    warm_args, warm_env = warmstart.relaunch_extras(d)  # the same cache folder and KV size as the engine it replaces
    argv = serveargv.build_argv(settings.VLLM_BIN, copy.path, d.port, serveargv.API_HOST, {**d.engine_args, **warm_args},
                                media.engine_args(d, serveargv.engine_flags(settings.VLLM_BIN)))
    try:
        env = lifecycle.marked_env({**plan._engine_env(d), **warm_env}, d.marker)
        unit_install(d, argv, env, d.log_path or str(plan._log_path(d)), cwd=Path(copy.path), start=False)
        lifecycle.save(d, systemd_unit=name)
        payloads.send_deployment_status(d)
        deployment_event(d, "persist", f"Installed {name}, enabled at boot. The running engine (PID {d.pid}) keeps "
                                       "serving: systemd runs it from its next start (a reboot, or the agent starting "
                                       "the unit after a crash), adopted by its marker.")
    except (systemd.SystemdError, PlanFailed, OSError) as exc:
        deployment_event(d, "persist", f"Could not make it a service: {exc}", level=DeploymentEvent.Level.ERROR)
    return d


def _persist_container(d: Deployment) -> Deployment:
    """Engines as containers (compose): the running engine's container gets Docker's restart policy, so Docker starts
    it again after a crash and at a boot; the engine keeps serving, no second load."""
    if d.master_port:
        deployment_event(d, "persist", "Not made a service: with engines as containers (PANEL_ENGINE_RUNTIME=docker) "
                         "only a single-node deployment can be kept; a multi-node one needs the hosts' systemd.",
                         level=DeploymentEvent.Level.ERROR)
        return d
    try:
        name = keepers.of_container(containers.keep(d.marker))
    except containers.ContainerError as exc:
        deployment_event(d, "persist", f"Could not make it a service: {exc}", level=DeploymentEvent.Level.ERROR)
        return d
    lifecycle.save(d, systemd_unit=name)
    payloads.send_deployment_status(d)
    deployment_event(d, "persist", f"Kept {name[len(keepers.PREFIX):]} with Docker's restart policy "
                     f"{containers.KEEP_POLICY}. The running engine (PID {d.pid}) keeps serving: Docker starts it "
                     "again after a crash or a reboot, and the agent adopts it by its marker.")
    return d


def _persist_group(d: Deployment) -> Deployment:
    """Multi-node: the whole group starts again under systemd, one unit per node. The plan runs
    as a redeploy does: each worker node's agent installs its rank's unit (workers first, as vLLM's launch
    needs), then this node the head's."""
    with transaction.atomic():
        row = Deployment.objects.select_for_update().get(pk=d.pk)
        if row.status != S.READY:
            return row  # stopped or failed meanwhile
        row.systemd_unit = systemd.unit_name(d.name)
        row.transition(S.QUEUED, "restarting every rank under systemd",
                       expires_at=timezone.now() + timedelta(seconds=settings.HOST_TASK_EXPIRES_S))
        row.save()
    units = [f"{row.systemd_unit} on {d.node}", *(f"{systemd.unit_name(d.name, r.rank)} on {r.node}"
                                                 for r in d.ranks.select_related("node"))]
    deployment_event(d, "persist", "Restarting every rank under systemd, one unit per node: " + ", ".join(units) + ".")
    return plan.deployment_run(d.pk)
