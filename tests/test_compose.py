"""docker-compose.yml is the production path; no Docker engine runs here, so parse and check it."""
import re
import shlex
from pathlib import Path

import yaml

from controlpanel.celery import app as celery_app

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _argv(service) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def test_compose_has_every_production_service():
    assert {"postgres", "redis", "web", "worker", "nodeagent", "gateway", "migrate"} <= set(SERVICES)


def test_every_long_running_service_has_a_healthcheck():
    for name in ("postgres", "redis", "web", "worker", "nodeagent", "gateway"):
        assert SERVICES[name]["healthcheck"]["test"], name


def test_every_panel_command_points_at_something_that_exists_in_the_project():
    from django.core.management import get_commands

    commands = get_commands()
    for name in ("migrate", "web", "worker", "nodeagent"):
        argv = _argv(SERVICES[name])
        if argv[:2] == ["python", "manage.py"]:
            assert argv[2] in commands, f"{name}: manage.py {argv[2]} does not exist"
        elif argv[:3] == ["python", "-m", "uvicorn"]:
            module, attr = argv[3].split(":")
            assert hasattr(__import__(module, fromlist=[attr]), attr), f"{name}: {argv[3]} does not exist"
        elif argv[:3] == ["celery", "-A", "controlpanel"]:
            queues = argv[argv.index("-Q") + 1]
            assert queues == celery_app.conf.task_default_queue
        else:
            raise AssertionError(f"{name}: unexpected command {argv}")


