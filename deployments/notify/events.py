"""What a status move means to a person: a deployment ready, failed, stalled, crashed or auto-restarted; a
download finished or failed; a benchmark or study finished. hooks.py calls these with the row, its status
before and after, inside the transaction that saved it."""
from django.apps import apps
from django.utils import timezone

from deployments.notify import alerts
from deployments.notify.alerts import alert_raise, alert_resolve
from deployments.timeline import MADE_ROOM_FOR

LOOP_RESTARTS = 3  # auto-restarts within one firing "down" alert that make it a restart loop


def _in_study(d) -> bool:
    """A tuning study redeploys `d` trial after trial: its loads and failed variants are the study's, told once when
    it finishes (study_finished), not as a "ready" or "failed" each (a 6-trial study sent 7 "ready" webhooks)."""
    study = apps.get_model("benchmarks", "Study")
    return study.objects.filter(deployment_id=d.pk, status__in=study.DRIVEN).exists()


def deployment_moved(d, was: str, now: str, restarted: bool) -> None:
    """A deployment's status changed from `was` to `now`; `restarted`: its restart count went up (crashes.py)."""
    S = type(d).Status
    message = d.status_message or ""
    if now == S.READY:
        alert_resolve("failed", "Ready again.", deployment=d)
        down = alerts.open_alert("down", d)
        if down is not None:  # back up inside a crash episode: folded, resolved once it stays up (checks.py)
            down.data = {**down.data, "readies": down.data.get("readies", 0) + 1}
            down.save(update_fields=["data"])
            return
        if _in_study(d):
            return
        took = (d.ready_at - d.started).total_seconds() if d.ready_at and d.started else None
        alert_raise("ready", deployment=d, title=f"{d.name} is ready" + (f" after {took:.0f} s" if took is not None else ""),
                    body=f"{d.model} on {d.node.name}, GPUs {d.gpu_indices or 'none (CPU)'}, port {d.port}.",
                    data={"load_seconds": took})
    elif now == S.FAILED:
        if message.startswith("Crashed"):
            alert_raise("crashed", deployment=d, title=f"{d.name} crashed", body=message,
                        data={"auto_restart": d.auto_restart})
        elif message.startswith("Stalled"):
            alert_raise("stalled", deployment=d, title=f"{d.name}: the load stalled", body=message)
        elif not _in_study(d):  # a study's failed variant is in its study_finished message
            alert_raise("failed", deployment=d, title=f"{d.name} failed ({was})", body=message)
    elif now == S.QUEUED and was == S.FAILED and restarted:
        down = alerts.open_alert("down", d)
        restarts = (down.data.get("restarts", 0) if down else 0) + 1
        kind = "restart_loop" if restarts >= LOOP_RESTARTS else "auto_restarted"
        title = (f"{d.name} is restarting in a loop ({restarts} restarts)" if kind == "restart_loop"
                 else f"{d.name} auto-restarted (restart {d.restarts})")
        alert_raise(kind, deployment=d, title=title, body=message, data={"restarts": restarts})
    elif now == S.STOPPED or (now == S.QUEUED and not restarted):
        why = "Stopped." if now == S.STOPPED else "Redeployed."
        alert_resolve("down", why, deployment=d)
        if now == S.STOPPED:
            alert_resolve("failed", why, deployment=d)
        if now == S.STOPPED and was == S.STOPPING and message.startswith(MADE_ROOM_FOR):
            _displaced(d, message[len(MADE_ROOM_FOR):])


def _displaced(d, by_name: str) -> None:
    """A serving deployment a deploy plan stopped to take its GPUs (or its place): who, with what, where."""
    other = type(d).objects.filter(name=by_name).select_related("model", "created_by").first()
    if other is None:
        body = f"{by_name} took its place."
    else:
        who = f" by {other.created_by.get_username()}" if other.created_by else ""
        where = (f"on its GPUs{who}: GPUs {', '.join(map(str, other.gpu_indices))} on {other.node.name}"
                 if other.gpu_indices else f"in its place{who} on {other.node.name} (no GPUs: one engine at a time)")
        body = f"{other.name} ({other.model}) was deployed {where}, port {other.port}."
    free = "they are free" if d.gpu_indices else "the node is free"
    alert_raise("displaced", deployment=d, title=f"{d.name} was stopped to make room for {by_name}",
                body=f"{body} {d.name} served {d.model} on port {d.port}; deploy it again from its page once {free}.",
                data={"by": by_name, "by_id": other.pk if other else None})


def copy_moved(copy, was: str, now: str) -> None:
    """A model copy (a download) finished or failed."""
    State = type(copy).State
    size = f"{copy.bytes_total / 2**30:.1f} GiB" if copy.bytes_total else "size unknown"
    if now == State.READY and was == State.DOWNLOADING:
        took = (timezone.now() - copy.created).total_seconds()
        alert_raise("download_finished", node=copy.node, title=f"{copy.model} downloaded on {copy.node.name}",
                    body=f"{size} in {took / 60:.0f} min, at {copy.path or 'the model store'}.",
                    data={"model": str(copy.model), "bytes": copy.bytes_total})
    elif now == State.FAILED:
        alert_raise("download_failed", node=copy.node, title=f"Download of {copy.model} on {copy.node.name} failed",
                    body=copy.error or "No reason given.", data={"model": str(copy.model), "code": copy.error_code})


def run_moved(run, was: str, now: str) -> None:
    """A benchmark run ended: its headline figures (the best level's output tok/s, one stream's tok/s)."""
    S = type(run).Status
    if now not in (S.DONE, S.FAILED) or run.trials.exists():  # a study's trial: told in its study_finished
        return
    best = run.points.order_by("-output_throughput").first()
    figures = []
    if best is not None:
        at = f"{best.rate:g} req/s" if best.kind == "rate" else f"concurrency {best.concurrency}"
        figures.append(f"best {best.output_throughput:,.0f} output tok/s at {at}")
    if run.single_stream_tok_s:
        figures.append(f"one stream {run.single_stream_tok_s:,.1f} tok/s")
    outcome = "finished" if now == S.DONE else "failed"
    body = "; ".join(figures) + "." if figures else (run.error or "")
    alert_raise("benchmark_finished", deployment=run.deployment, title=f"Benchmark {run} {outcome} on {run.target}",
                body=body if now == S.DONE else (run.error or body),
                data={"run": run.pk, "status": now, "best_tok_s": best.output_throughput if best else None,
                      "best_concurrency": best.concurrency if best else None})


def study_moved(study, was: str, now: str) -> None:
    """A study ended: its winner and why."""
    S = type(study).Status
    if now not in (S.DONE, S.FAILED):
        return
    results = study.results or {}
    winner = results.get("winner")
    names = {v.get("id"): v.get("name") for v in results.get("variants", [])}
    winner_name = names.get(winner, winner)
    body = (f"Winner: {winner_name}. {results.get('winner_why', '')}".strip() if winner is not None
            else (study.error or "No variant won."))
    alert_raise("study_finished", deployment=study.deployment,
                title=f"Study {study} {'finished' if now == S.DONE else 'failed'} on {study.deployment.name}",
                body=body, data={"study": study.pk, "status": now, "winner": winner_name})
