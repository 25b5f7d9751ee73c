"""The compose `monitoring` profile and what it mounts: Prometheus' config points at the panel's real
endpoints, Grafana's provisioning finds the dashboards, and every dashboard queries only metrics
the panel exposes or vLLM serves. No Docker engine runs here, so the files are parsed and checked
(with Debian's promtool where installed)."""
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from django.urls import resolve
from prometheus_client.parser import text_string_to_metric_families

from tests.test_metrics import _sample

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "monitoring"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
PROMETHEUS = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
DASHBOARDS = {p.stem: json.loads(p.read_text()) for p in sorted((MONITORING / "grafana" / "dashboards").glob("*.json"))}
VLLM_NAMES = {line.strip() for line in (MONITORING / "vllm-metric-names.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
                "inf", "nan"}


def _mounts(service: dict) -> dict[str, str]:
    """{path in the container: path in the repo} of a service's bind mounts."""
    found = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            found[target] = source[2:]
    return found


def _exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana label_values() query) reads."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # strings: label values, regexes
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r"label_values\(([^,)]+),[^)]*\)", r"\1", expr)  # Grafana: label_values(metric, label)
    names = set(re.findall(r"(?<![\w:$.])([a-zA-Z_:][\w:]*)\b(?!\s*\()", expr))
    return names - PROMQL_WORDS


def test_the_profile_adds_prometheus_and_grafana_and_only_with_the_profile():
    services = COMPOSE["services"]
    assert services["prometheus"]["profiles"] == ["monitoring"] and services["grafana"]["profiles"] == ["monitoring"]
    assert not [name for name in ("postgres", "redis", "web", "worker", "nodeagent") if services[name].get("profiles")]
    for name in ("prometheus", "grafana"):
        for target, source in _mounts(services[name]).items():
            assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repo"
        assert services[name]["healthcheck"]["test"]


def test_prometheus_reads_the_mounted_rules_and_the_token_compose_hands_it():
    prometheus = COMPOSE["services"]["prometheus"]
    mounts = _mounts(prometheus)
    config_path = re.search(r"--config.file=(\S+)", " ".join(prometheus["command"]))[1]
    assert mounts[config_path] == "monitoring/prometheus.yml"
    for rule_file in PROMETHEUS["rule_files"]:
        assert rule_file in mounts, f"{rule_file} is not mounted"
    secret = prometheus["secrets"][0]
    assert COMPOSE["secrets"][secret] == {"environment": "METRICS_TOKEN"}
    assert COMPOSE["x-panel-env"]["METRICS_TOKEN"] == "${METRICS_TOKEN:-}"
    jobs = {job["job_name"]: job for job in PROMETHEUS["scrape_configs"]}
    # The vllm job's own: engines' /metrics through the gateways take the scrape token too.
    for authorization in (jobs["panel"]["authorization"], jobs["vllm"]["http_sd_configs"][0]["authorization"],
                          jobs["vllm"]["authorization"]):
        assert authorization == {"type": "Bearer", "credentials_file": f"/run/secrets/{secret}"}


def test_prometheus_scrapes_the_panels_real_endpoints():
    jobs = {job["job_name"]: job for job in PROMETHEUS["scrape_configs"]}
    assert resolve(jobs["panel"]["metrics_path"]).url_name == "metrics"
    assert jobs["panel"]["static_configs"][0]["targets"] == ["127.0.0.1:8000"]  # web publishes 8000
    sd_url = jobs["vllm"]["http_sd_configs"][0]["url"]
    assert sd_url.startswith("http://127.0.0.1:8000/")
    assert resolve(sd_url.removeprefix("http://127.0.0.1:8000")).url_name == "api-prometheus-targets"


