"""Control plane: a deployment's engine flags and environment as the user typed them: parsed, checked, presets.

Nothing here runs anything: flags become an argv list for `vllm serve` (no shell). Names are put in
their one canonical form and every value is checked (flagpolicy) before anything else looks at them.
"""
import shlex

from deployments import flagpolicy
from deployments.flagpolicy import ENV_NAME, OptionError
from deployments.host import enginemodules, serveargv

# Environment variables a deployment may set: the engine's, the communication libraries' and CUDA's.
ENV_PREFIXES = ("NCCL_", "VLLM_", "CUDA_", "TORCH_", "PYTORCH_", "HF_", "OMP_", "NVIDIA_", "TRITON_",
                "UCX_", "GLOO_", "MKL_", "TOKENIZERS_", "SAFETENSORS_", "NVSHMEM_", "TORCHINDUCTOR_", "RAY_")
# Set by the panel itself; a user value would break what the panel relies on.
ENV_RESERVED = {"CUDA_VISIBLE_DEVICES": "set by the panel from the chosen GPUs",
                "RAY_ADDRESS": "set by the panel (the Ray head it starts for --distributed-executor-backend ray)",
                "VLLM_API_KEY": serveargv.KEY_BY_PANEL}

# Form presets: typical layouts, prefilled into the deploy form (the user can change anything).
PRESETS = {
    "single-gpu": {
        "label": "One GPU", "tp": 1, "gpu_memory_utilization": 0.9, "flags": {}, "env": {},
    },
    "tp8-moe-int4": {
        "label": "8 GPUs, tensor parallel — Kimi-K2.5 INT4 / DeepSeek-V3 class",
        "tp": 8, "gpu_memory_utilization": 0.92, "max_model_len": 131072, "max_num_seqs": 256,
        "trust_remote_code": True, "reasoning_parser": "kimi_k2", "tool_call_parser": "kimi_k2",
        "flags": {"enable-auto-tool-choice": True}, "env": {"NCCL_P2P_LEVEL": "NVL"},
    },
    "tp4-ep-fp8": {
        "label": "4 GPUs, expert parallel — MiniMax-M2.5 FP8 class",
        "tp": 4, "expert_parallel": True, "gpu_memory_utilization": 0.9, "max_num_seqs": 512,
        "trust_remote_code": True, "reasoning_parser": "minimax_m2", "tool_call_parser": "minimax_m2",
        "flags": {"enable-auto-tool-choice": True}, "env": {},
    },
    "nccl-ring-ll": {
        "label": "8 GPUs, NCCL Ring + LL (compare with the default)",
        "tp": 8, "gpu_memory_utilization": 0.92, "flags": {}, "env": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"},
    },
    "cpu-test": {
        "label": "CPU test engine (no GPU)", "tp": 1, "max_model_len": 2048, "max_num_seqs": 64,
        "flags": {"enforce-eager": True}, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
    },
}


# Engine flags the deploy form has a field of its own for (the rest go to its extra flags), and the field: the one map
# the form's initial values (deploydefaults.flags_initial) and the presets read; the form's clean() sets the same.
FLAG_FIELDS = {"tensor-parallel-size": "tp", "pipeline-parallel-size": "pp", "data-parallel-size": "dp",
               "enable-expert-parallel": "expert_parallel", "max-model-len": "max_model_len",
               "gpu-memory-utilization": "gpu_memory_utilization", "max-num-seqs": "max_num_seqs",
               "max-num-queued-reqs": "max_num_queued_reqs", "max-num-queued-tokens": "max_num_queued_tokens",
               "kv-cache-dtype": "kv_cache_dtype", "attention-backend": "attention_backend",
               "reasoning-parser": "reasoning_parser", "tool-call-parser": "tool_call_parser",
               "trust-remote-code": "trust_remote_code", "served-model-name": "served_model_name"}
FIELD_FLAGS = {field: flag for flag, field in FLAG_FIELDS.items()}


def node_preset(has_gpus: bool) -> str:
    """The preset that works on a node as it is: one GPU where there are GPUs, the CPU engine's otherwise."""
    return "single-gpu" if has_gpus else "cpu-test"


def with_preset(key: str, engine_args: dict, env: dict) -> tuple[dict, dict]:
    """The preset's flags and environment under the caller's own (a value the caller gave wins)."""
    preset = PRESETS[key]
    flags = {FIELD_FLAGS[k]: v for k, v in preset.items() if k in FIELD_FLAGS}
    flags.update(preset["flags"])
    return {**flags, **engine_args}, {**preset["env"], **env}


