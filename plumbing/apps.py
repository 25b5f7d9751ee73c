from django.apps import AppConfig


class PlumbingConfig(AppConfig):
    """The few tables of the shared plumbing (plumbing/models.py). The label stays "controlpanel", the package
    they were made in: their migrations, their rows in django_migrations and their table names keep it."""

    name = "plumbing"
    label = "controlpanel"
    verbose_name = "Plumbing"

    def ready(self):
        from plumbing.live import access, drops

        drops.count_drops()
        access.connect_signals()
