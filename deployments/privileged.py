"""Which engine options need the admin role: everything not on the operator list (flagpolicy).

Operators may set only the reviewed options of flagpolicy.OPERATOR_FLAGS / OPERATOR_ENV (what changes
performance). Anything else, an unknown name too, needs an admin: --trust-remote-code runs the model
repo's Python on the host; other flags load plugins, classes, templates or configs, or connect out; some
variables switch on dev endpoints, load logging configs or point caches and downloads elsewhere. An
operator may deploy and restart what an admin set; setting or changing such an option takes an admin.
File paths must lie inside the model's folder, for everyone.
"""
import posixpath

from deployments import flagpolicy
from deployments.host import serveargv, store
from plumbing.errors import ServiceError

# Set by the panel for every engine, refused from everyone: the engine's own key is the panel's, and
# callers' keys live on the node's gateway.
PANEL_FLAGS = {"api-key": serveargv.KEY_REFUSED}
PANEL_ENV = {"VLLM_API_KEY": serveargv.KEY_REFUSED}

# Why some of the options operators may not set need an admin (shown to the user; an option not named
# here is refused as "not on the operator list").
FLAGS = {
    "trust-remote-code": "runs Python code from the model repository",
    "tool-parser-plugin": "loads a Python file", "reasoning-parser-plugin": "loads a Python file",
    "middleware": "loads a Python class", "logits-processors": "loads Python classes",
    "logits-processor-pattern": "lets requests name Python classes to load",
    "worker-cls": "loads a Python class", "worker-extension-cls": "loads a Python class",
    "scheduler-cls": "loads a Python class", "io-processor-plugin": "loads a plugin",
    "distributed-executor-backend": "ray starts a Ray cluster, a dotted path loads a Python class",
    "data-parallel-backend": "ray starts a Ray cluster", "kv-transfer-config": "loads classes and connects out",
    "kv-events-config": "connects out", "otlp-traces-endpoint": "sends traces out", "tool-server": "connects to tool servers",
    "log-config-file": "loads a logging config (a dictConfig can run any Python)",
    "compilation-config": "may name a Python function to compile with", "chat-template": "reads a file",
    "config": "reads a file", "generation-config": "reads a folder", "tokenizer": "reads another folder",
    "download-dir": "writes a folder", "allowed-local-media-path": "serves a folder",
    "lora-modules": "reads other folders", "ssl-keyfile": "reads a file", "ssl-certfile": "reads a file",
    "ssl-ca-certs": "reads a file", "load-format": "may load from URLs or run a loader",
    "model-loader-extra-config": "configures the loader", "hf-overrides": "overrides the model's code choice",
    "speculative-config": "loads another model",
}
# Flags whose value may be a file or folder path: such a path must lie inside the model's folder.
FILE_FLAGS = {"chat-template", "config", "generation-config", "tokenizer", "tool-parser-plugin", "reasoning-parser-plugin",
              "ssl-keyfile", "ssl-certfile", "ssl-ca-certs", "allowed-local-media-path", "download-dir"}
ENV = {
    "VLLM_SERVER_DEV_MODE": "opens development endpoints", "VLLM_LOGGING_CONFIG_PATH": "loads a logging config",
    "VLLM_PLUGINS": "loads plugins", "VLLM_ALLOW_INSECURE_SERIALIZATION": "unpickles data",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "loads adapters at run time", "VLLM_USE_MODELSCOPE": "downloads from elsewhere",
    "HF_HUB_OFFLINE": "lets the engine go online", "TRANSFORMERS_OFFLINE": "lets the engine go online",
    "VLLM_NO_USAGE_STATS": "reports usage home", "HF_TRUST_REMOTE_CODE": "runs code from the model repository",
    "VLLM_CACHE_ROOT": "compiled code is loaded from there", "VLLM_CONFIG_ROOT": "configs are read from there",
    "TRITON_HOME": "compiled kernels are loaded from there", "HF_HOME": "moves the Hugging Face cache and token",
}
# Reasons by prefix, for names not in ENV.
ENV_PREFIXES = {"RAY_": "configures Ray", "TRITON_": "configures Triton's compiler and its cache",
                "TORCHINDUCTOR_": "configures torch.compile and its cache", "HF_": "configures Hugging Face downloads",
                "NCCL_": "loads a plugin, reads or writes a file or names an address"}
