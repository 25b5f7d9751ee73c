"""One canonical spelling of engine flags and variables, and the operator list (deployments/flagpolicy.py).

Each known way around the operator list is tried here as an operator, through the API, the deploy form and a study
variant: the flag dashed, underscored, upper-cased, as `--enforce-eager=--trust-remote-code`, with a newline
or a leading dash. The real engine's whole flag list is tried in tests/e2e/test_operator_fuzz.py.
"""

import pytest
from django.utils import timezone

from benchmarks.models import Study
from deployments import flagpolicy, privileged, userflags
from deployments.models import Deployment
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory, UserFactory
from tests.helpers import api_client

pytestmark = pytest.mark.django_db
FLAGS = ["--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size", "--trust-remote-code",
         "--chat-template", "--log-config-file", "--logits-processor-pattern", "--tool-server", "--enforce-eager",
         "--max-num-seqs", "--gpu-memory-utilization", "--distributed-executor-backend", "--enable-prefix-caching",
         "--no-enable-prefix-caching", "--tool-call-parser", "--enable-auto-tool-choice", "--reasoning-parser",
         "--seed", "--served-model-name", "--max-model-len", "--optimization-level", "--port", "--host", "--model"]
MODEL_DIR = "/models/org/m"


@pytest.fixture
def world(sent_tasks):
    node = NodeFactory(name="gpu-01", engine_flags=FLAGS)
    for i in range(8):
        GpuFactory(node=node, index=i)
    copy = ModelCopyFactory(node=node, path=MODEL_DIR)
    return node, copy.model


@pytest.fixture
def admin():
    return UserFactory(role="admin")


def _deploy(user, model, engine_args=None, env=None, **kw):
    body = {"model": model.pk, "node": "gpu-01", "gpus": [0], "preset": "none",
            "engine_args": {"tensor-parallel-size": 1, **(engine_args or {})}, "env": env or {}, **kw}
    return api_client(user).post("/api/deployments/", body, format="json")


# --- the canonical form -----------------------------------------------------------------------------

@pytest.mark.parametrize("raw", ["tensor-parallel-size", "tensor_parallel_size", "--tensor-parallel-size",
                                 "TENSOR_PARALLEL_SIZE", "--Tensor_Parallel-Size", " tensor-parallel-size ", "-tp", "tp"])
def test_every_spelling_of_a_flag_is_one_canonical_name(raw):
    assert flagpolicy.flag_name(raw) == "tensor-parallel-size"


@pytest.mark.parametrize("raw", ["max-num-seqs=8", "bad flag", "", "--", "x.y", "8bit", "a;b"])
def test_what_is_no_flag_name_is_refused(raw):
    with pytest.raises(flagpolicy.OptionError):
        flagpolicy.flag_name(raw)


def test_variable_names_are_upper_case_and_a_name_given_twice_is_refused():
    assert flagpolicy.canonical_env({"vllm_cache_root": "/x", "Nccl_Proto": "LL"}) == {
        "VLLM_CACHE_ROOT": "/x", "NCCL_PROTO": "LL"}
    with pytest.raises(flagpolicy.OptionError, match="given twice"):
        flagpolicy.canonical_flags({"max-num-seqs": 8, "max_num_seqs": 16})
    with pytest.raises(flagpolicy.OptionError, match="given twice"):
        flagpolicy.canonical_env({"NCCL_PROTO": "LL", "nccl_proto": "Simple"})


@pytest.mark.parametrize("value", ["--trust-remote-code", "-x", -1, "a\nb", "a\rb", "x\x00", "$(id)", "a;b", 3.5j])
def test_a_value_that_begins_with_a_dash_holds_a_newline_or_is_not_plain_is_refused(value):
    with pytest.raises(flagpolicy.OptionError):
        flagpolicy.canonical_flags({"enforce-eager": value})


def test_parallel_sizes_are_whole_numbers_read_from_the_canonical_name():
    assert flagpolicy.canonical_flags({"tensor_parallel_size": "4"}) == {"tensor-parallel-size": 4}
    for bad in ("four", 0, True, 1.5):
        with pytest.raises(flagpolicy.OptionError, match="whole number"):
            flagpolicy.canonical_flags({"TENSOR_PARALLEL_SIZE": bad})


@pytest.mark.parametrize("text, flags", [
    ("--Max_Num_Seqs=8 --ENFORCE-EAGER", {"max-num-seqs": "8", "enforce-eager": True}),
    ("-O3 -tp 2", {"optimization-level": "3", "tensor-parallel-size": 2}),
    ("--enforce-eager= --trust-remote-code", {"enforce-eager": True, "trust-remote-code": True}),
])
def test_the_text_box_reads_flags_in_canonical_form(text, flags):
    assert userflags.parse_flags(text) == flags


