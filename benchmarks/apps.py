from django.apps import AppConfig


class BenchmarksConfig(AppConfig):
    name = "benchmarks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from benchmarks import tasks  # noqa: F401 - registers the tasks services enqueue by name
