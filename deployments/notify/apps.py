from django.apps import AppConfig


class NotifyConfig(AppConfig):
    name = "deployments.notify"
    label = "notify"
    verbose_name = "Notifications"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from deployments.notify import hooks
        from deployments.notify import tasks  # noqa: F401 - registers the tasks alerts.py enqueues by name

        hooks.connect()