@pytest.mark.parametrize("text", ["--enforce-eager=--trust-remote-code", "--a=--b", "--max-num-seqs=-1",
                                  "--served-model-name 'a\nb'", "--max-num-seqs 8 --max_num_seqs 9", "trust-remote-code"])
def test_the_text_box_refuses_a_dash_value_a_newline_a_repeat_or_a_bare_word(text):
    with pytest.raises(userflags.ArgsError):
        userflags.parse_flags(text)


# --- the operator list ------------------------------------------------------------------------------

def test_every_listed_option_says_why_it_is_harmless_and_none_runs_or_loads_code():
    for name, why in {**flagpolicy.OPERATOR_FLAGS, **flagpolicy.OPERATOR_ENV}.items():
        assert why.strip(), name
    for name in privileged.FLAGS:
        assert name not in flagpolicy.OPERATOR_FLAGS or name in flagpolicy.OPERATOR_VALUES, name
    for name in privileged.ENV:
        assert not flagpolicy.operator_env(name), name


@pytest.mark.parametrize("args, env, named", [
    ({"distributed-executor-backend": "ray"}, {}, "--distributed-executor-backend"),
    ({"distributed-executor-backend": "my.Executor"}, {}, "--distributed-executor-backend"),
    ({"tool-call-parser": "my_plugin"}, {}, "--tool-call-parser"),
    ({"seed": 1}, {}, "--seed"),  # harmless, but not reviewed: an admin's until it is listed
    ({}, {"NCCL_NET_PLUGIN": "x"}, "NCCL_NET_PLUGIN"), ({}, {"NCCL_TOPO_FILE": "/x"}, "NCCL_TOPO_FILE"),
    ({}, {"NCCL_COMM_ID": "1.2.3.4:5"}, "NCCL_COMM_ID"), ({}, {"RAY_DEDUP_LOGS": "0"}, "RAY_DEDUP_LOGS"),
])
def test_what_is_not_on_the_list_is_an_admins(args, env, named):
    assert named in privileged.uses(args, env)


def test_what_is_on_the_list_is_an_operators():
    args = {"tensor-parallel-size": 2, "distributed-executor-backend": "mp", "tool-call-parser": "hermes",
            "reasoning-parser": "qwen3", "no-enable-prefix-caching": True, "trust-remote-code": False, "seed": None,
            "max-num-queued-reqs": 256, "max-num-queued-tokens": 65536}  # admission: the engine's own queue caps
    assert privileged.uses(args, {"NCCL_PROTO": "LL", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "4"}) == {}


# --- the confirmed holes, as an operator through the API ---------------------------------------------

@pytest.mark.parametrize("args, env, named", [
    ({"trust_remote_code": True}, {}, "--trust-remote-code"),
    ({"--TRUST-REMOTE-CODE": True}, {}, "--trust-remote-code"),
    ({"Trust_Remote_Code": "true"}, {}, "--trust-remote-code"),
    ({"chat_template": "/etc/shadow"}, {}, "--chat-template"),
    ({"log-config-file": "logging.json"}, {}, "--log-config-file"),
    ({"logits_processor_pattern": ".*"}, {}, "--logits-processor-pattern"),
    ({"tool-server": "demo"}, {}, "--tool-server"),
    ({"distributed_executor_backend": "ray"}, {}, "--distributed-executor-backend"),
    ({}, {"VLLM_CACHE_ROOT": "/tmp/x"}, "VLLM_CACHE_ROOT"), ({}, {"vllm_cache_root": "/tmp/x"}, "VLLM_CACHE_ROOT"),
    ({}, {"TRITON_HOME": "/tmp/x"}, "TRITON_HOME"), ({}, {"HF_HOME": "/tmp/x"}, "HF_HOME"),
    ({}, {"RAY_ADDRESS_FILE": "x"}, "RAY_ADDRESS_FILE"), ({}, {"ray_runtime_env_hook": "x.y"}, "RAY_RUNTIME_ENV_HOOK"),
])
def test_an_operator_gets_403_naming_the_option_and_an_admin_may(world, operator, admin, args, env, named):
    node, model = world
    refused = _deploy(operator, model, args, env)
    assert refused.status_code == 403, refused.content
    message = refused.json()["error"]["message"]
    assert "Needs the admin role" in message and named in message
    assert not Deployment.objects.exists()
    if named == "--chat-template":  # a path outside the model's folder stays refused, for everyone
        assert _deploy(admin, model, args, env).status_code == 400
        return
    accepted = _deploy(admin, model, args, env)
    assert accepted.status_code == 202, accepted.content
    stored = Deployment.objects.get(pk=accepted.json()["id"])
    assert named.lstrip("-") in stored.engine_args or named in stored.env  # stored in canonical form


