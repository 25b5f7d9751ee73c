"""A real Prometheus (Debian's package) scrapes the live panel with the scrape token and, through the
panel's HTTP service discovery, the real CPU vLLM engine the panel deployed, which listens on loopback: Prometheus
reaches its /metrics through the node's gateway (a real `manage.py gateway`) with the same token; its
query API then answers with the panel's series, the engine's `vllm:` series labelled by the panel, and the
DCGM-named recording rules. The same engine then tells a subscriber (a real webhook receiver) that it is ready and,
once killed, that it crashed; and the shipped alert rules put DeploymentDown into a real Alertmanager."""
import os
import re
import shutil
import signal
from pathlib import Path

import httpx
import pytest
import yaml
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families

from deployments import engineapikey, payloads
from deployments.host import vllm
from deployments.models import Deployment, Node
from deployments.notify import checks, deliveries, services as notify
from deployments.notify.models import Delivery
from deployments.services import deploys, nodes
from plumbing.live import snapshots
from tests.conftest import free_port, in_thread, wait_until
from tests.e2e.test_gateway import start_gateway
from tests.factories import GpuFactory, NodeFactory, UserFactory
from tests.test_metrics import _sample
from tests.test_monitoring import DASHBOARDS, VLLM_NAMES, _exprs, metric_names
from tests.webhooks import receiving, signed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parent.parent.parent
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
TOKEN = "scrape-token-for-the-e2e-test"


def _config(panel: str, token_file: Path, alerts: Path, alertmanager: str) -> dict:
    """monitoring/prometheus.yml, pointed at the live panel instead of compose's 127.0.0.1:8000, with the alert
    rules at `alerts` and the Alertmanager at `alertmanager` (host:port)."""
    config = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(ROOT / "monitoring" / "dcgm-rules.yml"), str(alerts)]
    [am] = config["alerting"]["alertmanagers"]
    am["static_configs"] = [{"targets": [alertmanager]}]
    host = panel.removeprefix("http://")
    for job in config["scrape_configs"]:
        job["scrape_timeout"] = "1s"
        if "static_configs" in job:
            job["static_configs"] = [{"targets": [host]}]
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(token_file)
        for sd in job.get("http_sd_configs", []):
            sd["url"] = sd["url"].replace("http://127.0.0.1:8000", panel)
            sd["refresh_interval"] = "1s"
            sd["authorization"]["credentials_file"] = str(token_file)
    return config


def _query(prometheus: str, expr: str) -> list[dict]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=5)
    response.raise_for_status()  # while its storage starts, Prometheus answers 503 in plain text
    answer = response.json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _alerts(alertmanager: str, name: str) -> list[dict]:
    response = httpx.get(f"{alertmanager}/api/v2/alerts", params={"filter": f'alertname="{name}"'}, timeout=5)
    response.raise_for_status()
    return response.json()


@pytest.fixture
def hook():
    with receiving() as receiver:
        yield receiver


def _deliver_pending() -> list[str]:
    """What the control worker's notify.deliver does with each pending delivery (called here as a function)."""
    return [deliveries.delivery_send(pk) for pk in Delivery.objects.filter(status="pending").order_by("id")
            .values_list("pk", flat=True)]