class ArgsError(ValueError):
    """What the user typed is not acceptable; `errors` maps a field to its message."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


def _words(text: str) -> list[tuple[str, str | bool]]:
    """'--a 1 --b --c=2 -O3 -tp 2' -> [("--a", "1"), ("--b", True), ("--c", "2"), ("-O", "3"), ("-tp", "2")]."""
    try:
        words = shlex.split(text or "")
    except ValueError as exc:
        raise ArgsError({"extra_flags": f"cannot read the flags: {exc}"}) from exc
    pairs, i = [], 0
    while i < len(words):
        word = words[i]
        if not word.startswith("-") or word == "-":
            raise ArgsError({"extra_flags": f"expected a --flag, got {word[:40]!r}"})
        if word.startswith("-O") and len(word) > 2:  # vLLM's -O3 / -O=3: the optimization level
            name, value = "-O", word[2:].removeprefix("=")
        else:
            name, sep, value = word.partition("=")
            # `--a=` takes no value from the next word: `--a= --b` is --a "" and --b, never --a "--b"
            if not sep and i + 1 < len(words) and not words[i + 1].startswith("-"):
                value, i = words[i + 1], i + 1
        pairs.append((name, value if value else True))
        i += 1
    return pairs


def parse_flags(text: str) -> dict:
    """'--max-num-batched-tokens 8192 --enable-prefix-caching' -> {"max-num-batched-tokens": "8192", ...}, in
    canonical form (flagpolicy: `--Max_Num_Seqs=8` and `-tp 2` read as max-num-seqs and tensor-parallel-size).
    A value that begins with '-' is refused (`--enforce-eager=--trust-remote-code` too).

    shlex only splits words here (quotes group a value); nothing is ever run through a shell.
    """
    flags = {}
    for name, value in _words(text):
        try:
            key = flagpolicy.flag_name(name)
        except OptionError as exc:
            raise ArgsError({"extra_flags": str(exc)}) from exc
        if key in flags:
            raise ArgsError({"extra_flags": f"--{key} is given twice"})
        flags[key] = value
    try:
        return flagpolicy.canonical_flags(flags)
    except OptionError as exc:
        raise ArgsError({"extra_flags": str(exc)}) from exc


def parse_env(text: str) -> dict[str, str]:
    """'NCCL_PROTO=LL' lines -> {"NCCL_PROTO": "LL"}; blank lines and # comments are skipped."""
    env = {}
    for number, line in enumerate((text or "").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep:
            raise ArgsError({"env": f"line {number}: write NAME=VALUE"})
        try:
            key = flagpolicy.env_name(name)
        except OptionError as exc:
            raise ArgsError({"env": f"line {number}: {exc}"}) from exc
        if key in env:
            raise ArgsError({"env": f"line {number}: {key} is given twice"})
        env[key] = value.strip()
    return env


def check_env(env: dict) -> dict[str, str]:
    """Errors for names outside the allowed prefixes, reserved names, names not in canonical (upper-case)
    form and values that are not plain."""
    errors = []
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            errors.append(f"{str(name)[:40]!r} is not a variable name (A-Z, 0-9, _)")
        elif name in ENV_RESERVED:
            errors.append(f"{name} is {ENV_RESERVED[name]}")
        elif not name.startswith(ENV_PREFIXES):
            errors.append(f"{name} is not allowed: names must start with {', '.join(p for p in ENV_PREFIXES[:6])}, …")
        elif not isinstance(value, str):
            errors.append(f"{name}: a value is text")
        elif problem := flagpolicy.value_problem(value):
            errors.append(f"{name}: {problem}")
    return {"env": "; ".join(errors)} if errors else {}


def check_flags(flags: dict, known: set[str] | None, modules: dict | None = None) -> dict[str, str]:
    """Errors for malformed, non-canonical or reserved flags (serveargv.RESERVED_FLAGS), bad values, (when the
    engine's list is known) unknown ones, and (when the node reported them: Node.engine_modules) flags whose package
    the engine's Python lacks."""
    errors = [f"--{name}: {problem}" for name, value in flags.items()
              if (problem := flagpolicy.value_problem(value))]
    errors += [message for name, message in serveargv.validate_args(flags, known or set()).items()
               if known or "unknown engine flag" not in message]
    errors += enginemodules.refusals(flags, enginemodules.recorded(modules))
    return {"extra_flags": "; ".join(dict.fromkeys(errors))} if errors else {}


def canonical(flags: dict, env: dict) -> tuple[dict, dict]:
    """Both in canonical form (flagpolicy), or ArgsError naming the field."""
    try:
        flags = flagpolicy.canonical_flags(flags)
    except OptionError as exc:
        raise ArgsError({"extra_flags": str(exc)}) from exc
    try:
        return flags, flagpolicy.canonical_env(env)
    except OptionError as exc:
        raise ArgsError({"env": str(exc)}) from exc


def argv_words(flags: dict) -> list[str]:
    """{"enforce-eager": True, "max-num-seqs": 64} -> ["--enforce-eager", "--max-num-seqs", "64"] (for display)."""
    words = []
    for name, value in flags.items():
        if value is False or value is None:
            continue
        words.append(f"--{name}")
        if value is not True:
            words.append(shlex.quote(str(value)))
    return words
