"""What sits on a host: nodes, GPUs, models, model copies and deployments, with the gateway, notifications and
their live topics and payloads (payloads.py). Control plane (services/, views/, api/), node side (node/, host/)
and what both share (timeline, claims, dispatch). May import plumbing; never controlpanel, benchmarks or panelctl."""
