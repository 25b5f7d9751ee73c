"""The value each common engine flag takes, checked before a deploy is accepted: a value vLLM's
argument parser would refuse (`--max-num-seqs abc`) is the caller's to fix, so it is named at once with
what the flag takes, instead of being accepted and failing on the node (or hidden behind another check).

Only flags whose kind is certain are listed; any other flag's value is left to the engine. Plain Python.
"""
import re

# Whole numbers from 0 up (vLLM parses them with int()); --seed may be any whole number. The parallel
# sizes are flagpolicy.COUNT_FLAGS' (checked there, with the GPU count).
COUNTS = {"max-num-seqs", "max-num-batched-tokens", "block-size", "max-logprobs", "max-loras", "max-lora-rank",
          "max-cpu-loras", "num-gpu-blocks-override", "max-parallel-loading-workers", "max-num-partial-prefills",
          "max-long-partial-prefills", "long-prefill-token-threshold", "api-server-count", "max-cudagraph-capture-size",
          "max-num-queued-reqs", "max-num-queued-tokens"}
# Of those, the ones vLLM's config wants at least 1 of (pydantic's ge=1/gt=0: a 0 fails the launch).
POSITIVE = {"max-num-seqs", "max-num-batched-tokens", "block-size", "max-loras"}
# Amounts from 0 up (float()).
AMOUNTS = {"swap-space", "cpu-offload-gb"}
# vLLM reads --max-model-len as a whole number, -1 or "auto", or with a k/m/g suffix ("32k").
MODEL_LEN = re.compile(r"^(?:-1|auto|\d+(?:\.\d+)?[kKmMgG]?)$")
SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,199}$")


def _whole(value) -> int:
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError
        return int(value)
    return int(str(value).strip())  # "8" is 8; "abc" and "8.5" are refused


def _amount(value) -> float:
    if isinstance(value, bool):
        raise ValueError
    return float(str(value).strip())


def _problem(name: str, value) -> str | None:
    if value is None or value is False:  # "leave the engine's default" (a study variant removes a flag so)
        return None
    shown = repr(str(value)[:40])
    try:
        if name in COUNTS and _whole(value) < (1 if name in POSITIVE else 0):
            raise ValueError
        if name == "seed":
            _whole(value)
        if name in AMOUNTS and _amount(value) < 0:
            raise ValueError
        if name == "gpu-memory-utilization" and not 0 < _amount(value) <= 1:
            raise ValueError
    except (TypeError, ValueError):
        if name == "gpu-memory-utilization":
            return f"--{name} is the share of each GPU's memory the engine takes, above 0 and at most 1, not {shown}"
        what = ("a whole number" if name == "seed" else "a whole number from 1 up" if name in POSITIVE
                else "a whole number from 0 up" if name in COUNTS else "a number from 0 up")
        return f"--{name} takes {what}, not {shown}"
    if name == "max-model-len" and not isinstance(value, bool) and not MODEL_LEN.match(str(value).strip()):
        return f"--{name} takes a number of tokens (e.g. 4096 or 32k), not {shown}"
    if name == "served-model-name" and value != "" and not SERVED_NAME.match(str(value)):
        # One argv word (the panel passes one name); callers put it in "model", where a space or quote breaks clients.
        return (f"--{name} is the one name callers put in \"model\": letters, digits and . _ - / : only (no spaces), "
                f"not {shown}")
    return None


def problems(flags: dict) -> list[str]:
    """One message per flag whose value its kind refuses, e.g. "--max-num-seqs takes a whole number from 0 up, not 'abc'"."""
    return [p for name, value in flags.items() if (p := _problem(name, value))]
