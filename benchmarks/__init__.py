"""Benchmark runs, their points and tuning studies: models, services, tasks, pages, the API, the load generator
(runner/, plain Python) and their live topics and payloads (payloads.py, registered in BenchmarksConfig.ready()).
May import plumbing and deployments' models and selectors (never the other way round), never controlpanel or panelctl."""