def test_services_use_postgres_and_redis_and_wait_for_them():
    for name in ("web", "worker", "nodeagent"):
        env = SERVICES[name]["environment"]
        assert env["DATABASE_URL"].startswith("postgres://")
        assert env["REDIS_URL"].startswith("redis://")
        assert SERVICES[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_the_node_agent_gets_the_gpus_and_the_model_store():
    agent = SERVICES["nodeagent"]
    devices = agent["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert any(volume.endswith(":/models") for volume in agent["volumes"])
    assert "--model-store" in _argv(agent) and "/models" in _argv(agent)
    dockerfile = (ROOT / agent["build"]["dockerfile"]).read_text()
    assert re.search(r"^FROM vllm/vllm-openai", dockerfile, re.M)


def test_secrets_come_from_the_environment_not_the_file():
    text = (ROOT / "docker-compose.yml").read_text()
    assert "${SECRET_KEY:?" in text
    assert "hf_" not in text.lower().replace("hf_endpoint", "").replace("hf_token_file", "").replace("hf_token_key_file", "")


def test_every_container_that_reads_the_stored_hf_token_shares_its_key():
    """The token is stored encrypted (deployments/sealed.py): web (the settings page), the control worker and the
    node agent (downloads) must open it with one key, kept on a volume rather than in each container."""
    key_file = SERVICES["web"]["environment"]["HF_TOKEN_KEY_FILE"]
    folder = key_file.rsplit("/", 1)[0]
    for name in ("web", "worker", "nodeagent", "gateway"):  # the gateway unseals engine keys
        env = SERVICES[name]["environment"]
        assert env["HF_TOKEN_KEY_FILE"] == key_file, name
        assert f"panelkeys:{folder}" in SERVICES[name]["volumes"], name


def test_every_gpu_host_must_name_its_node_agent():
    """Two hosts with one default name would share a queue: compose refuses to start without NODE_NAME."""
    agent = SERVICES["nodeagent"]
    for text in (" ".join(_argv(agent)), " ".join(agent["healthcheck"]["test"])):
        assert re.search(r"\$\{NODE_NAME:\?[^}]+\}", text), text
        assert "NODE_NAME:-" not in text


def test_the_gateway_is_the_nodes_door_on_the_host_network_named_like_its_agent():
    """Engines listen on the host's loopback: the gateway must share the host's network, serve the
    agent's node name, and listen on every interface (it is the one public door)."""
    gateway, agent = SERVICES["gateway"], SERVICES["nodeagent"]
    argv, agent_argv = _argv(gateway), _argv(agent)
    assert gateway["network_mode"] == "host" and argv[:3] == ["python", "manage.py", "gateway"]
    assert argv[argv.index("--node") + 1] == agent_argv[agent_argv.index("--name") + 1]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert gateway["environment"]["DATABASE_URL"] == agent["environment"]["DATABASE_URL"]


def test_grafana_needs_a_password_from_env_and_listens_on_localhost_by_default():
    """No admin/admin on every interface: compose refuses to start Grafana without GRAFANA_ADMIN_PASSWORD, and
    Grafana (on the host's network, where `ports` does not apply) binds to 127.0.0.1 unless GRAFANA_BIND says so."""
    grafana = SERVICES["grafana"]
    env = grafana["environment"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", env["GF_SECURITY_ADMIN_PASSWORD"])
    assert env["GF_SERVER_HTTP_ADDR"] == "${GRAFANA_BIND:-127.0.0.1}"
    assert grafana["network_mode"] == "host" and "ports" not in grafana
    assert "${GRAFANA_BIND:-127.0.0.1}" in " ".join(grafana["healthcheck"]["test"])
    example = (ROOT / ".env.example").read_text()
    assert re.search(r"^GRAFANA_ADMIN_PASSWORD=$", example, re.M) and re.search(r"^#GRAFANA_BIND=127\.0\.0\.1$", example, re.M)


def _interpolated(text: str) -> str:
    """What compose makes of ${VAR:-default} with nothing set in .env."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def test_engines_are_containers_of_their_own_in_the_agents_image():
    """An engine the agent spawned as a child would live in the agent container's cgroup and die at its restart
    (tests/faults/test_agent_restart.py shows both); the agent starts each engine through the Docker API instead,
    in the image compose builds for the agent itself, and follows it by PID in the host's namespace."""
    from deployments.host import containers

    agent = SERVICES["nodeagent"]
    env = agent["environment"]
    assert env[containers.RUNTIME_VAR] == "docker"
    assert env[containers.IMAGE_VAR] == agent["image"] and "build" in agent
    assert "/var/run/docker.sock:/var/run/docker.sock" in agent["volumes"]
    assert [name for name, s in SERVICES.items() if any("docker.sock" in v for v in s.get("volumes", []))] == ["nodeagent"]
    assert agent["pid"] == "host" and agent["ipc"] == "host" and agent["network_mode"] == "host"


def test_an_engine_container_sees_what_the_agent_sees_at_the_same_paths():
    """The agent writes the engine's log under its var folder and shares model folders from its store; the engine
    container mounts the same sources at the same targets (a named volume by the name compose gives it)."""
    from deployments.host import containers

    agent = SERVICES["nodeagent"]
    named = {key: (spec or {}).get("name", key) for key, spec in COMPOSE["volumes"].items()}
    agent_mounts = {}
    for volume in agent["volumes"]:
        source, target = _interpolated(volume).split(":")[:2]
        agent_mounts[target] = named.get(source, source)
    engine_mounts = {bind.split(":")[1]: bind.split(":")[0]
                     for bind in containers.mounts(_interpolated(agent["environment"][containers.MOUNTS_VAR]))}
    dockerfile = (ROOT / agent["build"]["dockerfile"]).read_text()
    var_dir = re.search(r"PANEL_VAR_DIR=(\S+)", dockerfile)[1]
    home = re.search(r"--home-dir (\S+)", dockerfile)[1]
    assert {"/models", var_dir, home} <= set(engine_mounts), engine_mounts
    for target, source in engine_mounts.items():
        assert agent_mounts.get(target) == source, f"{target}: the engine mounts {source}, the agent {agent_mounts.get(target)}"


def test_the_node_agent_can_firewall_multi_node_engines():
    """deployments/host/firewall.py refuses multi-node and Ray deploys where it cannot work: nft in the image,
    CAP_NET_ADMIN, and the host's cgroup namespace, writable (engine containers' cgroups are matched there, its
    self-test probe gets a cgroup of its own)."""
    agent = SERVICES["nodeagent"]
    assert agent["cgroup"] == "host" and "NET_ADMIN" in agent["cap_add"]
    assert "/sys/fs/cgroup:/sys/fs/cgroup:rw" in agent["volumes"], "Docker mounts cgroupfs read-only otherwise"
    assert re.search(r"apt-get install .*\bnftables\b", (ROOT / agent["build"]["dockerfile"]).read_text())


def test_one_beat_service_runs_the_notification_schedule():
    """The periodic notification checks need Celery beat, exactly once per panel: a service of its own (workers
    may scale), with the schedule settings.py takes from deployments/notify/schedule.py."""
    from django.conf import settings

    beats = [name for name, s in SERVICES.items() if "beat" in s.get("command", [])]
    assert beats == ["beat"] and SERVICES["beat"]["command"][:3] == ["celery", "-A", "controlpanel"]
    assert "-B" not in SERVICES["worker"]["command"]
    assert {e["task"] for e in settings.CELERY_BEAT_SCHEDULE.values()} == {"notify.conditions_check", "notify.deliveries_due"}
