"""Control plane (and the host's argv builder): engine flags and variables in one canonical form, and the
reviewed list of those an operator may set.

Every way in (the deploy form and its text box, the API, study variants, the CLI through the API) puts
names through `canonical_flags` / `canonical_env` before anything checks them, so the admin gate, the
GPU count, the placement and `serveargv.build_argv` all see one spelling: flag names lower case,
dashed, without leading dashes (`--Tensor_Parallel_Size` and `-tp` are `tensor-parallel-size`), variable
names upper case. A value is a bool, a number or plain text; text that begins with `-` (the next flag
in vLLM's argv) or holds a newline or other control character is refused, wherever it comes from.

An operator may set only what is on OPERATOR_FLAGS / OPERATOR_ENV: options that change how fast the
engine runs, never what code it runs, what it loads or where it connects. Each entry says why it is
harmless. Everything else (an unknown name too) takes the admin role until it is added here with a
reason. Plain Python, no Django.

vLLM's own defaults for the flags the panel reasons about (the fit, the KV calibration, the start-failure advisor,
the forms) are written once here too.
"""
import json
import re

FLAG_NAME = re.compile(r"^[a-z][a-z0-9-]{0,63}$")
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]{0,127}$")
MAX_VALUE = 4096
# vLLM's short spellings (`vllm serve --help=all`), as their long names. `-O3` is --optimization-level 3.
ALIASES = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "dp": "data-parallel-size",
           "dcp": "decode-context-parallel-size", "pcp": "prefill-context-parallel-size",
           "dpn": "data-parallel-rank", "dpr": "data-parallel-start-rank", "dpl": "data-parallel-size-local",
           "dpa": "data-parallel-address", "dpp": "data-parallel-rpc-port", "dpb": "data-parallel-backend",
           "ep": "enable-expert-parallel", "q": "quantization", "o": "optimization-level", "n": "nnodes",
           "r": "node-rank", "cc": "compilation-config", "ac": "attention-config",
           "asc": "api-server-count", "dpe": "data-parallel-external-lb", "dph": "data-parallel-hybrid-lb",
           "dpm": "data-parallel-multi-port-external-lb", "dc": "diffusion-config", "sc": "speculative-config"}
# Read as numbers by the panel itself (GPU count, placement): a whole number from 1 up, nothing else.
COUNT_FLAGS = ("tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size")
# Nothing runs through a shell, but shell syntax in a value is a mistake or an attack: refused.
# JSON values (--compilation-config '{...}') are checked as JSON.
SHELL_SYNTAX = re.compile(r"[`;|&<>\\]|\$\(|\$\{")


class OptionError(ValueError):
    """A flag or variable name or value is not acceptable; the message names it."""


# --- canonical form ---------------------------------------------------------------------------------

def flag_name(name) -> str:
    """'--Tensor_Parallel_Size', 'tensor_parallel_size', '-tp' -> 'tensor-parallel-size'."""
    text = str(name).strip()
    if "=" in text:
        raise OptionError(f"{text[:40]!r} is not a flag name (write the value apart from the name)")
    bare = text.lstrip("-").lower().replace("_", "-")
    bare = ALIASES.get(bare, bare)
    if not FLAG_NAME.match(bare):
        raise OptionError(f"{text[:40]!r} is not a flag name (letters, digits and '-')")
    return bare


def env_name(name) -> str:
    """'vllm_cpu_kvcache_space' -> 'VLLM_CPU_KVCACHE_SPACE'."""
    text = str(name).strip().upper()
    if not ENV_NAME.match(text):
        raise OptionError(f"{str(name)[:40]!r} is not a variable name (A-Z, 0-9, _)")
    return text


def plain_text(value: str) -> bool:
    """Printable (no newline), at most MAX_VALUE characters, no shell syntax unless it is valid JSON."""
    if len(value) > MAX_VALUE or not value.isprintable():
        return False
    if value[:1] in "{[":
        try:
            json.loads(value)
            return True
        except ValueError:
            return False
    return not SHELL_SYNTAX.search(value)


