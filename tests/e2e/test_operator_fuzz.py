"""An operator fuzz: every flag the real CPU engine lists in `vllm serve --help=all`, each spelled
dashed, underscored and upper-cased and smuggled as `--enforce-eager=--<flag>`, sent as an operator through
the API, the deploy form's text box and a study variant. What is accepted is launched through the agent's
own launch step (plan._launch, processes.launch) and the launched process's /proc/<pid>/cmdline is read back:
it holds no flag off the operator list. A stand-in `vllm` (a shell script that answers --help=all with the
real engine's flags and otherwise sleeps) keeps the many launches cheap; one real CPU-engine launch shows
the same of the real engine.
"""
import json
import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from benchmarks import studies
from benchmarks.models import Study
from deployments import flagpolicy
from deployments.host import processes, serveargv
from deployments.models import Deployment
from deployments.node import plan
from deployments.services import deploys
from deployments.node.steps import PlanFailed
from tests.conftest import VLLM, free_port, in_thread, wait_until
from tests.e2e.conftest import start_cpu_node
from tests.factories import DeploymentFactory, ModelCopyFactory, NodeFactory, UserFactory

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
# What the argv of an operator's engine may hold: the operator list, a listed option turned off, and what
# the panel itself sets (its address, and the route's media domains: deployments/gateway/media.py).
ALLOWED = (set(flagpolicy.OPERATOR_FLAGS) | {f"no-{n}" for n in flagpolicy.OPERATOR_FLAGS}
           | {"host", "port", "allowed-media-domains"})
# A value an operator would plausibly give; 1 for the rest (a bool flag given 1 is the engine's problem).
VALUES = {"distributed-executor-backend": "mp", "tool-call-parser": "hermes", "reasoning-parser": "qwen3",
          "kv-cache-dtype": "fp8", "dtype": "bfloat16", "served-model-name": "tiny"}
WORKLOAD = {"levels": [1], "max_tokens": 16, "requests_per_user": 1, "min_requests": 1}


def _cmdline(pid: int) -> list[str]:
    """The process's argv as the kernel has it. Empty for a moment while `setpriv` (the engine user's launch)
    execs the engine in place: read again then."""
    def read():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [w.decode() for w in f.read().split(b"\0") if w]
    return wait_until(read, timeout=5, interval=0.01, message=f"PID {pid}'s command line")


def _offending(argv: list[str]) -> list[str]:
    """Words of an engine's argv (after `serve MODEL`) that are a flag off the operator list, or a listed flag with
    a value only an admin may give."""
    words = argv[argv.index("serve") + 2:]
    bad = [w for w in words if w.startswith("-") and (not w.startswith("--") or w[2:] not in ALLOWED)]
    for name, (allowed, _) in flagpolicy.OPERATOR_VALUES.items():
        if f"--{name}" in words:
            i = words.index(f"--{name}")
            if i + 1 >= len(words) or words[i + 1] not in allowed:
                bad.append(f"--{name} {words[i + 1] if i + 1 < len(words) else ''}")
    return bad


