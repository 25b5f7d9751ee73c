from django.apps import AppConfig


class BenchmarksConfig(AppConfig):
    name = "benchmarks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from benchmarks import studies, tasks  # noqa: F401 - registers the tasks services enqueue by name
        from deployments import agent

        if studies.studies_drive not in agent.STUDY_DRIVERS:  # the node agent steps tuning studies
            agent.STUDY_DRIVERS.append(studies.studies_drive)
