"""Benchmark runs, their points and tuning studies: models, services, tasks, pages, the API and the load generator.
May import plumbing and deployments' models and selectors (never deployments' services, views or API), never
controlpanel or panelctl; the load generator (runner/) stays plain Python."""