@pytest.fixture
def shared():
    """A folder the engine user can enter (pytest's tmp_path is root's alone): the stand-in and the model store."""
    folder = Path(tempfile.mkdtemp(prefix="operator-fuzz-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def stand_in(shared, settings):
    """A `vllm` that answers --help=all with the real engine's flags and otherwise sleeps until signalled."""
    flags = sorted(serveargv.engine_flags(str(VLLM)))  # the real engine's (once a test session)
    help_file = shared / "help.txt"
    help_file.write_text("options:\n" + "".join(f"  {f}\n" for f in flags))
    script = shared / "vllm"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1" = --version ] && {{ echo 0.0.0+standin; exit 0; }}
        [ "$2" = --help=all ] && {{ cat {help_file}; exit 0; }}
        trap 'exit 0' TERM
        sleep 60 & wait
        """))
    for path in (help_file, script):
        path.chmod(0o755)
    settings.VLLM_BIN = str(script)
    return flags


@pytest.fixture
def world(db, shared, stand_in, sent_tasks):
    folder = shared / "store" / "org" / "m"
    folder.mkdir(parents=True)
    node = NodeFactory(name="fuzz-cpu", engine_flags=stand_in, model_store=str(shared / "store"))
    copy = ModelCopyFactory(node=node, path=str(folder))
    return node, copy.model, stand_in


class Fuzz:
    """Sends each case, launches what is accepted and checks its argv; counts what it tried."""

    def __init__(self, node, model, operator):
        self.node, self.model, self.operator, self.port = node, model, operator, free_port()
        self.api, self.form = APIClient(), Client()
        self.api.force_authenticate(operator)
        self.form.force_login(operator)
        self.tried, self.accepted, self.launched, self.refused_at_launch, self.same = 0, 0, 0, 0, 0
        self.seen = set()
        self.base = DeploymentFactory(node=node, model=model, name="fuzz-base", port=self.port, status="ready",
                                      engine_args={"enforce-eager": True}, env={})
        self.dirty, self.base_status = True, "ready"

    def launch_and_check(self, d: Deployment, case: str) -> None:
        """Launch what was stored and read its argv back; a setting stored exactly as an earlier case's was (the
        same flag in another spelling) builds the same argv, and is launched once."""
        d = Deployment.objects.select_related("node", "model").get(pk=d.pk)
        key = json.dumps([d.engine_args, d.env], sort_keys=True)
        if key in self.seen:
            self.same += 1
            return
        self.seen.add(key)
        try:
            plan._launch(d, str(self.model.copies.get().path))
        except (processes.EngineError, PlanFailed):  # the node refused it (`--api-key` with no key): nothing ran
            self.refused_at_launch += 1
            return
        try:
            argv = _cmdline(d.pid)
            assert "serve" in argv, (case, argv)
            assert not _offending(argv), f"{case}: an operator got {_offending(argv)} into {argv}"
        finally:
            processes.stop(d.pgid, term_timeout_s=2, kill_timeout_s=2)
        self.launched += 1

    def begin(self, base_status: str) -> None:
        """One more case, on a clean slate: no deployment but the base one, no study, the base in `base_status` with
        its own settings. A refused case leaves nothing (each asserts it), so the slate is made again only after an
        accepted one, or for a route that needs the base in another state. The test's transaction never commits, so
        every accepted case's on-commit callbacks (the mocked enqueues) would pile up, and Django filters that list
        at each savepoint rollback: O(cases²). Drop what earlier cases left."""
        self.tried += 1
        connection.run_on_commit.clear()
        if self.dirty or self.base_status != base_status:
            Study.objects.all().delete()
            Deployment.objects.filter(node=self.node).exclude(pk=self.base.pk).delete()
            Deployment.objects.filter(pk=self.base.pk).update(status=base_status, engine_args={"enforce-eager": True},
                                                              env={})
            self.dirty, self.base_status = False, base_status

    def by_api(self, case: str, engine_args: dict) -> None:
        self.begin("stopped")
        body = {"model": self.model.pk, "node": self.node.name, "preset": "none", "port": self.port,
                "name": "fuzz", "engine_args": engine_args}
        response = self.api.post("/api/deployments/", body, format="json")
        if response.status_code == 202:
            self.accepted, self.dirty = self.accepted + 1, True
            self.launch_and_check(Deployment.objects.get(name="fuzz"), case)
        else:
            assert response.status_code in (400, 403), (case, response.status_code, response.content[:300])
            assert not Deployment.objects.filter(name="fuzz").exists(), case

    def by_form(self, case: str, text: str) -> None:
        self.begin("stopped")
        response = self.form.post(f"/models/{self.model.pk}/deploy/", {
            "node_id": self.node.pk, "name": "fuzz", "port": self.port, "tp": 1, "pp": 1, "dp": 1,
            "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto", "stall_seconds": 600, "extra_flags": text})
        if response.status_code == 302:
            self.accepted, self.dirty = self.accepted + 1, True
            self.launch_and_check(Deployment.objects.get(name="fuzz"), case)
        else:
            assert response.status_code in (400, 409), (case, response.status_code)
            assert not Deployment.objects.filter(name="fuzz").exists(), case

    def by_study(self, case: str, engine_args: dict) -> None:
        """A variant as the study's driver applies it: its settings through the redeploy a trial sends."""
        self.begin("ready")
        response = self.api.post("/api/studies/", {"deployment": self.base.pk, "workload": WORKLOAD, "repeats": 1,
                                                   "variants": [{"engine_args": engine_args}]}, format="json")
        if response.status_code == 202:
            self.accepted, self.dirty = self.accepted + 1, True
            study = Study.objects.get()
            args, env = studies.variant_settings(study, study.variants.get(position=1))
            Deployment.objects.filter(pk=self.base.pk).update(status="stopped")
            d = deploys.deployment_redeploy(Deployment.objects.get(pk=self.base.pk), engine_args=args, env=env,
                                            user=study.created_by)
            self.launch_and_check(d, case)
        else:
            assert response.status_code in (400, 403), (case, response.status_code, response.content[:300])
            assert not Study.objects.exists(), case


def _spellings(name: str) -> list[tuple[str, str]]:
    return [("dashed", name), ("underscored", name.replace("-", "_")), ("upper", name.replace("-", "_").upper())]


@pytest.mark.slow
@pytest.mark.sqlite_only
def test_an_operator_never_gets_a_flag_off_the_list_into_an_engines_argv(world):
    """Slow (~200 s here on SQLite, ~350 s on PostgreSQL; 585 s on a 2-core VM running three suites at once, hence
    the module's 1,200 s limit): ~4,900 cases (406 flags × 3 spellings and a smuggle
    × API, form and study) through the real API, form and services, 40-70 ms each, and each distinct accepted
    setting (~200) launched and read back. Its subject is the canonical form and the operator list, which no
    query touches, so it runs on SQLite only (CI's SQLite pass); the deploy and study services it goes
    through are tested on both databases elsewhere."""
    node, model, flags = world
    fuzz = Fuzz(node, model, UserFactory(role="operator"))
    names = sorted({f[2:] for f in flags if f.startswith("--")} - {"help"})
    assert {"trust-remote-code", "log-config-file", "tool-server", "tensor-parallel-size"} <= set(names)
    # One way in at a time: the API and the form need the base deployment stopped, a study needs it ready.
    for name in names:
        value = VALUES.get(name, 1)
        for how, spelled in _spellings(name):
            fuzz.by_api(f"api {how} {spelled}", {spelled: value})
            fuzz.by_form(f"form {how} --{spelled}", f"--{spelled}")
        fuzz.by_api(f"api --enforce-eager=--{name}", {"enforce-eager": f"--{name}"})
        fuzz.by_form(f"form --enforce-eager=--{name}", f"--enforce-eager=--{name}")
    for name in names:
        for how, spelled in _spellings(name):
            fuzz.by_study(f"study {how} {spelled}", {spelled: VALUES.get(name, 1)})
        fuzz.by_study(f"study --enforce-eager=--{name}", {"enforce-eager": f"--{name}"})
    print(f"\noperator fuzz: {len(names)} engine flags, {fuzz.tried} cases tried, {fuzz.accepted} accepted: "
          f"{fuzz.launched} engines launched and their /proc/<pid>/cmdline checked, {fuzz.same} stored as an earlier "
          f"case was (the same argv), {fuzz.refused_at_launch} refused by the node at launch")
    assert fuzz.launched + fuzz.same + fuzz.refused_at_launch == fuzz.accepted and fuzz.tried == 12 * len(names)
    assert fuzz.refused_at_launch < 10 < fuzz.launched
    # Every option on the list that the engine has went through the three ways in, in each spelling.
    listed = set(flagpolicy.OPERATOR_FLAGS) & set(names)
    assert fuzz.accepted >= len(listed) * 3


def test_the_real_engine_an_operator_deploys_runs_only_listed_flags(process_env, spawn, unique, tmp_path, tiny_model):
    """What the stand-in shows, of the real `vllm serve` a real node agent launched for an operator's spelled
    flags (read at launch: the engine need not finish loading)."""
    node, model, _ = start_cpu_node(process_env, spawn, unique, tmp_path, tiny_model)
    client = APIClient()
    client.force_authenticate(UserFactory(role="operator"))
    body = {"model": model.pk, "node": node.name, "port": free_port(), "env": {"vllm_cpu_kvcache_space": "1"}}
    for smuggled, status in (({"enforce-eager": "--trust-remote-code"}, 400), ({"Trust_Remote_Code": True}, 403),
                             ({"enforce-eager": True, "LOG_CONFIG_FILE": "logging.json"}, 403)):
        response = in_thread(client.post, "/api/deployments/", {**body, "engine_args": smuggled}, format="json")
        assert response.status_code == status, response.content
    response = in_thread(client.post, "/api/deployments/", {**body, "engine_args": {
        "ENFORCE_EAGER": True, "Max_Num_Seqs": 4, "--max_model_len": 512, "no_enable_prefix_caching": True}},
        format="json")
    assert response.status_code == 202, response.content
    d = Deployment.objects.get(pk=response.json()["id"])
    try:
        pid = wait_until(lambda: Deployment.objects.get(pk=d.pk).pid, timeout=180, message="the engine's launch")
        argv = _cmdline(pid)
        assert "serve" in argv and not _offending(argv), argv
        words = argv[argv.index("serve") + 2:]
        for flag in ("--enforce-eager", "--max-num-seqs", "--max-model-len", "--no-enable-prefix-caching"):
            assert flag in words, argv
        assert "--trust-remote-code" not in words
        print(f"\nthe real engine's argv: {' '.join(words)}")
    finally:
        pgid = Deployment.objects.get(pk=d.pk).pgid
        if pgid:
            processes.stop(pgid, term_timeout_s=5, kill_timeout_s=5)
