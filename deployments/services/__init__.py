"""Writes that span models, the queue, the channel layer or a host, one module per subject; import
the module you use (`from deployments.services import deploys`).

Control plane: nodes (registration, telemetry, routing host work), repos (models and their copies),
deploys (create, redeploy, stop, persist), multinode (placement checks). What runs on the node (the plan,
ranks, Ray, the crash watch, reconcile, an engine's lifecycle) is in deployments/node/; what both sides
need sits beneath both: timeline.py (events), claims.py (GPU holders, the node lock), dispatch.py (host
work by task name), layout.py (an engine's parallel layout).
May import deployments' models, selectors and the modules beneath both sides, and plumbing; never controlpanel.
"""
