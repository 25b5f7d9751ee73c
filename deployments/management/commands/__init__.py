"""`manage.py nodeagent` (the node agent) and `manage.py gateway` (the gateway's proxy), one module each.
A command parses its options and calls one entry point of the app; no logic of its own.
May import the deployments app and plumbing; never controlpanel."""
