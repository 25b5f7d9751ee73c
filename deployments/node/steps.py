"""Node-side building blocks of deployment work: status moves a stop request can interrupt,
timeline steps, stopping an engine that is provably ours, and failing a deployment.

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

from controlpanel.states import InvalidTransition
from deployments import live, secrets
from deployments.host import engine, enginelog, engineuser, ownership, systemd
from deployments.models import Deployment, DeploymentEvent, ModelCopy, Node
from deployments.services.deploys import deployment_event, deployment_ranks_stop
from deployments.services.repos import model_copy_download

log = logging.getLogger(__name__)
S = Deployment.Status
STOP_TERM_S, STOP_KILL_S = 30.0, 10.0
# Ray's `ray start --block` spends 20-40 s trying to drain its node through a GCS that is going away on
# SIGTERM (measured, Ray 2.60): its processes get a short grace, then SIGKILL (what `ray stop --force` does).
RAY_TERM_S = 3.0
TAIL_LINES = 400
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
    live.send_deployment_status(d)


@contextmanager
def step(d: Deployment, name: str):
    """A timeline step: start and end times, and its message (set `event.message` inside)."""
    if Deployment.objects.filter(pk=d.pk, status=S.STOPPING).exists():
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
    live.send_timeline_step(event)


def fail(d: Deployment, message: str, attempts: int = 30) -> None:
    """Mark failed with the reason and the last log lines; never leave an engine of ours running.

    Retried while the database is away (a dropped connection, a restart): the row must not stay
    mid-plan once it is back."""
    try:
        _stop_proven(d)
    except engine.EngineError:
        pass
    if d.log_path:
        d.log_tail = "\n".join(enginelog.tail(Path(d.log_path), TAIL_LINES))
    d.pid = d.pgid = d.pid_create_time = None
    d.marker, d.shm_files = "", []
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
            deployment_ranks_stop(d)  # issue 17: any rank failing ends every other rank
            return
        except DatabaseError:
            log.warning("deployment %s: cannot record the failure yet (database away), retrying", d.name)
            connection.close()
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
    raise PlanFailed(f"{d.name}: could not record the failure: the database stayed away")


def engine_running(d: Deployment) -> bool:
    """The deployment's engine leader runs and is provably ours (marker or systemd unit)."""
    return bool(d.pid) and engine.alive(d.pid, d.pid_create_time or 0.0) and ownership.pid_owned(
        d.pid, d.marker, d.systemd_unit or None)


def _stop_proven(d: Deployment) -> engine.StopResult | None:
    """Stop the deployment's process group only when it is provably its engine, then clean the
    /dev/shm files it was seen holding. A group that cannot be proven ours is reported on the
    timeline and never signalled (after a reboot or PID reuse it is someone else's)."""
    result = None
    if not d.pgid and d.marker:  # launched, but the agent died before it wrote the PID down
        marked = ownership.find(d.marker)
        d.pgid = pgid_of(marked[0]) if marked else None
    if d.pgid and ownership.owned(d.pgid, d.marker, d.systemd_unit or None):
        result = engine.stop(d.pgid, STOP_TERM_S, STOP_KILL_S)
    elif d.pgid and engine.members(d.pgid):
        deployment_event(d, "not_signalled", f"Process group {d.pgid} runs but does not carry this deployment's "
                         "marker: it is not provably ours, so it was left alone.", level=DeploymentEvent.Level.WARNING)
    if d.marker and (left := stop_marked(d.marker)) and result:  # e.g. a Ray head's processes (issue 17)
        result.survivors += left
    if not (result and result.survivors):
        engine.remove_unused_shm(set(d.shm_files or []))
        d.shm_files = []
    return result


def stop_marked(marker: str) -> list[int]:
    """Stop every process group a process carrying `marker` is in (the panel set it: they are ours): what is
    left once an engine's own group stopped, such as a Ray node's processes (Ray starts its workers in groups
    of their own). Short grace (RAY_TERM_S); returns the PIDs that survived."""
    survivors: list[int] = []
    for _ in range(3):  # a member may fork while its group is being stopped
        groups = {g for g in map(pgid_of, ownership.find(marker)) if g and g not in (os.getpgrp(), os.getsid(0))}
        if not groups:
            return []
        survivors = [pid for g in groups for pid in engine.stop(g, RAY_TERM_S, STOP_KILL_S).survivors]
    return survivors


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def adopt_marked(d: Deployment) -> bool:
    """An engine carrying the row's marker whose PID was never recorded: take it as the row's."""
    marked = ownership.find(d.marker)
    leaders = [pid for pid in marked if pgid_of(pid) == pid] or marked
    if not leaders:
        return False
    d.pid, d.pgid = leaders[0], pgid_of(leaders[0])
    d.pid_create_time = None
    Deployment.objects.filter(pk=d.pk).update(pid=d.pid, pgid=d.pgid, pid_create_time=None)
    return engine_running(d)


