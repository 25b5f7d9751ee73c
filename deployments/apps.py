from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from controlpanel import apicache
        from deployments import signals

        apicache.watch_database_writes()
        signals.connect()