NOT_LISTED = "not on the operator list (deployments/flagpolicy.py)"


def uses(engine_args: dict, env: dict) -> dict[str, str]:
    """The options in canonical `engine_args` and `env` an operator may not set: {"--flag" or "NAME": why}."""
    found = {}
    for name, value in engine_args.items():
        why = flagpolicy.operator_flag(name, value)
        if why is not None:
            found[f"--{name}"] = why or FLAGS.get(name) or NOT_LISTED
    for name in env:
        if not flagpolicy.operator_env(name):
            found[name] = ENV.get(name) or next((why for prefix, why in ENV_PREFIXES.items() if name.startswith(prefix)),
                                                NOT_LISTED)
    return found


def canonical(engine_args: dict, env: dict) -> tuple[dict, dict]:
    """Both in canonical form (flagpolicy), or a 400 naming the option: every service takes its input so."""
    try:
        return flagpolicy.canonical_flags(engine_args), flagpolicy.canonical_env(env)
    except flagpolicy.OptionError as exc:
        raise ServiceError(str(exc), field="extra_flags") from exc


def _changed(new: dict, old: dict) -> dict:
    """What `new` (canonical) sets that `old` (as stored) did not: a name stored in another spelling counts as
    new, so only what an admin stored canonically is an operator's to keep."""
    return {k: v for k, v in new.items() if k not in old or old[k] != v}


def check(*, engine_args: dict, env: dict, model_dir: str, admin: bool, old_args=None, old_env=None) -> None:
    """Refuse what the panel sets itself (PANEL_FLAGS, PANEL_ENV) from anyone, privileged options set or changed
    by a non-admin, and file paths outside the model's folder."""
    refused(engine_args, env)
    if not admin:
        new = uses(_changed(engine_args, old_args or {}), _changed(env, old_env or {}))
        if new:
            listed = "; ".join(f"{name} ({why})" for name, why in new.items())
            raise ServiceError(f"Needs the admin role: {listed}. Operators may set the options on the operator "
                               "list; ask an admin for the others.", field="extra_flags", code="forbidden")
    for name in FILE_FLAGS & set(engine_args):
        value = engine_args[name]
        if isinstance(value, str) and not _inside(value, model_dir):
            raise ServiceError(f"--{name}: a file path must lie inside the model's folder ({model_dir}).",
                               field="extra_flags")


def refused(engine_args: dict, env: dict) -> None:
    """A 400 naming the first option (canonical names) only the panel may set, e.g. --api-key."""
    for name, why in PANEL_FLAGS.items():
        if engine_args.get(name) not in (None, False):
            raise ServiceError(f"{why}.", field="extra_flags")
    for name, why in PANEL_ENV.items():
        if name in env:
            raise ServiceError(f"{why}.", field="env")


def _inside(value: str, folder: str) -> bool:
    """True for a relative path (the engine starts in the model's folder) or an absolute one under `folder`;
    inline text (a template) is not a path."""
    if "{" in value or "\n" in value:
        return True
    if value.startswith("~") or ".." in value.split("/"):
        return False
    if not value.startswith("/"):
        return True
    path, root = posixpath.normpath(value), posixpath.normpath(folder)
    return path == root or path.startswith(root + "/")


def model_dir(model, node) -> str:
    """Where the model's files are (or will be) on the node: the folder the engine starts in."""
    copy = model.copies.filter(node=node).exclude(path="").first()
    if copy:
        return copy.path
    return model.local_path or str(store.model_dir(node.model_store, model.repo_id, model.revision))
