from django.apps import AppConfig


class BenchmarksConfig(AppConfig):
    name = "benchmarks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from benchmarks import studies, tasks  # noqa: F401 - registers the tasks services enqueue by name
        from deployments import drivers

        if studies.studies_drive not in drivers.STUDY_DRIVERS:  # the node agent steps tuning studies
            drivers.STUDY_DRIVERS.append(studies.studies_drive)
