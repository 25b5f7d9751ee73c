"""The node gateway: the one public door of a node. Callers' keys, the names a deployment answers
to, its admission bounds and the usage the gateways count live here (a Django app of its own, label
`gateway`); the proxy process is `manage.py gateway` (deployments/gateway/server.py).
May import deployments' models and plain helpers and plumbing; never controlpanel."""
