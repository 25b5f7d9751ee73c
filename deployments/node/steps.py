"""Node-side building blocks of deployment work: status moves a stop request can interrupt, timeline
steps, failing a deployment (its engine stopped through lifecycle.halt), the model's folder, the unit.

Used by plan.py (deploy, follow, persist), ranks.py (a worker node's rank), watch.py (stop, crashes)
and reconcile.py (agent start).
"""
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from deployments import payloads, secrets
from deployments.dispatch import ranks_stop
from deployments.gateway import changes
from deployments.host import keepers, osuser, processes, processlog, systemd
from deployments.models import Deployment, DeploymentEvent, ModelCopy, Node
from deployments.node import lifecycle
from deployments.node.lifecycle import TAIL_LINES
from deployments.modelcopies import model_copy_download
from deployments.timeline import MADE_ROOM_FOR, deployment_event
from plumbing.states import InvalidTransition

log = logging.getLogger(__name__)
S = Deployment.Status
# A deploy waiting on a download gives up when the download's row has not moved for this long
# (its worker died, or Redis/the database went away and did not come back).
DOWNLOAD_STALL_S = float(os.environ.get("DEPLOY_DOWNLOAD_STALL", "300"))


class PlanFailed(Exception):
    """A deploy step failed; the message says why, for the timeline and the status."""


class Aborted(Exception):
    """Someone asked to stop the deployment while its plan ran."""


def move(d: Deployment, status: str, message: str = "") -> None:
    """Move to `status` unless the row moved meanwhile (a stop request): then abort the plan."""
    with transaction.atomic():
        row = Deployment.objects.select_for_update().get(pk=d.pk)
        before = row.status
        try:
            row.transition(status, secrets.redact_deployment(d, message))  # it may quote log lines
        except InvalidTransition as exc:
            raise Aborted(str(exc)) from exc
        for field in ("pid", "pgid", "pid_create_time", "log_path", "load_phase", "load_percent", "load_detail",
                      "smoke", "log_tail", "systemd_unit", "marker", "shm_files"):
            setattr(row, field, getattr(d, field))
        row.save()
    d.status, d.status_message, d.started, d.ready_at, d.stopped_at = (
        row.status, row.status_message, row.started, row.ready_at, row.stopped_at)
    payloads.send_deployment_status(d)
    if S.READY in (before, row.status):  # the node gateways route to ready engines only: now, not at their next poll
        changes.changed("deployments")


def stop_requested(d: Deployment) -> bool:
    """Someone pressed Stop since the plan began: the row reads stopping."""
    return Deployment.objects.filter(pk=d.pk, status=S.STOPPING).exists()


@contextmanager
def step(d: Deployment, name: str):
    """A timeline step: start and end times, and its message (set `event.message` inside)."""
    if stop_requested(d):
        raise Aborted("stop requested")
    event = deployment_event(d, name, "…", ongoing=True)
    try:
        yield event
    except Exception as exc:
        event.level = DeploymentEvent.Level.ERROR
        event.message = str(exc) or exc.__class__.__name__
        raise
    finally:
        _end_event(event)


@contextmanager
def step_unchecked(d: Deployment, name: str):
    """A timeline step that runs even while the deployment is stopping."""
    event = deployment_event(d, name, "…", ongoing=True)
    try:
        yield event
    finally:
        _end_event(event)


def _end_event(event: DeploymentEvent) -> None:
    event.message = secrets.redact_deployment(event.deployment, event.message)  # an error may quote the engine's log
    event.ended = timezone.now()
    event.save()
    payloads.send_timeline_step(event)


def fail(d: Deployment, message: str, attempts: int = 30) -> None:
    """Mark failed with the reason and the last log lines; never leave an engine of ours running.

    Retried while the database is away (a dropped connection, a restart): the row must not stay
    mid-plan once it is back."""
    if connection.connection is not None and not connection.in_atomic_block:
        connection.close_if_unusable_or_obsolete()  # the error that brought us here may have broken it: halting reads rows
    try:
        halt_engine(d)  # a persisted one's unit disabled too: systemd must not start it again
    except (processes.EngineError, *keepers.Error, PlanFailed) as exc:  # a unit's or a kept container's keeper too
        log.warning("deployment %s: stopping the engine on failure: %s", d.name, exc)
    if d.log_path:
        d.log_tail = "\n".join(processlog.tail(Path(d.log_path), TAIL_LINES))
    d.forget_process()
    for attempt in range(attempts):
        try:
            if connection.connection is not None and not connection.in_atomic_block:
                connection.close_if_unusable_or_obsolete()
            try:
                move(d, S.FAILED, message)
            except Aborted:
                if Deployment.objects.filter(pk=d.pk, status=S.FAILED).exists():
                    return  # failed already by another path (a rank lost while the watch saw the head die)
                mark_stopped(d, message)
            deployment_event(d, "failed", message, level=DeploymentEvent.Level.ERROR)
            ranks_stop(d)  # multi-node: any rank failing ends every other rank
            return
        except DatabaseError:
            log.warning("deployment %s: cannot record the failure yet (database away), retrying", d.name)
            connection.close()
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
    raise PlanFailed(f"{d.name}: could not record the failure: the database stayed away")


def halt_engine(d: Deployment) -> str:
    """Stop one deployment's engine (its systemd unit disabled, its whole process group); say how."""
    halted = lifecycle.halt(d)
    if halted.unproven:
        deployment_event(d, "not_signalled", f"Process group {halted.unproven} runs but does not carry this deployment's "
                         "marker: it is not provably ours, so it was left alone.", level=DeploymentEvent.Level.WARNING)
    if halted.result and halted.result.survivors:
        raise PlanFailed(f"PIDs {halted.result.survivors} of {d.name} survived SIGKILL (stuck in the driver?)")
    return halted.describe()