@pytest.mark.slow
def test_a_real_prometheus_scrapes_the_panel_and_the_engines_it_discovers(
        live_server_asgi, cpu_node, spawn, process_env, tmp_path, unique, hook):
    """A real engine load, then a real Prometheus's first scrapes and its recording rules' first evaluation, then
    the engine killed: a crash told to a subscriber and raised in Alertmanager (over 60 s: one CPU engine load)."""
    assert Path(PROMETHEUS).exists(), "./panel test installs Debian's prometheus package"
    assert Path(ALERTMANAGER).exists(), "./panel test installs Debian's prometheus-alertmanager package"
    node, model = cpu_node
    UserFactory(role="admin")  # the scrape key's owner (deployments/scrapekey.py)
    # A subscriber to "ready" and "crashed", on a signed webhook (webhook channels are an admin's).
    ops = UserFactory(role="admin", username=f"ops-{unique}")
    channel, signing_key = notify.channel_add(ops, "webhook", "ops hook", hook.url)
    notify.subscription_add(ops, ["ready", "crashed", "slo_breached"])
    gpu_node = NodeFactory(name=f"gpu-{unique}")  # a GPU host's telemetry, as its agent would send it
    GpuFactory(node=gpu_node, index=0, uuid="GPU-0", name="NVIDIA H200")
    deployment = in_thread(deploys.deployment_create, model=model, node=node, gpu_indices=[], port=free_port(),
                           name=f"tiny-{unique}", env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"},
                           engine_args={"max-model-len": 2048, "served-model-name": "tiny", "enforce-eager": True})
    wait_until(lambda: Deployment.objects.get(pk=deployment.pk).status == "ready", timeout=300, interval=1,
               message="the engine to be ready")
    # The agent's move to ready wrote the alert and its delivery in the same transaction: one signed message.
    assert _deliver_pending() == ["sent"]
    [told] = hook.received
    assert signed(told, signing_key) and (told.json["event"], told.json["phase"]) == ("ready", "firing")
    assert told.json["title"].startswith(f"{deployment.name} is ready after ") and told.json["data"]["load_seconds"] > 0
    # On the node's address (discovery gives Prometheus that); it reports its port on the node's row.
    gateway = start_gateway(spawn, process_env, node.name, host=node.address or "127.0.0.1")
    gateway_port = wait_until(lambda: Node.objects.get(pk=node.pk).gateway_port, timeout=30, message="the gateway's port")

    # Recorded now, not before the load: the latest sample is kept for a bounded time, and a load on a busy
    # machine can outlast it (the recording rules would then have no GPU figures to evaluate).
    nodes.node_sample_record(gpu_node.pk, _sample(1_700_000_000.0, [(40, 90)]), {})
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    # The shipped rules with every `for:` shortened (a test cannot wait minutes), and a real Alertmanager.
    alerts = tmp_path / "alerts.yml"
    alerts.write_text(re.sub(r"\bfor: \d+[smh]\b", "for: 1s", (ROOT / "monitoring" / "alerts.yml").read_text()))
    am_port = free_port()
    alertmanager = f"http://127.0.0.1:{am_port}"
    spawn([ALERTMANAGER, f"--config.file={ROOT / 'monitoring' / 'alertmanager.yml'}", f"--storage.path={tmp_path / 'am'}",
           f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="], {"PATH": "/usr/bin:/bin"},
          name="alertmanager")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(
        _config(live_server_asgi, token_file, alerts, f"127.0.0.1:{am_port}")))
    port = free_port()
    prometheus = f"http://127.0.0.1:{port}"
    with override_settings(METRICS_TOKEN=TOKEN):
        # What Prometheus will do, by hand first: discovery (which keeps the gateways' scrape key), then the engine's
        # /metrics through the gateway with the scrape token (refused without it).
        listed = httpx.get(f"{live_server_asgi}/api/prometheus/targets/", headers={"Authorization": f"Bearer {TOKEN}"},
                           timeout=10).json()
        assert [g["labels"]["__metrics_path__"] for g in listed] == [f"/engines/{deployment.pk}/metrics"]
        engine_metrics = f"{gateway}/engines/{deployment.pk}/metrics"
        wait_until(lambda: httpx.get(engine_metrics, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).status_code
                   == 200, timeout=10, interval=0.2, message="the gateway to take the scrape key")
        assert httpx.get(engine_metrics, timeout=5).status_code == 401
        spawn([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
               f"--web.listen-address=127.0.0.1:{port}"], {"PATH": "/usr/bin:/bin"}, name="prometheus")

        def both_up():
            try:
                up = {r["metric"]["job"]: r["value"][1] for r in _query(prometheus, "up")}
            except (httpx.HTTPError, ValueError):  # not up yet, or not JSON yet
                return False
            return up if up.get("panel") == "1" and up.get("vllm") == "1" else False

        try:
            wait_until(both_up, timeout=90, interval=1, message="Prometheus to scrape the panel and the engine")
        except pytest.fail.Exception:  # say why: each target's last scrape
            targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            pytest.fail(f"not both up in 90 s: {[(t['scrapeUrl'], t['health'], t.get('lastError')) for t in targets]}")
        try:
            wait_until(lambda: _query(prometheus, "DCGM_FI_DEV_FB_USED"), timeout=60, interval=1,
                       message="the recording rules' first evaluation")
        except pytest.fail.Exception:  # say why: a scrape's error, or the panel's figures without the GPU
            targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            scraped = [(t["labels"].get("job"), t["health"], t.get("lastError"), t.get("lastScrapeDuration"))
                       for t in targets]
            gpu_lines = [line for line in httpx.get(f"{live_server_asgi}/metrics", timeout=10, headers={
                "Authorization": f"Bearer {TOKEN}"}).text.splitlines() if line.startswith("panel_gpu_memory_used")]
            pytest.fail(f"no recording rule result in 60 s; targets {scraped}; the panel's GPU lines {gpu_lines}")

        online = _query(prometheus, f'panel_node_online{{node="{node.name}"}}')
        assert [r["value"][1] for r in online] == ["1"]
        state = _query(prometheus, f'panel_deployment_state{{deployment="{deployment.name}"}} == 1')
        assert [r["metric"]["state"] for r in state] == ["ready"]
        phases = {r["metric"]["phase"] for r in _query(prometheus, f'panel_deployment_load_phase_seconds{{deployment="{deployment.name}"}}')}
        assert {"launch", "load"} <= phases
        used = _query(prometheus, f'DCGM_FI_DEV_FB_USED{{Hostname="{gpu_node.name}", gpu="0"}}')
        assert [float(r["value"][1]) for r in used] == [40 * 1024]  # MiB, as dcgm-exporter says it

        engine = _query(prometheus, 'vllm:num_requests_running{job="vllm"}')
        assert len(engine) == 1
        labels = engine[0]["metric"]
        assert (labels["node"], labels["deployment"], labels["model"]) == (node.name, deployment.name, str(model))
        assert "gpus" not in labels  # a CPU engine: Prometheus drops a label whose value is empty
        assert labels["instance"] == f"{node.address or '127.0.0.1'}:{gateway_port}"  # the gateway, not the engine
        scraped = [t["scrapeUrl"] for t in httpx.get(f"{prometheus}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
                   if t["labels"].get("job") == "vllm"]
        assert scraped == [f"http://{node.address or '127.0.0.1'}:{gateway_port}/engines/{deployment.pk}/metrics"]

        # The recorded vLLM names the dashboards are checked against are what this engine serves.
        text = httpx.get(f"http://127.0.0.1:{deployment.port}/metrics", timeout=5).text
        served = {s.name for f in text_string_to_metric_families(text) for s in f.samples} | {
            f.name for f in text_string_to_metric_families(text)}
        dashboard_vllm = {n for d in DASHBOARDS.values() for e in _exprs(d) for n in metric_names(e)
                          if n.startswith("vllm:")}
        assert dashboard_vllm and dashboard_vllm <= served
        assert dashboard_vllm <= VLLM_NAMES

        # An objective no engine meets (TTFT p95 at most 1 ms, told at once): one real request, the agent's reading
        # of the engine's own TTFT histogram, and the periodic check tells the subscriber.
        notify.slo_set(ops, deployment.pk, ttft_p95_ms=1, error_pct=None, minutes=0)
        served = Deployment.objects.get(pk=deployment.pk)
        vllm.smoke_test(f"http://127.0.0.1:{served.port}", "tiny", key=engineapikey.of(served))
        topic = payloads.deployment_topic(deployment.pk)
        figures = wait_until(lambda: (kept := snapshots.kept([topic], "engine")[0] or {}).get("window_requests") and kept,
                             timeout=30, interval=0.5, message="the agent's SLO figures of the engine")
        assert figures["ttft_p95_s"] > 0.001 and figures["error_share"] == 0.0
        checks.conditions_check()
        assert _deliver_pending() == ["sent"]
        breach = hook.received[-1].json
        assert breach["event"] == "slo_breached" and breach["title"].startswith(f"{deployment.name} breaks its SLO: TTFT p95")

        # Kill the engine: the agent fails the deployment as crashed, the subscriber is told once, and the shipped
        # rules raise DeploymentDown for it in Alertmanager.
        assert not _alerts(alertmanager, "DeploymentDown")
        os.kill(Deployment.objects.get(pk=deployment.pk).pid, signal.SIGKILL)
        wait_until(lambda: Deployment.objects.get(pk=deployment.pk).status == "failed", timeout=120, interval=0.5,
                   message="the agent to see the crash")
        # The message says what happened: the signal the agent reaped from its own child, and the engine's own last
        # lines, not the agent's /health and /metrics polls that fill a quiet engine's log.
        message = Deployment.objects.get(pk=deployment.pk).status_message
        assert message.startswith("Crashed: the engine process exited, killed by SIGKILL (signal 9): killed from outside"), message
        assert '"GET /health' not in message and '"GET /metrics' not in message, message
        assert _deliver_pending() == ["sent"]
        assert [r.json["event"] for r in hook.received] == ["ready", "slo_breached", "crashed"]
        crash = hook.received[2]
        assert signed(crash, signing_key) and crash.json["title"] == f"{deployment.name} crashed"
        assert crash.json["severity"] == "error"
        down = wait_until(lambda: _alerts(alertmanager, "DeploymentDown"), timeout=90, interval=1,
                          message="DeploymentDown in Alertmanager")
        assert [(a["labels"]["deployment"], a["labels"]["node"], a["labels"]["severity"]) for a in down] == [
            (deployment.name, node.name, "critical")]
