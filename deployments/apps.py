from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from deployments import payloads
        from deployments import tasks  # noqa: F401 - registers the tasks services enqueue by name
        from deployments import versions  # noqa: F401 - its receiver settles a version when its start ends
        from plumbing import apicache
        from plumbing.live import topics

        apicache.watch_database_writes()
        topics.register(*payloads.TOPICS)