def record_shm(d: Deployment) -> None:
    """Remember the engine's /dev/shm files while it runs: after a crash nothing names them."""
    if d.pgid and d.marker:
        seen = sorted(set(d.shm_files or []) | engine.shm_files(d.pgid))
        if seen != (d.shm_files or []):
            d.shm_files = seen
            Deployment.objects.filter(pk=d.pk).update(shm_files=seen)


def halt_engine(d: Deployment) -> str:
    """Stop one deployment's engine: its systemd unit or its whole process group; say how."""
    if d.systemd_unit:
        systemd.disable(d.systemd_unit)  # a stopped deployment must not come back at the next boot
    if not d.pgid:
        _stop_proven(d)  # its /dev/shm files, if a crash left them
        return "not running"
    result = _stop_proven(d)
    if result is None:
        d.pid = d.pgid = d.pid_create_time = None
        return "not running (its process group was not provably ours; left alone)"
    if result.survivors:
        raise PlanFailed(f"PIDs {result.survivors} of {d.name} survived SIGKILL (stuck in the driver?)")
    if d.log_path:
        d.log_tail = "\n".join(enginelog.tail(Path(d.log_path), TAIL_LINES))
    d.pid = d.pgid = d.pid_create_time = None
    shm = f", {len(result.shm_removed)} /dev/shm files removed" if result.shm_removed else ""
    return f"{' then '.join(result.signals_sent) or 'already gone'} in {result.seconds:.1f} s{shm}"


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
    deployment_ranks_stop(row)
    live.send_deployment_status(row)


def model_ready(d: Deployment, node: Node) -> str:
    """The model's folder on `node` (the head's, or a worker rank's, issue 17); downloaded first, in this
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
            copy = model_copy_download(copy.pk)
        if copy.state != ModelCopy.State.READY:
            raise PlanFailed(f"The model could not be downloaded to {node}: {copy.error or copy.state}")
    ModelCopy.objects.filter(pk=copy.pk).update(last_used=timezone.now())
    return copy.path


def engine_user(model_path: str, store: str) -> engineuser.EngineUser:
    """Who the engine runs as (engineuser.current()), once it may read the model: a folder in the node's
    model store is opened to it (engineuser.share); a folder of the user's own must be readable already."""
    try:
        user = engineuser.current()
        if model_path and store:
            engineuser.share(user, model_path, store)
    except (engineuser.EngineUserError, OSError) as exc:
        raise PlanFailed(f"Cannot prepare the engine's user: {exc}") from exc
    return user


def unit_install(d: Deployment, argv: list[str], env: dict[str, str], log_path: str, rank: int = 0) -> int:
    """Install and start one engine of `d` as a systemd unit (the head's, or worker rank `rank`'s); its PID."""
    text, secret_env = unit_text(d, argv, env, log_path, rank)
    return systemd.install(systemd.unit_name(d.name, rank), text, secret_env=secret_env)


def unit_text(d: Deployment, argv: list[str], env: dict[str, str], log_path: str, rank: int = 0) -> tuple[str, dict]:
    """The unit's text and its secret variables (a 0600 EnvironmentFile, not the unit text)."""
    env, secret_env = secrets.split(env, secrets.marked(d))
    argv, flag_env = systemd.secret_argv(argv)  # --api-key: the EnvironmentFile's VLLM_API_KEY, never ExecStart=
    secret_env = {**secret_env, **flag_env}
    text = systemd.render_unit(description=f"vLLM {d.name} ({d.model})" + (f", rank {rank}" if rank else ""), env=env,
                               log_path=log_path, argv=argv, run_as=engineuser.current(), secret_env_file=str(
                                   systemd.env_file_path(systemd.unit_name(d.name, rank))) if secret_env else None)
    return text, secret_env
