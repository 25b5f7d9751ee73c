"""Shared plumbing beneath the apps: the queue, Redis, status transitions, errors, roles, request parameters, the API's
cache, error shape and idempotency, tokens, long polls, the request handler, private files, CSV, event loops, live updates (live/).
It imports Django and libraries only, never controlpanel, deployments, benchmarks or panelctl."""
