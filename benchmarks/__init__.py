"""The benchmarks app: runs, their results and tuning studies; the load generator (runner/, no Django); its live
topics and payloads (payloads.py), registered in BenchmarksConfig.ready(). It may import plumbing and
deployments (never the other way round), never controlpanel or panelctl."""
