from django.apps import AppConfig


class ControlPanelConfig(AppConfig):
    """The wiring package holds the few tables of shared plumbing (controlpanel/models.py)."""

    name = "controlpanel"
    verbose_name = "Control panel"