@pytest.mark.tools
def test_promtool_accepts_the_config_and_the_rules(tmp_path):
    rules = MONITORING / "dcgm-rules.yml"
    checked = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (tmp_path / "token").write_text("t")
    text = (MONITORING / "prometheus.yml").read_text()
    text = (text.replace("/etc/prometheus/dcgm-rules.yml", str(rules))
            .replace("/etc/prometheus/alerts.yml", str(MONITORING / "alerts.yml"))
            .replace("/run/secrets/metrics_token", str(tmp_path / "token")))
    (tmp_path / "prometheus.yml").write_text(text)
    checked = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_grafana_provisions_the_datasource_the_dashboards_use_and_loads_them_from_the_mount():
    grafana = COMPOSE["services"]["grafana"]
    mounts = _mounts(grafana)
    provisioning = MONITORING / "grafana" / "provisioning"
    assert mounts["/etc/grafana/provisioning"] == "monitoring/grafana/provisioning"
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://127.0.0.1:9090"
    assert "--web.listen-address=127.0.0.1:9090" in COMPOSE["services"]["prometheus"]["command"]
    provider = yaml.safe_load((provisioning / "dashboards" / "panel.yml").read_text())["providers"][0]
    assert mounts[provider["options"]["path"]] == "monitoring/grafana/dashboards"
    assert set(DASHBOARDS) == {"fleet", "deployment", "benchmarks"}
    for name, dashboard in DASHBOARDS.items():
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] == datasource["uid"], f"{name}: {panel['title']}"
        assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


@pytest.mark.django_db
def test_dashboards_query_only_metrics_the_panel_or_vllm_expose(viewer_client, fleet_for_exposition):
    exposed = set()
    response = viewer_client.get("/metrics")
    for family in text_string_to_metric_families(response.content.decode()):
        exposed |= {family.name} | {s.name for s in family.samples}
    rules = yaml.safe_load((MONITORING / "dcgm-rules.yml").read_text())["groups"][0]["rules"]
    for rule in rules:
        assert metric_names(rule["expr"]) <= exposed, rule["record"]
    known = exposed | VLLM_NAMES
    used = set()
    for name, dashboard in DASHBOARDS.items():
        for expr in _exprs(dashboard):
            names = metric_names(expr)
            assert names, f"{name}: no metric in {expr!r}"
            assert names <= known, f"{name}: {sorted(names - known)} in {expr!r} is neither the panel's nor vLLM's"
            used |= names
    # The deployment dashboard is about the engine: it reads vLLM's own figures.
    assert {"vllm:generation_tokens_total", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"} <= used


def test_the_name_check_sees_names_and_nothing_else():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{deployment="$d"}'
            '[$__rate_interval]))) / on (node) group_left () panel_x_total offset 5m')
    assert metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket", "panel_x_total"}
    assert metric_names('label_values(panel_gpu_memory_total_bytes{node=~"$node"}, gpu)') == {"panel_gpu_memory_total_bytes"}


@pytest.fixture
def fleet_for_exposition(unique):
    """One of everything, so every family of the exposition has a sample."""
    from deployments.services import nodes
    from tests.factories import BenchmarkPointFactory, BenchmarkRunFactory, DeploymentFactory, GpuFactory

    deployment = DeploymentFactory(status="ready")
    GpuFactory(node=deployment.node, index=0)
    sample = _sample(1_700_000_000.0, [(40, 90)])
    sample["gpus"][0].update(ecc_sbe_volatile=0, ecc_dbe_volatile=0)
    nodes.node_sample_record(deployment.node.pk, sample, {})
    BenchmarkPointFactory(run=BenchmarkRunFactory(deployment=deployment, single_stream_tok_s=70.0),
                          tpot_ms={"median": 9.0}, itl_ms={"median": 9.0})


@pytest.mark.django_db
def test_node_and_deployment_pages_link_to_their_dashboards_only_when_grafana_is_set(viewer_client, settings):
    from deployments.templatetags.grafana import DASHBOARDS as LINKED
    from tests.factories import DeploymentFactory

    deployment = DeploymentFactory(name="tiny-a", status="ready")
    pages = {"node": f"/nodes/{deployment.node.pk}/", "deployment": f"/deployments/{deployment.pk}/"}
    names = {"node": deployment.node.name, "deployment": deployment.name}
    settings.GRAFANA_URL = ""
    for page in pages.values():
        assert b"grafana-link" not in viewer_client.get(page).content
    settings.GRAFANA_URL = "https://grafana.example.com"
    by_uid = {d["uid"]: d for d in DASHBOARDS.values()}
    for kind, page in pages.items():
        uid, variable = LINKED[kind]
        html = viewer_client.get(page).content.decode()
        assert f'href="https://grafana.example.com/d/{uid}/?var-{variable}={names[kind]}"' in html
        # The link opens a dashboard that exists and has that variable.
        assert variable in {v["name"] for v in by_uid[uid]["templating"]["list"]}
