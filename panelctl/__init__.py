"""The command-line tools: panelctl (cli.py, the panel's REST API from a terminal) and the launcher behind ./panel.
client.py holds the HTTP client, errors and output; one module per command group (deployments, runs, tune, ...).
It may import plumbing's plain-Python helpers, never Django, controlpanel, deployments or benchmarks."""
