"""Writes that span models, the queue, the channel layer or a host, one module per subject; import
the module you use (`from deployments.services import deploys`).

Control plane: nodes (registration, telemetry, routing host work), repos (models and their copies),
deploys (create, redeploy, stop, persist). On the node: plan (the deploy plan), watch (stop, crashes,
live figures), reconcile (agent start), steps (their shared building blocks), guards (foreign GPU holders).
"""
