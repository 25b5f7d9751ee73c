"""What beat runs and how often (settings.CELERY_BEAT_SCHEDULE is this dict). Plain data: settings imports it."""
BEAT_SCHEDULE = {
    "notify-conditions": {"task": "notify.conditions_check", "schedule": 30.0, "options": {"queue": "control", "expires": 60}},
    "notify-deliveries-due": {"task": "notify.deliveries_due", "schedule": 30.0, "options": {"queue": "control", "expires": 60}},
}
