"""The deployments app: nodes, GPUs, models, copies and deployments; its services, node side, pages, API, gateway,
notifications, and its live topics and payloads (payloads.py). It may import plumbing, never controlpanel,
panelctl or benchmarks (benchmarks registers what deployments runs for it: live topics, study steppers)."""
