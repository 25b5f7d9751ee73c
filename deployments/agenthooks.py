"""Hooks other apps register with the node agent, so that it runs their work without importing them (and an
app registers without importing the agent, and NVML, into every process)."""
# The tuning studies' steppers: called with the node's id, they return how many things they stepped.
STUDY_STEPPERS: list = []  # filled by benchmarks' AppConfig.ready
# Re-drives of queued work other apps own (benchmark runs), called by deployments/node/redrive.py with
# (node id, due(task name, pk) -> bool, send(task name, pk, why=...) -> int); they return how many they sent.
REDRIVERS: list = []
