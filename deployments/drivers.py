"""Work other apps give the node agent to step on its node (the tuning studies): callables
taking the node's id and returning how many things they stepped. Kept apart from agent.py so an app
can register without importing the agent (and NVML) into every process."""
STUDY_DRIVERS: list = []  # filled by benchmarks' AppConfig.ready
# Re-drives of queued work other apps own (benchmark runs), called by deployments/node/redrive.py with
# (node id, due(task name, pk) -> bool, send(task name, pk, why=...) -> int); they return how many they sent.
REDRIVE_DRIVERS: list = []
