"""What the fake vLLM (the `vllm` beside this file) answers as vLLM 0.32's own server does, held to the real one by
tests/conformance: its argparse refusal of a flag it does not know, the --api-key (VLLM_API_KEY) check on every /v1
path, /tokenize, /v1/models, the /metrics families, and the watchdog that serves 503 on /health once the engine core
died and then ends the server. Standard library only (the fake runs under whatever python3 the agent's PATH has)."""
import hmac
import os
import sys
import threading
import time
from pathlib import Path

UNAUTHORIZED = {"error": "Unauthorized"}  # vLLM's AuthenticationMiddleware answers 401 with this
CORE_TITLE = b"VLLM::EngineCore"  # setproctitle in vLLM's EngineCore; the kernel's comm keeps 15 characters
DEFAULT_MAX_MODEL_LEN = 4096  # the fake has no config.json to read it from
# After its core died vLLM's API server answered 503 on /health for ~1.1 s, then closed the port (its watchdog ends
# uvicorn, VLLM_KEEP_ALIVE_ON_ENGINE_DEATH unset) and exited, measured on the CPU build (tests/conformance).
DEAD_SERVE_S = 1.0


def _known_flags() -> set | None:
    """vLLM 0.32's serve flags (serve-flags.txt, from its --help=all); None where that file was not copied along."""
    path = Path(__file__).resolve().parent / "serve-flags.txt"
    if not path.exists():
        return None
    return {line.strip() for line in path.read_text().splitlines() if line.startswith("--")}


def refuse_unknown_flags(argv: list) -> None:
    """As vLLM's argparse: a `--flag` it does not know ends the CLI with exit 2 and its message on stderr."""
    known = _known_flags()
    if known is None:
        return
    unknown = [a for a in argv if a.startswith("--") and a.split("=", 1)[0] not in known]
    if unknown:
        print("usage: vllm [-h] [-v]\n            {chat,complete,serve,launch,bench,collect-env,download-kernels,"
              "preload,run-batch,snapshot}\n            ...\n"
              f"vllm: error: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        sys.exit(2)


def option(args: list, flag: str, default=None):
    return args[args.index(flag) + 1] if flag in args else default


def api_keys(args: list) -> list:
    """The keys vLLM checks: --api-key's, else VLLM_API_KEY's; none: no check."""
    given = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--api-key"]
    return [k for k in given or [os.environ.get("VLLM_API_KEY", "")] if k]


def authorized(path: str, authorization: str | None, keys: list) -> bool:
    """vLLM's check: only paths under /v1, a Bearer token equal to one of the keys."""
    if not keys or not path.startswith("/v1"):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and any(hmac.compare_digest(token.encode(), k.encode()) for k in keys)


def title_core(title: bytes = CORE_TITLE) -> None:
    """Name this process as vLLM names its engine core (or its worker), so that tools and tests find it by the same
    title."""
    try:
        with open("/proc/self/comm", "wb") as f:
            f.write(title[:15])
    except OSError:
        pass


def models(name: str, model: str, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                                        "root": model, "parent": None, "max_model_len": max_model_len}]}


def render(messages: list) -> str:
    """A ChatML rendering with the generation prompt, as the tiny model's chat template."""
    return "".join(f"<|im_start|>{m.get('role')}\n{m.get('content')}<|im_end|>\n" for m in messages) \
        + "<|im_start|>assistant\n"


def tokenize(body: dict, max_model_len: int) -> dict:
    """POST /tokenize (outside the key check): one token a byte of the prompt or of the rendered chat."""
    text = render(body["messages"]) if isinstance(body.get("messages"), list) else str(body.get("prompt") or "")
    tokens = list(text.encode())
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": None}


class Counters:
    """What /metrics counts, as vLLM's families name it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.prompt = self.generation = self.finished = self.queries = 0

    def record(self, prompt_tokens: int, generated: int) -> None:
        with self.lock:
            self.prompt += prompt_tokens
            self.generation += generated
            self.finished += 1
            self.queries += prompt_tokens

    def text(self, name: str, sleep_state: str) -> bytes:
        label = f'engine="0",model_name="{name}"'
        lines = []
        for family, kind, value in (("vllm:num_requests_running", "gauge", 0.0),
                                    ("vllm:num_requests_waiting", "gauge", 0.0),
                                    ("vllm:kv_cache_usage_perc", "gauge", 0.0),
                                    ("vllm:prompt_tokens", "counter", self.prompt),
                                    ("vllm:generation_tokens", "counter", self.generation),
                                    ("vllm:prefix_cache_queries", "counter", self.queries),
                                    ("vllm:prefix_cache_hits", "counter", 0)):
            suffix = "_total" if kind == "counter" else ""
            lines += [f"# HELP {family}{suffix} (fake)", f"# TYPE {family}{suffix} {kind}",
                      f"{family}{suffix}{{{label}}} {float(value)}"]
        lines += ["# HELP vllm:request_success_total (fake)", "# TYPE vllm:request_success_total counter",
                  f'vllm:request_success_total{{{label},finished_reason="length"}} {float(self.finished)}',
                  "# HELP vllm:time_to_first_token_seconds (fake)", "# TYPE vllm:time_to_first_token_seconds histogram"]
        for le in ("0.001", "0.1", "1.0", "+Inf"):
            lines.append(f'vllm:time_to_first_token_seconds_bucket{{{label},le="{le}"}} '
                         f"{float(self.finished if le != '0.001' else 0)}")
        lines += [f"vllm:time_to_first_token_seconds_count{{{label}}} {float(self.finished)}",
                  f"vllm:time_to_first_token_seconds_sum{{{label}}} {0.01 * self.finished}",
                  "# HELP vllm:engine_sleep_state (fake)", "# TYPE vllm:engine_sleep_state gauge", sleep_state]
        return ("\n".join(lines) + "\n").encode()


def watch_cores(cores: list, on_death, log, at_death=None) -> threading.Event:
    """An Event set once a core child has died (and `at_death()` called), after which `on_death()` runs (after
    DEAD_SERVE_S, as vLLM's watchdog ends its server); `cores`: Popen objects; `log(message, level)` writes the
    engine log's line."""
    dead = threading.Event()

    def watch() -> None:
        while not any(core.poll() is not None for core in cores):
            time.sleep(0.05)
        dead.set()
        if at_death is not None:
            at_death()
        log("AsyncLLM output_handler failed.", "ERROR")
        log("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
            "for the root cause.", "ERROR")
        time.sleep(DEAD_SERVE_S)
        on_death()

    threading.Thread(target=watch, daemon=True, name="core-watchdog").start()
    return dead


class HostWeights:
    """`mb` MiB of host RAM standing for the weights. Level 1 keeps them (no GPU to move them from); level 2
    frees them; waking the weights allocates them again."""

    def __init__(self, mb: int):
        self.mb = mb
        self.held = self.allocate()

    def allocate(self) -> bytearray:
        held = bytearray(self.mb << 20)
        held[::4096] = b"\1" * len(range(0, len(held), 4096))  # touch every page: resident, not just reserved
        return held

    def sleep(self, level: int) -> int:
        """Bytes freed."""
        freed = len(self.held) if level == 2 else 0
        if freed:
            self.held = bytearray()
        return freed

    def wake(self, tags: list[str]) -> None:
        if (not tags or "weights" in tags) and len(self.held) < self.mb << 20:
            self.held = self.allocate()

    def in_use(self) -> int:
        return len(self.held)
