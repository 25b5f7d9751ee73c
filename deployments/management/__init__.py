"""Django management commands of the deployments app (commands/): the node agent and the gateway's proxy.
Each command parses its options and calls into the app (agent, gateway server, services).
May import the deployments app and plumbing; never controlpanel."""
