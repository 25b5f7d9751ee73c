"""A panel inside a perf script's own process, as production runs one: its files, a fresh SQLite database and an
embedded Redis under the run's folder, Django set up and migrated; and, at the end, no engine left behind.
For prewarm.py, study_verdicts.py, deploy_overhead.py and multinode_overhead.py (which put the repository on
sys.path before importing this)."""
import os
import secrets
import sys
from pathlib import Path

from panelctl import launcher


def start_panel(var: Path, children: launcher.Children, **env: str) -> dict:
    """Make this process a panel under `var`, its embedded Redis one of `children`; `env` adds to its variables
    (the engine, a CHANNELS_PREFIX of the run's, ...). Returns the environment, for the children the script starts."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")} | {
        "PANEL_VAR_DIR": str(var), "DATABASE_URL": f"sqlite:///{var / 'panel.sqlite3'}", "CPU_HOST_EXCLUSIVE": "0",
        "DJANGO_SETTINGS_MODULE": "controlpanel.settings", "SECRET_KEY": secrets.token_urlsafe(50),
        # The run's own folders and the repository's var/ (the tiny model): where the scripts' local models lie.
        "LOCAL_MODEL_ROOTS": f"{var},{Path(__file__).resolve().parent.parent / 'var'}", **env}
    env["REDIS_URL"] = launcher.start_embedded_redis(children, env, var)
    os.environ.update(env)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return env


def stop_engines(ranks: bool = False) -> None:
    """Engines run in their own sessions and outlive the agent: stop every deployment's (`ranks`: a multi-node
    deployment's worker ranks' too)."""
    try:
        from deployments.host import processes
        from deployments.models import Deployment, DeploymentRank
    except Exception as exc:  # noqa: BLE001 - Django may not be set up yet
        print(f"note: engines not checked: {exc}", file=sys.stderr)
        return
    for model, what in ((Deployment, "engines"), (DeploymentRank, "ranks"))[:2 if ranks else 1]:
        try:
            for pgid in model.objects.exclude(pgid=None).values_list("pgid", flat=True):
                processes.stop(pgid, term_timeout_s=5, kill_timeout_s=5)
        except Exception as exc:  # noqa: BLE001 - Django may not be set up yet
            print(f"note: {what} not checked: {exc}", file=sys.stderr)
