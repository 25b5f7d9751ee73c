"""What `./panel start`'s launcher says of its children (PANEL_VAR_DIR/launcher.json, written by
panelctl.launcher.Children._record): whether the node agent of the node it runs exited and is about to be started
again, so that node's page says "node agent restarting" rather than a bare "offline"."""
import json
from pathlib import Path

from django.conf import settings

STATE_FILE = "launcher.json"  # panelctl.launcher.LAUNCHER_STATE


def agent_restart(node) -> dict | None:
    """{"code", "exited", "next_start"} (Unix times) while the launcher is to start `node`'s agent again (its last
    heartbeat may still look fresh); None when it is not (the agent was started again, or does not run under this
    panel's launcher)."""
    try:
        state = json.loads((Path(settings.VAR_DIR) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    agent = (state.get("children") or {}).get("nodeagent") or {}
    if state.get("node") != node.name or agent.get("state") != "restarting":
        return None
    return {k: agent.get(k) for k in ("code", "exited", "next_start")}
