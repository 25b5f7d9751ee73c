"""monitoring/alerts.yml: promtool accepts every expression and its unit tests (alerts-test.yml) pass, every
alert has a firing case there, the rules read only series the panel or vLLM export, the unit tests notice a
moved threshold; monitoring/alertmanager.yml passes amtool; compose loads both in the monitoring profile.
promtool comes with Debian's prometheus package (./panel test installs it), amtool with prometheus-alertmanager."""
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families


from tests.test_monitoring import VLLM_NAMES, fleet_for_exposition, metric_names  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
RULES = yaml.safe_load((MONITORING / "alerts.yml").read_text())
ALERTS = [r for g in RULES["groups"] for r in g["rules"]]
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.tools  # ./panel test installs it; the fast tier leaves these out


def _promtool(*args, cwd=MONITORING) -> subprocess.CompletedProcess:
    assert PROMTOOL, "promtool is missing (Debian's prometheus package)"
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_accepts_every_rule():
    checked = _promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in checked.stdout


@needs_promtool
def test_the_rules_unit_tests_pass():
    tested = _promtool("test", "rules", "alerts-test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_firing_case_and_says_how_bad_it_is():
    tests = yaml.safe_load((MONITORING / "alerts-test.yml").read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]}
    names = [r["alert"] for r in ALERTS]
    assert len(names) == len(set(names)) and set(names) == fired
    wanted = {"DeploymentDown", "DeploymentRestartLoop", "DeploymentLoadSlowerThanHistory", "KvCacheNearFull",
              "WaitingQueueGrowing", "TtftSloBreached", "ErrorRateSloBreached", "GpuMemoryNearFull", "GpuTemperatureHigh",
              "GpuEccUncorrectedErrors", "ModelStoreDiskLow", "NodeOffline"}
    assert wanted <= set(names)
    for rule in ALERTS:
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


@pytest.mark.django_db
def test_the_rules_read_only_series_the_panel_or_vllm_export(viewer_client, fleet_for_exposition):
    exposed = set(VLLM_NAMES) | {"up"}
    for family in text_string_to_metric_families(viewer_client.get("/metrics").content.decode()):
        exposed |= {family.name} | {s.name for s in family.samples}
    for rule in ALERTS:
        read = metric_names(rule["expr"]) - {"time"}
        assert read and read <= exposed, (rule["alert"], read - exposed)


@needs_promtool
def test_the_unit_tests_notice_a_moved_threshold(tmp_path):
    shutil.copy(MONITORING / "alerts-test.yml", tmp_path)
    text = (MONITORING / "alerts.yml").read_text()
    assert text.count("vllm:kv_cache_usage_perc) > 0.95") == 1
    (tmp_path / "alerts.yml").write_text(text.replace("vllm:kv_cache_usage_perc) > 0.95", "vllm:kv_cache_usage_perc) > 0.98"))
    tested = _promtool("test", "rules", "alerts-test.yml", cwd=tmp_path)
    assert tested.returncode != 0 and "KvCacheNearFull" in tested.stdout + tested.stderr


@pytest.mark.tools
def test_amtool_accepts_the_alertmanager_config():
    checked = subprocess.run(["amtool", "check-config", str(MONITORING / "alertmanager.yml")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = yaml.safe_load((MONITORING / "alertmanager.yml").read_text())
    assert {"alertname", "deployment", "node"} <= set(config["route"]["group_by"])


def test_compose_loads_the_rules_and_runs_an_alertmanager_in_the_monitoring_profile():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert "./monitoring/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose["prometheus"]["volumes"]
    alertmanager = compose["alertmanager"]
    assert alertmanager["profiles"] == ["monitoring"]
    assert "./monitoring/alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro" in alertmanager["volumes"]
    prometheus = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert "/etc/prometheus/alerts.yml" in prometheus["rule_files"]
    assert prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]