@pytest.mark.parametrize("args, env", [
    ({"enforce-eager": "--trust-remote-code"}, {}), ({"served-model-name": "a\nb"}, {}), ({"max-num-seqs": -1}, {}),
    ({"max-num-seqs=8": True}, {}), ({"max_num_seqs": 8, "max-num-seqs": 9}, {}), ({}, {"NCCL_PROTO": "-LL"}),
    ({}, {"NCCL_PROTO": "LL\nVLLM_PLUGINS=x"}),
])
def test_a_dash_value_a_newline_or_a_repeat_is_a_400_for_everyone(world, operator, admin, args, env):
    node, model = world
    for user in (operator, admin):
        response = _deploy(user, model, args, env)
        assert response.status_code == 400, response.content
    assert not Deployment.objects.exists()


@pytest.mark.parametrize("name", ["tensor_parallel_size", "TENSOR-PARALLEL-SIZE", "--tensor_parallel_size", "-tp"])
def test_an_underscored_parallel_size_cannot_dodge_the_gpu_count(world, operator, name):
    node, model = world
    body = {"model": model.pk, "node": "gpu-01", "gpus": [0], "preset": "none", "engine_args": {name: 4}, "env": {}}
    response = api_client(operator).post("/api/deployments/", body, format="json")
    assert response.status_code == 400 and "needs 4 GPUs; 1 chosen" in response.json()["error"]["message"]


def test_what_an_operator_deploys_is_stored_and_launched_in_canonical_form(world, operator):
    node, model = world
    body = {"model": model.pk, "node": "gpu-01", "gpus": [0, 1], "preset": "none", "env": {"nccl_proto": "LL"},
            "engine_args": {"TP": "2", "Max_Num_Seqs": 8, "--enable_prefix_caching": True}}
    response = api_client(operator).post("/api/deployments/", body, format="json")
    assert response.status_code == 202, response.content
    d = Deployment.objects.get(pk=response.json()["id"])
    assert {k: v for k, v in d.engine_args.items() if k != "served-model-name"} == {
        "tensor-parallel-size": 2, "max-num-seqs": 8, "enable-prefix-caching": True}
    assert d.env == {"NCCL_PROTO": "LL"}


def test_an_operator_may_restart_what_an_admin_set_but_not_a_row_stored_in_another_spelling(world, operator, admin):
    node, model = world
    d = DeploymentFactory(node=node, model=model, port=8001, status="stopped", created_by=admin,
                          engine_args={"tensor-parallel-size": 1, "trust-remote-code": True}, env={"HF_HOME": "/h"})
    d.gpus.set(node.gpus.filter(index=0))
    assert api_client(operator).post(f"/api/deployments/{d.pk}/restart/", {}, format="json").status_code == 202
    # Stored before names were canonical: nothing proves an admin set it, so the operator may not keep it.
    old = DeploymentFactory(node=node, model=model, port=8002, status="stopped", engine_args={"trust_remote_code": True})
    old.gpus.set(node.gpus.filter(index=1))
    refused = api_client(operator).post(f"/api/deployments/{old.pk}/restart/", {}, format="json")
    assert refused.status_code == 403 and "--trust-remote-code" in refused.json()["error"]["message"]
    assert api_client(admin).post(f"/api/deployments/{old.pk}/restart/", {}, format="json").status_code == 202
    assert Deployment.objects.get(pk=old.pk).engine_args == {"trust-remote-code": True}


def test_an_operator_deploying_a_preset_with_remote_code_is_told_which_option_needs_an_admin(world, operator, admin):
    node, model = world
    body = {"model": model.pk, "node": "gpu-01", "gpus": list(range(8)), "preset": "tp8-moe-int4", "engine_args": {}}
    refused = api_client(operator).post("/api/deployments/", body, format="json")
    assert refused.status_code == 403
    message = refused.json()["error"]["message"]
    assert "--trust-remote-code (runs Python code from the model repository)" in message
    assert "--reasoning-parser" not in message and "--tool-call-parser" not in message  # built-in names
    assert api_client(admin).post("/api/deployments/", body, format="json").status_code == 202


# --- the Ray executor: an admin's choice ----------------------------------------------------------

def test_the_ray_executor_is_403_for_an_operator_and_accepted_for_an_admin(world, operator, admin):
    node, model = world
    ray = {"distributed-executor-backend": "ray"}
    refused = _deploy(operator, model, ray)
    assert refused.status_code == 403
    assert "--distributed-executor-backend (starts a Ray cluster" in refused.json()["error"]["message"]
    for gpu, executor in ((1, "mp"), (2, "uni")):
        assert _deploy(operator, model, {"distributed-executor-backend": executor}, gpus=[gpu]).status_code == 202
    accepted = _deploy(admin, model, ray, name="ray-one")
    assert accepted.status_code == 202, accepted.content
    assert Deployment.objects.get(name="ray-one").master_port  # the panel's one-node Ray head


