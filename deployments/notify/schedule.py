"""What beat runs and how often (settings.CELERY_BEAT_SCHEDULE is this dict). Plain data and the environment
only: settings imports it. NOTIFY_BEAT_S: the period (30 s; tests shorten it)."""
import os

PERIOD_S = float(os.environ.get("NOTIFY_BEAT_S", "30"))
BEAT_SCHEDULE = {
    "notify-conditions": {"task": "notify.conditions_check", "schedule": PERIOD_S,
                          "options": {"queue": "control", "expires": 2 * PERIOD_S}},
    "notify-deliveries-due": {"task": "notify.deliveries_due", "schedule": PERIOD_S,
                              "options": {"queue": "control", "expires": 2 * PERIOD_S}},
}
