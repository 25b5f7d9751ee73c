"""Notifications: events worth telling, who hears of them, and how. The node side never calls in
here: hooks.py watches the rows it writes (status moves, downloads, runs) and checks.py the data the control
plane already keeps (heartbeats, telemetry).
May import the deployments app and plumbing; never controlpanel."""
