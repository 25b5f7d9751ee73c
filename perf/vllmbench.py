"""What perf/bench_fidelity.py, perf/bench_ceiling.py and perf/client_vs_vllm_bench.py share: their common flags,
tests/schedserver.py pinned to a core, this run's core and CPU priority, and one `vllm bench serve` run (its
invocation and result) to compare with."""
import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from deployments.host import processenv

ROOT = Path(__file__).resolve().parent.parent
VLLM = ROOT / ".engine-venv" / "bin" / "vllm"
SCHEDSERVER = ROOT / "tests" / "schedserver.py"


def cores() -> tuple[int, int]:
    """(server core, client core): the first two this process may use."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[0], allowed[1 % len(allowed)]


def comparison_args(parser) -> None:
    """The flags of a comparison with `vllm bench serve`: --no-vllm, --no-priority."""
    parser.add_argument("--no-vllm", action="store_true", help="measure only ours")
    parser.add_argument("--no-priority", action="store_true", help="don't raise this run's CPU priority")


def pin_client(no_priority: bool) -> tuple[int, int, callable]:
    """(server core, client core, undo): this process pinned to the client core (the measuring processes and
    `vllm bench serve` it starts inherit it), its CPU priority raised unless `no_priority`; undo() lowers it."""
    server_core, client_core = cores()
    restore = (lambda: None) if no_priority else raise_priority()
    os.sched_setaffinity(0, {client_core})
    return server_core, client_core, restore


def raise_priority(pid: int = 0) -> callable:
    """Ask for more CPU than the rest of a shared machine for this process, or `pid` (root only);
    returns how to undo it. (A process that starts a session of its own, as an engine does, gets an
    autogroup of its own at nice 0: raise its too.)"""
    undo = []
    autogroup = Path(f"/proc/{pid or 'self'}/autogroup")
    try:
        old = autogroup.read_text().split()[-1]
        autogroup.write_text("-20")
        undo.append(lambda: autogroup.write_text(old))
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, pid, -20)
    except OSError:
        pass

    def restore():
        for step in undo:
            try:
                step()
            except OSError:
                pass
    return restore


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """tests/schedserver.py in its own process, pinned to `core`."""

    def __init__(self, core: int, *args: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            ["taskset", "-c", str(core), sys.executable, str(SCHEDSERVER), "--port", str(self.port), *args],
            stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if "listening" not in line:
            raise RuntimeError(f"schedserver did not start: {line!r}")

    def stats(self, reset: bool = False) -> dict:
        url = f"{self.base_url}/stats" + ("?reset=1" if reset else "")
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())

    def close(self):
        self.proc.terminate()
        self.proc.wait(10)


def make_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer for vllm bench serve's random prompts (no hub here)."""
    code = (
        "import json, sys\n"
        "from tokenizers import Tokenizer, models, pre_tokenizers, decoders\n"
        "vocab = {'[UNK]': 0, **{f'w{i}': i + 1 for i in range(2000)}}\n"
        "tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token='[UNK]'))\n"
        "tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()\n"
        "tok.decoder = decoders.WordPiece(prefix='##')\n"
        "tok.save(sys.argv[1] + '/tokenizer.json')\n"
        "json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'unk_token': '[UNK]',\n"
        "           'model_max_length': 1000000}, open(sys.argv[1] + '/tokenizer_config.json', 'w'))\n"
    )
    subprocess.run([str(VLLM.parent / "python"), "-c", code, str(directory)], check=True)
    return directory


def run_vllm(base_url: str, core: int, tokenizer: Path, out: Path, concurrency: int, prompts: int,
             output_len: int, warmups: int, model: str = "sched", dataset: Path | None = None) -> dict:
    """One `vllm bench serve` run pinned to `core`; its --save-result JSON. Random 64-token prompts,
    or with `dataset` the prompts of that JSONL ({"prompt": ...} a line, sent as they are)."""
    result = out / f"vllm-c{concurrency}.json"
    prompts_from = (["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", str(output_len)]
                    if dataset is None else
                    ["--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
                     "--custom-output-len", str(output_len), "--temperature", "0"])
    cmd = ["taskset", "-c", str(core), str(VLLM), "bench", "serve", "--backend", "openai-chat",
           "--base-url", base_url, "--endpoint", "/v1/chat/completions", "--model", model,
           "--tokenizer", str(tokenizer), *prompts_from, "--ignore-eos", "--num-prompts", str(prompts),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--num-warmups", str(warmups),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(out), "--result-filename", result.name,
           "--disable-tqdm", "--seed", "0"]
    env = {**os.environ, **processenv.OFFLINE}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(result.read_text())
