"""The one place events enter: signals on the rows whose status moves (deployments, model copies, benchmark
runs, studies). A row remembers its status as loaded; a save that changed it is told (events.py) in a savepoint
of the same transaction, so the alert exists exactly when the move does, and a failure to tell is logged, never
raised into the plan, the agent or the request that saved the row.

Every status move of these models goes through Model.save (select_for_update, transition, save), none
through QuerySet.update, so none is missed. Notifications observe the other apps (benchmarks included);
nothing imports notify."""
from django.apps import apps
from django.db.models.signals import post_init, post_save

from deployments.notify import events
from deployments.notify.alerts import in_savepoint

# (app label, model, status field, handler)
WATCHED = (
    ("deployments", "Deployment", "status", "deployment"),
    ("deployments", "ModelCopy", "state", "copy"),
    ("benchmarks", "BenchmarkRun", "status", "run"),
    ("benchmarks", "Study", "status", "study"),
)


def _remember(field: str):
    def remember(sender, instance, **kwargs):
        # A deferred status (only()/defer()) is not in __dict__: such an instance tells nothing when saved.
        instance._notify_was = instance.__dict__.get(field)
        instance._notify_restarts = instance.__dict__.get("restarts")
    return remember


def _told(field: str, handler: str):
    def told(sender, instance, created, raw=False, **kwargs):
        now = instance.__dict__.get(field)
        was = getattr(instance, "_notify_was", None)
        restarts_was = getattr(instance, "_notify_restarts", None)
        instance._notify_was, instance._notify_restarts = now, instance.__dict__.get("restarts")
        if raw or created or was is None or now is None or now == was:
            return
        if handler == "deployment":
            restarted = restarts_was is not None and (instance.restarts or 0) > restarts_was
            in_savepoint(events.deployment_moved, instance, was, now, restarted)
        elif handler == "copy":
            in_savepoint(events.copy_moved, instance, was, now)
        elif handler == "run":
            in_savepoint(events.run_moved, instance, was, now)
        else:
            in_savepoint(events.study_moved, instance, was, now)
    return told


def connect() -> None:
    for app_label, model_name, field, handler in WATCHED:
        model = apps.get_model(app_label, model_name)
        post_init.connect(_remember(field), sender=model, weak=False, dispatch_uid=f"notify-init-{model_name}")
        post_save.connect(_told(field, handler), sender=model, weak=False, dispatch_uid=f"notify-save-{model_name}")