def mark_stopped(d: Deployment, message: str) -> None:
    with transaction.atomic():
        row = Deployment.objects.select_for_update().get(pk=d.pk)
        row.pid = row.pgid = row.pid_create_time = None
        row.marker, row.shm_files = "", d.shm_files or []
        row.log_tail = d.log_tail or row.log_tail
        if row.status != S.STOPPED:
            row.status, row.status_message, row.stopped_at = S.STOPPED, secrets.redact_deployment(d, message), timezone.now()
        row.save()
    d.status, d.pid, d.pgid = S.STOPPED, None, None
    ranks_stop(row)
    payloads.send_deployment_status(row)


def make_room(d: Deployment, others, node: Node, elsewhere: str) -> list[str]:
    """Stop each of `others` (deployments holding what `d` needs on `node`) for `d`: moved to stopping, its engine
    halted, marked stopped; one whose head runs on another node is refused with `elsewhere` (formatted with
    `other` and `node`): only its own Stop ends all its ranks. What was stopped, one line each."""
    done = []
    for other in {o.pk: o for o in others}.values():
        if other.node_id != node.pk:
            raise PlanFailed(elsewhere.format(other=other, node=node))
        if other.status != S.STOPPING:
            try:
                move(other, S.STOPPING, f"{MADE_ROOM_FOR}{d.name}")
            except Aborted:  # it ended meanwhile
                continue
        result = halt_engine(other)
        mark_stopped(other, f"{MADE_ROOM_FOR}{d.name}")
        done.append(f"{other.name} ({result})")
    return done


def model_ready(d: Deployment, node: Node) -> str:
    """The model's folder on `node` (the head's, or a multi-node worker rank's); downloaded first, in this
    worker and with the copy's live progress, when it is not there. A stop request aborts the wait."""
    copy, _ = ModelCopy.objects.get_or_create(model=d.model, node=node)
    if copy.state != ModelCopy.State.READY:
        if copy.state == ModelCopy.State.DOWNLOADING:
            while copy.state == ModelCopy.State.DOWNLOADING:
                if (timezone.now() - copy.updated).total_seconds() > DOWNLOAD_STALL_S:
                    raise PlanFailed(f"The download of {d.model} to {node} made no progress for {DOWNLOAD_STALL_S:.0f} s.")
                if not Deployment.objects.filter(pk=d.pk, status__in=Deployment.ACTIVE - {S.STOPPING}).exists():
                    raise Aborted("stop requested")
                time.sleep(2)
                copy.refresh_from_db()
        else:
            with transaction.atomic():
                copy = ModelCopy.objects.select_for_update().get(pk=copy.pk)
                try:
                    copy.transition(ModelCopy.State.QUEUED, bytes_total=d.model.total_size, cancel_requested=False)
                except InvalidTransition as exc:  # being deleted
                    raise PlanFailed(f"The model's copy on {node} is {copy.get_state_display().lower()}.") from exc
                copy.save()
            copy = model_copy_download(copy.pk, deployment_id=d.pk)  # a stop cancels only a download its plan started
        if copy.state == ModelCopy.State.CANCELLED and stop_requested(d):
            raise Aborted("stop requested")  # the stop cancelled it (repos.model_download_cancel_for)
        if copy.state != ModelCopy.State.READY:
            raise PlanFailed(f"The model could not be downloaded to {node}: {copy.error or copy.state}")
    ModelCopy.objects.filter(pk=copy.pk).update(last_used=timezone.now())
    return copy.path


def engine_user(model_path: str, store: str) -> osuser.EngineUser:
    """Who the engine runs as (osuser.current()), once it may read the model: a folder in the node's
    model store is opened to it (osuser.share); a folder of the user's own must be readable already."""
    try:
        user = osuser.current()
        if model_path and store:
            osuser.share(user, model_path, store)
    except (osuser.EngineUserError, OSError) as exc:
        raise PlanFailed(f"Cannot prepare the engine's user: {exc}") from exc
    return user


def unit_install(d: Deployment, argv: list[str], env: dict[str, str], log_path: str, rank: int = 0,
                 cwd: Path | None = None, start: bool = True) -> int:
    """Install and (with `start`) start one engine of `d` as a systemd unit (the head's, or worker rank `rank`'s); its
    PID (0 when not started)."""
    text, secret_env = unit_text(d, argv, env, log_path, rank, cwd)
    return systemd.install(systemd.unit_name(d.name, rank), text, secret_env=secret_env, start=start)


def unit_text(d: Deployment, argv: list[str], env: dict[str, str], log_path: str, rank: int = 0,
              cwd: Path | None = None) -> tuple[str, dict]:
    """The unit's text and its secret variables (a 0600 EnvironmentFile, not the unit text); it starts in `cwd`
    (the model's folder, as an engine started by the agent does: a relative file flag reads from there)."""
    env, secret_env = secrets.split(env, secrets.marked(d))
    argv, flag_env = systemd.secret_argv(argv)  # --api-key: the EnvironmentFile's VLLM_API_KEY, never ExecStart=
    secret_env = {**secret_env, **flag_env}
    text = systemd.render_unit(description=f"vLLM {d.name} ({d.model})" + (f", rank {rank}" if rank else ""), env=env,
                               log_path=log_path, argv=argv, run_as=osuser.current(), working_dir=str(cwd or "/"),
                               secret_env_file=str(
                                   systemd.env_file_path(systemd.unit_name(d.name, rank))) if secret_env else None)
    return text, secret_env
