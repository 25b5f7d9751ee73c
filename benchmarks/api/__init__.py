"""The benchmarks' REST API: serializers, views and URLs for runs, studies and workloads.
Views validate, call one service of benchmarks (services.py, studies.py) and serialize; reads go through selectors.
May import benchmarks, deployments' models and selectors, and plumbing; never controlpanel or panelctl."""
