"""Engine options that run code, load files or change where the engine connects need the admin role.

--trust-remote-code runs the model repo's Python on the host; other flags load plugins, classes,
templates or configs from a path; some variables switch on dev endpoints, load logging configs or
point downloads elsewhere. An operator may deploy and restart what an admin set; setting or
changing one of these takes an admin. File paths must lie inside the model's folder, for everyone.
"""
import posixpath
import re

from deployments.host import store
from controlpanel.errors import ServiceError

# Flag -> why it is privileged (shown to the user).
FLAGS = {
    "trust-remote-code": "runs Python code from the model repository",
    "tool-parser-plugin": "loads a Python file", "reasoning-parser-plugin": "loads a Python file",
    "middleware": "loads a Python class", "logits-processors": "loads Python classes",
    "worker-cls": "loads a Python class", "worker-extension-cls": "loads a Python class",
    "distributed-executor-backend": "may load a Python class", "kv-transfer-config": "loads classes and connects out",
    "kv-events-config": "connects out", "otlp-traces-endpoint": "sends traces out",
    "chat-template": "reads a file", "config": "reads a file", "generation-config": "reads a folder",
    "tokenizer": "reads another folder", "download-dir": "writes a folder", "allowed-local-media-path": "serves a folder",
    "lora-modules": "reads other folders", "ssl-keyfile": "reads a file", "ssl-certfile": "reads a file",
    "ssl-ca-certs": "reads a file", "load-format": "may load from URLs or run a loader", "model-loader-extra-config":
    "configures the loader", "hf-overrides": "overrides the model's code choice", "speculative-config": "loads another model",
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
}
# Names that point the engine at a file, folder, plugin or address.
ENV_PATTERN = re.compile(r"(_PATH|_DIR|_FILE|_ENDPOINT|_URL|_URI|_HOST|_ADDR|_ADDRESS|_PLUGINS?|_IP|_PORT|_CONFIG)$")


# vLLM's own executors: naming one loads no code of the user's (a dotted class path would).
BUILTIN_EXECUTORS = frozenset({"mp", "ray", "uni", "external_launcher"})


def uses(engine_args: dict, env: dict) -> dict[str, str]:
    """The privileged options in a deployment's settings: {"--flag" or "NAME": why}."""
    found = {f"--{name}": FLAGS[name] for name, value in engine_args.items() if name in FLAGS and value not in (None, False)
             and not (name == "distributed-executor-backend" and value in BUILTIN_EXECUTORS)}
    for name in env:
        why = ENV.get(name) or ("points the engine at a file, folder or address" if ENV_PATTERN.search(name) else None)
        if why:
            found[name] = why
    return found


def _changed(new: dict, old: dict) -> dict:
    return {k: v for k, v in new.items() if k not in old or old[k] != v}


def check(*, engine_args: dict, env: dict, model_dir: str, admin: bool, old_args=None, old_env=None) -> None:
    """Refuse privileged options set or changed by a non-admin, and file paths outside the model's folder."""
    if not admin:
        new = uses(_changed(engine_args, old_args or {}), _changed(env, old_env or {}))
        if new:
            listed = "; ".join(f"{name} ({why})" for name, why in new.items())
            raise ServiceError(f"Needs the admin role: {listed}.", field="extra_flags", code="forbidden")
    for name in FILE_FLAGS & set(engine_args):
        value = engine_args[name]
        if isinstance(value, str) and not _inside(value, model_dir):
            raise ServiceError(f"--{name}: a file path must lie inside the model's folder ({model_dir}).",
                               field="extra_flags")


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
