from django.apps import AppConfig


class BenchmarksConfig(AppConfig):
    name = "benchmarks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from benchmarks import payloads, studydriver, tasks  # noqa: F401 - registers the tasks services enqueue by name
        from deployments import agenthooks
        from plumbing.live import topics

        if studydriver.studies_drive not in agenthooks.STUDY_STEPPERS:  # the node agent steps tuning studies
            agenthooks.STUDY_STEPPERS.append(studydriver.studies_drive)
        topics.register(*payloads.TOPICS)