def value_problem(value, argv_only: bool = False) -> str | None:
    """Why a flag or variable value is refused, or None. `argv_only`: only what would break the argv itself (a
    value read as the next flag, a second line), build_argv's last check; shell syntax is harmless there."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return "a value may not begin with '-' (it would read as the next flag)" if value < 0 else None
    if not isinstance(value, str):
        return "a value is text, a number or true/false"
    if value.startswith("-"):
        return "a value may not begin with '-' (it would read as the next flag)"
    if argv_only:
        return None if value.isprintable() else "a value is one line of printable text"
    if not plain_text(value):
        if value[:1] in "{[" and value.isprintable():  # JSON whose quotes the extra-flags line took away
            return ("the value looks like JSON but is not valid JSON: on the extra-flags line put it in single "
                    "quotes, e.g. --hf-overrides '{\"rope_scaling\": null}', so its double quotes are kept")
        return (f"the value must be plain printable text on one line (no shell syntax), "
                f"at most {MAX_VALUE} characters")
    return None


def _count(name: str, value):
    if value is None or value is False:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"--{name}: a whole number from 1 up")
    return value


def canonical_flags(flags: dict) -> dict:
    """The flags under their canonical names, values checked; a name given twice is refused.
    False and None stay (they mean "leave the engine's default", and a study variant removes a flag so)."""
    out = {}
    for raw, value in (flags or {}).items():
        name = flag_name(raw)
        if name in out:
            raise OptionError(f"--{name} is given twice ({raw!r} is the same flag)")
        if problem := value_problem(value):
            raise OptionError(f"--{name}: {problem}")
        out[name] = _count(name, value) if name in COUNT_FLAGS else value
    return out


def canonical_env(env: dict) -> dict:
    """The variables under their canonical (upper-case) names, values checked; a name given twice is refused."""
    out = {}
    for raw, value in (env or {}).items():
        name = env_name(raw)
        if name in out:
            raise OptionError(f"{name} is given twice ({raw!r} is the same variable)")
        if value is not None and not isinstance(value, str):
            raise OptionError(f"{name}: a value is text")
        if problem := value_problem(value):
            raise OptionError(f"{name}: {problem}")
        out[name] = value
    return out


def is_canonical(name) -> bool:
    """True for a name exactly as canonical_flags writes it (build_argv's last check)."""
    return isinstance(name, str) and bool(FLAG_NAME.match(name)) and ALIASES.get(name, name) == name


def count(flags: dict, name: str) -> int:
    """A parallel size from canonical flags (1 when unset): the GPU count and placement read it here."""
    value = flags.get(name)
    return 1 if value in (None, False) else _count(name, value)


# --- what an operator may set ----------------------------------------------------------------------

# Flag -> why it is harmless: each changes how the engine runs the model it was given, not what code runs,
# what files or other models it loads, or where it connects.
OPERATOR_FLAGS = {
    # parallelism: how the one model is spread over the GPUs it was given
    "tensor-parallel-size": "splits each layer over N GPUs", "pipeline-parallel-size": "splits the layers over N GPUs",
    "data-parallel-size": "runs N replicas", "enable-expert-parallel": "spreads MoE experts over the GPUs",
    "decode-context-parallel-size": "splits the context over GPUs in decode",
    "prefill-context-parallel-size": "splits the context over GPUs in prefill",
    "enable-eplb": "rebalances experts between GPUs", "expert-placement-strategy": "a built-in expert layout, by name",
    "all2all-backend": "a built-in all-to-all kernel, by name",
    "disable-custom-all-reduce": "uses NCCL's all-reduce instead of vLLM's kernel",
    "enable-dbo": "overlaps two micro-batches", "dbo-decode-token-threshold": "a batch-size threshold",
    "dbo-prefill-token-threshold": "a batch-size threshold",
    "distributed-executor-backend": "the built-in mp or uni executor (OPERATOR_VALUES); ray and class paths are an admin's",
    "data-parallel-backend": "vLLM's own mp data-parallel launch (OPERATOR_VALUES); ray is an admin's",
    # memory and KV cache
    "gpu-memory-utilization": "the share of GPU memory the engine takes", "swap-space": "CPU memory for swapped KV blocks",
    "cpu-offload-gb": "CPU memory for offloaded weights", "kv-cache-dtype": "the KV cache's number format",
    "block-size": "the KV cache's block size", "kv-cache-memory-bytes": "the KV cache's size",
    "num-gpu-blocks-override": "the KV cache's block count", "enable-prefix-caching": "reuses cached prefixes",
    "prefix-caching-hash-algo": "a built-in hash for prefix blocks, by name",
    "disable-hybrid-kv-cache-manager": "one KV cache layout for all layers",
    "calculate-kv-scales": "computes fp8 KV scales at run time", "mamba-cache-dtype": "a state cache's number format",
    "mamba-ssm-cache-dtype": "a state cache's number format", "mamba-block-size": "a state cache's block size",
    # scheduling and batching
    "max-num-seqs": "how many sequences run at once", "max-num-batched-tokens": "tokens per batch",
    "max-num-queued-reqs": "requests admitted at once; beyond, the engine refuses (the gateway answers 429)",
    "max-num-queued-tokens": "prompt tokens waiting in prefill; beyond, the engine refuses (the gateway answers 429)",
    "enable-chunked-prefill": "splits long prompts over batches", "max-num-partial-prefills": "a scheduling limit",
    "max-long-partial-prefills": "a scheduling limit", "long-prefill-token-threshold": "a scheduling threshold",
    "scheduling-policy": "fcfs or priority order", "async-scheduling": "schedules the next batch while one runs",
    "stream-interval": "how often streamed tokens are sent", "disable-cascade-attn": "turns off an attention optimisation",
    "cudagraph-capture-sizes": "batch sizes captured as CUDA graphs",
    "max-cudagraph-capture-size": "the largest batch captured as a CUDA graph",
    "api-server-count": "how many API server processes serve requests", "disable-log-stats": "stops periodic stats logging",
    "max-num-scheduled-tokens": "tokens the scheduler issues per step", "max-num-active-seqs": "a scheduling limit",
    "performance-mode": "balanced, interactivity or throughput, by name",
    "kv-offloading-size": "CPU memory for offloaded KV blocks", "numa-bind": "pins workers to their GPU's NUMA node",
    "enable-flashinfer-autotune": "kernel autotuning at warm-up",
    # number formats, by name (vLLM's built-in methods)
    "dtype": "the weights' number format", "quantization": "a built-in quantization method, by name",
    # context, naming, kernels
    "max-model-len": "the longest context served", "served-model-name": "the name clients ask for",
    "attention-backend": "a built-in attention kernel, by name",
    "mm-encoder-attn-backend": "a built-in attention kernel for the vision encoder, by name",
    "moe-backend": "a built-in MoE kernel, by name", "linear-backend": "a built-in GEMM kernel, by name",
    "optimization-level": "torch.compile effort (-O0 … -O3)", "enforce-eager": "runs without CUDA graphs or compilation",
    "tool-call-parser": "one of vLLM's built-in tool-call parsers (TOOL_PARSERS); a plugin file is an admin's",
    "reasoning-parser": "one of vLLM's built-in reasoning parsers (REASONING_PARSERS); a plugin file is an admin's",
    "enable-auto-tool-choice": "lets the model call tools it is offered",
    # loading the model's own weights
    "safetensors-load-strategy": "how the model folder's weights are read (lazy, eager, prefetch), by name",
    "max-parallel-loading-workers": "how many workers load weights at once",
    # (--api-key is nobody's: the panel gives every engine a key of its own; callers' keys are the gateway's)
}
# vLLM's built-in parsers (vllm/tool_parsers, vllm/reasoning), reviewed: each parses model output text.
TOOL_PARSERS = frozenset({
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "openai",
    "phi4_mini_json", "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss",
    "step3", "step3p5", "xlam"})
REASONING_PARSERS = frozenset({
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41", "ernie45",
    "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2", "minimax_m2_append_think",
    "minimax_m3", "mistral", "muse_glimmer", "nemotron_v3", "olmo3", "openai_gptoss", "plamo3", "poolside_v1", "qwen3",
    "seed_oss", "step3", "step3p5"})
# Flags an operator may set only to these values; another value is an admin's.
OPERATOR_VALUES = {
    "distributed-executor-backend": (frozenset({"mp", "uni"}),
                                     "starts a Ray cluster (ray) or loads a Python class: an admin's choice"),
    "data-parallel-backend": (frozenset({"mp"}), "starts a Ray cluster: an admin's choice"),
    "tool-call-parser": (TOOL_PARSERS, "not one of vLLM's built-in tool-call parsers reviewed here"),
    "reasoning-parser": (REASONING_PARSERS, "not one of vLLM's built-in reasoning parsers reviewed here"),
}

# Variable -> why it is harmless.
OPERATOR_ENV = {
    "VLLM_ATTENTION_BACKEND": "a built-in attention kernel, by name (older engines)",
    "VLLM_CPU_KVCACHE_SPACE": "the CPU engine's KV cache size", "VLLM_CPU_OMP_THREADS_BIND": "which cores the CPU engine uses",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "cores the CPU engine leaves free", "VLLM_CPU_ATTN_SPLIT_KV": "a CPU attention kernel choice",
    "VLLM_USE_FLASHINFER_SAMPLER": "a sampler kernel choice", "VLLM_FLOAT32_MATMUL_PRECISION": "float32 matmul precision",
    "VLLM_WORKER_MULTIPROC_METHOD": "fork or spawn for workers", "VLLM_ENABLE_V1_MULTIPROCESSING": "the engine core in its own process",
    "VLLM_MARLIN_USE_ATOMIC_ADD": "a kernel choice", "VLLM_USE_DEEP_GEMM": "a kernel choice", "VLLM_MOE_USE_DEEP_GEMM": "a kernel choice",
    "VLLM_USE_DEEP_GEMM_E8M0": "a kernel choice", "VLLM_DEEP_GEMM_WARMUP": "kernel warm-up at start",
    "VLLM_USE_FUSED_MOE_GROUPED_TOPK": "a kernel choice", "VLLM_USE_TRITON_AWQ": "a kernel choice",
    "VLLM_MLA_DISABLE": "turns off MLA attention", "VLLM_ALLREDUCE_USE_SYMM_MEM": "an all-reduce choice",
    "VLLM_USE_NCCL_SYMM_MEM": "an all-reduce choice", "VLLM_DISABLE_PYNCCL": "an all-reduce choice",
    "VLLM_SKIP_P2P_CHECK": "skips the GPU peer-to-peer probe", "VLLM_PP_LAYER_PARTITION": "how layers split over pipeline stages",
    "VLLM_KV_CACHE_LAYOUT": "the KV cache's memory layout", "VLLM_V1_OUTPUT_PROC_CHUNK_SIZE": "output batching",
    "VLLM_MQ_MAX_CHUNK_BYTES_MB": "message-queue chunk size", "VLLM_MSGPACK_ZERO_COPY_THRESHOLD": "a copy threshold",
    "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE": "a kernel workspace size", "VLLM_DEEPEP_BUFFER_SIZE_MB": "a communication buffer size",
    "VLLM_DBO_COMM_SMS": "SMs kept for communication", "VLLM_ENABLE_INDUCTOR_MAX_AUTOTUNE": "compile-time autotuning effort",
    "VLLM_DISABLE_COMPILE_CACHE": "compiles afresh instead of reading the cache", "VLLM_ROCM_USE_AITER": "a ROCm kernel choice",
    "OMP_NUM_THREADS": "CPU threads per process", "CUDA_DEVICE_MAX_CONNECTIONS": "CUDA work queues per GPU",
    "PYTORCH_CUDA_ALLOC_CONF": "PyTorch's GPU allocator settings", "TOKENIZERS_PARALLELISM": "tokenizer threads",
}
# NCCL_* tunes collective communication (algorithm, protocol, channels, buffers, which NIC): harmless,
# except names that load a plugin, read or write a file, or name an address to listen on or connect to.
OPERATOR_ENV_PREFIX = "NCCL_"
NCCL_NOT_OPERATORS = re.compile(r"PLUGIN|FILE|PATH|_DIR|ADDR|HOST|PORT|URL|URI|ENDPOINT|COMM_ID|CONF")


def operator_flag(name: str, value) -> str | None:
    """None when an operator may set canonical flag `name` to `value`; else why it takes an admin
    ("" when the list has no reason beyond "not reviewed")."""
    if value is None or value is False:
        return None  # leaving the engine's default is never privileged
    if name not in OPERATOR_FLAGS:
        base = name.removeprefix("no-")  # --no-enable-prefix-caching turns a listed option off
        return None if base != name and base in OPERATOR_FLAGS and base not in OPERATOR_VALUES else ""
    if name in OPERATOR_VALUES:
        allowed, why = OPERATOR_VALUES[name]
        if str(value) not in allowed:
            return why
    return None


def operator_env(name: str) -> bool:
    """True when an operator may set canonical variable `name`."""
    if name in OPERATOR_ENV:
        return True
    return name.startswith(OPERATOR_ENV_PREFIX) and not NCCL_NOT_OPERATORS.search(name)


# vLLM's defaults (its EngineArgs) where a flag is not given.
GPU_MEMORY_UTILIZATION = 0.9
KV_CACHE_DTYPE = "auto"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16")  # what the forms and API offer


def gpu_memory_utilization(flags: dict) -> float:
    """The share of each GPU's memory the engine takes: its --gpu-memory-utilization, else vLLM's default."""
    return float(flags.get("gpu-memory-utilization") or GPU_MEMORY_UTILIZATION)


def kv_cache_dtype(flags: dict) -> str:
    """The KV cache's dtype as asked: its --kv-cache-dtype, else vLLM's default ("auto": the model's own)."""
    return str(flags.get("kv-cache-dtype") or KV_CACHE_DTYPE)
