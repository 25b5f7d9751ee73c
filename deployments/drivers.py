"""Work other apps give the node agent to step on its node (issue 15's tuning studies): callables
taking the node's id and returning how many things they stepped. Kept apart from agent.py so an app
can register without importing the agent (and NVML) into every process."""
STUDY_DRIVERS: list = []  # filled by benchmarks' AppConfig.ready
