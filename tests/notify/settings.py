"""The panel's settings with the notify app and its URLs, for as long as controlpanel/settings.py lacks them
(then this module changes nothing)."""
from controlpanel.settings import *  # noqa: F401,F403
from controlpanel.settings import INSTALLED_APPS

if "deployments.notify" not in INSTALLED_APPS:
    INSTALLED_APPS = [*INSTALLED_APPS, "deployments.notify"]
ROOT_URLCONF = "tests.notify.urls"
if not globals().get("CELERY_BEAT_SCHEDULE"):
    from deployments.notify.schedule import BEAT_SCHEDULE as CELERY_BEAT_SCHEDULE  # noqa: F401