# --- the deploy form's text box ----------------------------------------------------------------------

def _form(client, model, node, **fields):
    data = {"node_id": node.pk, "gpus": ["0"], "port": 8000, "tp": 1, "pp": 1, "dp": 1, "gpu_memory_utilization": 0.9,
            "kv_cache_dtype": "auto", "stall_seconds": 600, **fields}
    return client.post(f"/models/{model.pk}/deploy/", data)


@pytest.mark.parametrize("fields, status, says", [
    ({"extra_flags": "--enforce-eager=--trust-remote-code"}, 400, "may not begin with"),
    ({"extra_flags": "--trust_remote_code"}, 409, "Needs the admin role: --trust-remote-code"),
    ({"extra_flags": "--TRUST-REMOTE-CODE"}, 409, "Needs the admin role: --trust-remote-code"),
    ({"extra_flags": "--log-config-file logging.json"}, 409, "--log-config-file (loads a logging config"),
    ({"extra_flags": "--tensor_parallel_size 4"}, 400, "set by the form above"),
    ({"extra_flags": "--pipeline_parallel_size 4"}, 409, "needs 4 GPUs"),
    ({"extra_flags": "--distributed-executor-backend ray"}, 409, "--distributed-executor-backend (starts a Ray"),
    ({"env": "hf_home=/tmp/h"}, 409, "Needs the admin role: HF_HOME"),
    ({"env": "NCCL_PROTO=-LL"}, 400, "may not begin with"),
])
def test_the_form_refuses_each_hole_to_an_operator(world, operator_client, fields, status, says):
    node, model = world
    response = _form(operator_client, model, node, **fields)
    assert response.status_code == status and says in response.content.decode(), response.content.decode()[-3000:]
    assert not Deployment.objects.exists()


def test_the_form_shows_the_operator_list_and_an_admin_may_pick_ray(world, client, admin):
    node, model = world
    client.force_login(admin)
    page = client.get(f"/models/{model.pk}/deploy/?node={node.pk}").content.decode()
    assert "The operator list" in page and "<code>--max-num-seqs</code>" in page and "<code>NCCL_*</code>" in page
    response = _form(client, model, node, extra_flags="--distributed-executor-backend ray")
    assert response.status_code == 302, response.content.decode()[-2000:]
    assert Deployment.objects.get().engine_args["distributed-executor-backend"] == "ray"


# --- study variants -----------------------------------------------------------------------------------

@pytest.fixture
def ready(world):
    node, model = world
    d = DeploymentFactory(node=node, model=model, status="ready", engine_args={"tensor-parallel-size": 1},
                          env={}, ready_at=timezone.now())
    d.gpus.set(node.gpus.filter(index=0))
    return d


WORKLOAD = {"levels": [1], "max_tokens": 16, "requests_per_user": 1, "min_requests": 1}


@pytest.mark.parametrize("body, status, says", [
    ({"variants": [{"engine_args": {"trust_remote_code": True}}]}, 403, "--trust-remote-code"),
    ({"variants": [{"engine_args": {"TRUST-REMOTE-CODE": True}}]}, 403, "--trust-remote-code"),
    ({"variants": [{"engine_args": {"enforce-eager": "--trust-remote-code"}}]}, 400, "may not begin with"),
    ({"variants": [{"engine_args": {"distributed_executor_backend": "ray"}}]}, 403, "--distributed-executor-backend"),
    ({"variants": [{"env": {"vllm_cache_root": "/tmp/x"}}]}, 403, "VLLM_CACHE_ROOT"),
    ({"dimensions": {"trust_remote_code": [True]}}, 403, "--trust-remote-code"),
    ({"dimensions": {"--log_config_file": ["logging.json"]}}, 403, "--log-config-file"),
    ({"dimensions": {"max-num-seqs": ["8\n--trust-remote-code"]}}, 400, "one line"),
])
def test_a_study_variant_goes_through_the_same_check(ready, operator, body, status, says):
    response = api_client(operator).post("/api/studies/", {"deployment": ready.pk, "workload": WORKLOAD, **body}, format="json")
    assert response.status_code == status and says in response.json()["error"]["message"], response.content
    assert not Study.objects.exists()


def test_a_study_variant_is_stored_in_canonical_form(ready, operator):
    response = api_client(operator).post("/api/studies/", {"deployment": ready.pk, "workload": WORKLOAD, "repeats": 1,
                                                     "dimensions": {"Max_Num_Seqs": [8, 16]}}, format="json")
    assert response.status_code == 202, response.content
    study = Study.objects.get()
    assert [v.engine_args for v in study.variants.order_by("position")] == [{}, {"max-num-seqs": 8}, {"max-num-seqs": 16}]
