"""Node side: what the agent on a GPU host does for a deployment (the plan, ranks, Ray, the crash watch, reconcile).
Runs in the agent's worker and talks to the host through deployments/host/.
May import deployments' models, host/, the modules beneath both sides and plumbing; never a service, view or API."""
