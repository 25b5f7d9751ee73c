"""The environment an engine process starts with: an allowlist, never the agent's whole environment.

Why: with --trust-remote-code the engine runs code from the model repo, and whatever is in its
environment is that code's to read. The agent's environment holds the panel's settings and
secrets (DATABASE_URL, REDIS_URL, SECRET_KEY, HF_TOKEN, PANEL_ADMIN_PASSWORD, ...): none of it may
pass. The engine gets what a process needs to run (PATH, HOME, locale, the driver's library path,
cache folders) from the host, plus exactly what the panel sets for it (`own`: the deployment's
variables, the GPUs, offline Hugging Face, the panel's ownership markers). Plain Python, no Django.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

# Inherited from the host when present: what running a program needs, and where caches go.
INHERITED = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CUDA_VERSION",
    # The NVIDIA container runtime reads these to expose GPUs and driver libraries to a container.
    "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA",
    "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "HF_HOME", "HF_HUB_CACHE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
})
INHERITED_PREFIXES = ("LC_",)
# Set for every engine: models load from the local folder, and nothing is reported home.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# A media URL from an allowed domain may not redirect the engine elsewhere (169.254.169.254, a host on the GPU
# node's network): the gateway checks the URL a caller sent, not where it leads. An admin may set it back.
NO_MEDIA_REDIRECTS = {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}


def inherited(environ: Mapping[str, str] | None = None, extra: frozenset[str] = frozenset()) -> dict[str, str]:
    """The part of `environ` (default: this process's) an engine may see; `extra` names more (host admin's choice)."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items()
            if name in INHERITED or name in extra or name.startswith(INHERITED_PREFIXES)}


def passthrough() -> frozenset[str]:
    """Names the host's admin lets through besides INHERITED: ENGINE_ENV_PASSTHROUGH="A,B" on the agent."""
    return frozenset(n.strip() for n in os.environ.get("ENGINE_ENV_PASSTHROUGH", "").split(",") if n.strip())


def engine_environ(own: Mapping[str, str], environ: Mapping[str, str] | None = None,
                   user_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The full environment for an engine: allowed host variables, the engine user's home and caches
    (`user_env`, osuser.EngineUser.environ(): the agent's are not its to write), the offline
    defaults, then `own`."""
    return {**inherited(environ, passthrough()), **(user_env or {}), **OFFLINE, **{str(k): str(v) for k, v in own.items()}}


# A single-node engine's processes talk to each other over loopback only (nothing of it listens beyond
# 127.0.0.1). Left alone, gloo (the CPU engine's collectives, vLLM's CPU process groups on GPUs) listens on the
# address the host name resolves to, and NCCL's bootstrap on the first network interface. Set last for a
# single-node engine; a multi-node one's ranks must reach each other over the cluster network.
LOOPBACK_ONLY = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}

# Flags whose value is a secret, and the variable vLLM reads it from instead (vllm/envs.py: VLLM_API_KEY;
# the flag wins when both are set). A command line is readable by every local user (`ps`,
# /proc/<pid>/cmdline); an environment only by the process's own user and root.
SECRET_FLAGS = {"--api-key": "VLLM_API_KEY"}


class SecretFlagError(ValueError):
    """A secret flag that cannot move into the environment (vLLM reads one API key from it)."""


def secret_argv(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """`argv` without its secret flags (`--api-key K`, `--api-key=K`) and the variables that carry them."""
    out: list[str] = []
    env: dict[str, str] = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        flag, eq, inline = word.partition("=")
        if flag in SECRET_FLAGS and i > 0:
            if eq:
                values, i = [inline], i + 1
            else:
                j = i + 1
                while j < len(argv) and not argv[j].startswith("-"):
                    j += 1
                values, i = argv[i + 1:j], j
            if len(values) != 1 or SECRET_FLAGS[flag] in env:
                raise SecretFlagError(f"{flag} takes one value here: it reaches the engine as {SECRET_FLAGS[flag]}, "
                                      "never on its command line, and vLLM reads one key from there")
            env[SECRET_FLAGS[flag]] = values[0]
            continue
        out.append(word)
        i += 1
    return out, env


def deployment_env(env: Mapping[str, str], gpu_indices: Iterable[int] = ()) -> dict[str, str]:
    """What the panel sets for one deployment's engine: the `own` of engine_environ at launch, and the
    Environment= of its systemd unit (installed or downloaded). The offline defaults, then the
    deployment's variables, then GPU numbering as NVML's and CUDA_VISIBLE_DEVICES for its GPUs. No media
    redirects unless the deployment's variables say otherwise (an admin's: the name is not on the operator list)."""
    own = {**OFFLINE, **NO_MEDIA_REDIRECTS, **{str(k): str(v) for k, v in env.items()},
           "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # NVML's indices; CUDA's default order may differ
    if gpu_indices:
        own["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_indices))
    return own
