"""An engine stand-in for the GPU machine, run by the panel's agent as `vllm`.

It is tests/faults/fakevllm/vllm (vLLM's CLI: `--version`, `serve --help=all`, the load log lines, /health,
/v1/models, /v1/chat/completions, /metrics, a process group of two) plus what only a GPU shows: an
"EngineCore" child in the engine's process group that holds real GPU memory through torch, as vLLM's
EngineCore does, so the panel must attribute memory held by a process other than the one it started.
Before the server answers /health, that child, running as whatever user the agent chose for engines,
reports what it can reach of everyone else: every other user's /proc/<pid>/environ (read), a signal to
each such process (kill(pid, 0)) and the paths fake_engine.json lists under "probe" (a folder is listed,
a file read); each as 0 (it could) or the errno. One line, `GPU-STAND-IN {json}`, in the engine log.

With "replay" in fake_engine.json (a file of the GPU log corpus, tests/fixtures/gpu_logs/, and "replay_speed", 1 unless
given), the engine log is first that recorded TP=8 load, each line at its time divided by the speed (the replayer,
tests/gpucorpus.py, copied beside this file as `gpucorpus.py`), then the fake's own load and server, as without it.

Sleep mode is the fake's (its routes, answers and timings), with the GPU memory following it as under vLLM's
allocator: a sleep frees it on the GPU (level 1 copies it to host memory first), a wake takes it again (level 1
copies it back; after level 2 it comes back uninitialised, as vLLM's weights do until reloaded), so NVML sees
it go and come back. Without --enable-sleep-mode nothing is freed.

With "matmul_per_token": N in fake_engine.json (default 0: none), generating costs the GPU real work, so that a load
draws real energy (tests/gpu/test_energy_net_gpu.py): for each request the server ends, the EngineCore child does N bf16
MATMUL_SIZE x MATMUL_SIZE matmuls on the GPU per token the request generated (over a socket of their own, one request
at a time, as one GPU computes them), and the request ends (its usage, [DONE]) and its tokens count in /metrics once
they are done. It needs a GPU (torch on cuda), whatever "gpu_gib" says.

The test copies this file as `vllm` (with its own interpreter, the one with torch, as the #! line) and
the fake engine beside it as `fakevllm` (with the files beside the fake: fakeproto.py, serve-flags.txt), into a
folder the engine user can read. Standard library and torch.
"""
import errno
import importlib.machinery
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPORT = "GPU-STAND-IN "
GIB = 1 << 30
MATMUL_SIZE = 4096  # "matmul_per_token": ~137 GFLOP each, about 0.25 ms of an H100


def fake():
    """tests/faults/fakevllm/vllm, copied beside this file as `fakevllm` (no .py suffix, hence the loader)."""
    loader = importlib.machinery.SourceFileLoader("fakevllm", str(HERE / "fakevllm"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("fakevllm", loader))
    loader.exec_module(module)
    return module


def tried(fn) -> int:
    try:
        fn()
        return 0
    except OSError as exc:
        return exc.errno or errno.EIO


def probe(paths: list[str]) -> dict:
    """What this process can do to other users' processes, and to the given paths."""
    me = os.getuid()
    environ, kill = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid == me:
                continue
        except OSError:
            continue  # gone meanwhile
        pid = int(entry)
        environ[entry] = tried(lambda: open(f"/proc/{pid}/environ", "rb").read())
        kill[entry] = tried(lambda: os.kill(pid, 0))
    files = {p: tried(lambda p=p: os.listdir(p) if os.path.isdir(p) else open(p, "rb").read(1)) for p in paths}
    return {"environ": environ, "kill": kill, "files": files}


class GpuWeights:
    """`gib` GiB of memory on the first visible GPU, for the fake's obey(): sleep(level) frees it on the GPU
    (level 1 keeps a host copy), wake(tags) takes it again when the weights wake."""

    def __init__(self, torch, gib: float):
        self.torch = torch
        self.size = int(gib * GIB)
        self.held = torch.ones(self.size, dtype=torch.uint8, device="cuda:0")
        self.host = None
        torch.cuda.synchronize()

    def sleep(self, level: int) -> int:
        if self.held is None:
            return 0
        if level == 1:
            self.host = self.held.to("cpu")
        self.held = None
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()  # back to the driver: torch's caching allocator would keep it from NVML
        return self.size

    def wake(self, tags: list[str]) -> None:
        if self.held is not None or (tags and "weights" not in tags):
            return
        if self.host is not None:
            self.held, self.host = self.host.to("cuda:0"), None
        else:
            self.held = self.torch.empty(self.size, dtype=self.torch.uint8, device="cuda:0")
        self.torch.cuda.synchronize()

    def in_use(self) -> int:
        return 0 if self.held is None else self.size


class Matmuls:
    """"matmul_per_token": the GPU work of generated tokens, N bf16 matmuls each on the first visible GPU."""

    def __init__(self, per_token: int):
        import torch

        self.torch, self.per_token = torch, per_token
        self.a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, dtype=torch.bfloat16, device="cuda:0")
        self.out = torch.empty_like(self.a)
        self.run(1)  # cuBLAS's set-up before the server answers, not in the first request

    def run(self, tokens: int) -> None:
        for _ in range(tokens * self.per_token):
            self.torch.matmul(self.a, self.a, out=self.out)
        self.torch.cuda.synchronize()

    def serve(self, fd: int) -> None:
        """Answer "ok" to each line (a request's generated tokens) once their matmuls are done."""
        with socket.socket(fileno=fd) as sock, sock.makefile("rw") as channel:
            for line in channel:
                self.run(int(line))
                channel.write("ok\n")
                channel.flush()


def gpu_counters(base: type, work: socket.socket) -> type:
    """The fake's /metrics counters (fakeproto.Counters), whose record() (a request's end, with the tokens it
    generated) first has the EngineCore child compute those tokens (Matmuls), one request at a time."""
    lock = threading.Lock()
    answers = work.makefile("r")

    class Counters(base):
        def record(self, prompt_tokens: int, generated: int) -> None:
            if generated:
                with lock:
                    work.sendall(f"{generated}\n".encode())
                    if answers.readline() != "ok\n":
                        raise RuntimeError("GPU stand-in: the engine core stopped computing tokens")
            super().record(prompt_tokens, generated)

    return Counters


def engine_core(model: str, pooled: bool, work_fd: int | None = None) -> None:
    """Hold `gpu_gib` GiB on the first visible GPU, report once, then obey sleep and wake until SIGTERM; with a
    `work_fd` ("matmul_per_token"), compute each request's tokens on the GPU meanwhile (Matmuls)."""
    standin = fake()
    config = json.loads((Path(model) / "fake_engine.json").read_text())
    if config["gpu_gib"]:
        import torch

        memory = GpuWeights(torch, config["gpu_gib"])
        device = torch.cuda.get_device_name(0)
    else:  # a rehearsal of the panel's side on a machine without a GPU
        memory, device = standin.HostWeights(0), "no GPU"
    matmuls = Matmuls(int(config["matmul_per_token"])) if work_fd is not None else None
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    report = {"pid": os.getpid(), "uid": os.getuid(), "no_new_privs": status.get("NoNewPrivs", "").strip(),
              "gib": memory.in_use() / GIB, "device": device,
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), **probe(config.get("probe", []))}
    print(REPORT + json.dumps(report), flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if matmuls is not None:
        threading.Thread(target=matmuls.serve, args=(work_fd,), daemon=True).start()
    standin.fakeproto.title_core(b"VLLM::Worker")  # what holds the GPU memory in vLLM
    standin.obey(memory, config, pooled)


def replay(config: dict) -> None:
    """The corpus file config["replay"] at config["replay_speed"], by tests/gpucorpus.py copied beside this file."""
    loader = importlib.machinery.SourceFileLoader("gpucorpus", str(HERE / "gpucorpus.py"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpucorpus", loader))
    loader.exec_module(module)
    module.replay(Path(config["replay"]), float(config.get("replay_speed", 1.0)))


def serve(args: list[str]) -> None:
    """Start the GPU-holding child, pass its report to the log once it holds the memory, replay a recorded GPU load
    if fake_engine.json names one, then serve."""
    standin = fake()
    standin.fakeproto.refuse_unknown_flags(args)  # as vLLM's argparse, before anything starts
    pooled = "pooled" if "--enable-sleep-mode" in args else "unpooled"
    config = json.loads((Path(args[0]) / "fake_engine.json").read_text())
    work = theirs = None
    if config.get("matmul_per_token"):  # the core computes generated tokens, over a socket of their own
        work, theirs = socket.socketpair()
    core = subprocess.Popen([sys.executable, __file__, "_engine_core", args[0], pooled,
                             *([str(theirs.fileno())] if theirs else [])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            pass_fds=(theirs.fileno(),) if theirs else ())
    if theirs:
        theirs.close()
        standin.fakeproto.Counters = gpu_counters(standin.fakeproto.Counters, work)  # what the fake's serve() counts with
    line = core.stdout.readline()
    if not line.startswith(REPORT):
        sys.exit(f"GPU stand-in: the engine core ended without holding GPU memory (exit {core.wait()})")
    print(line.strip(), flush=True)
    if config.get("replay"):
        replay(config)
    standin.serve(args, cores=(core,))


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["_engine_core"]:
        engine_core(argv[1], argv[2] == "pooled", int(argv[3]) if len(argv) > 3 else None)
    elif argv[:1] == ["serve"] and not any(a.startswith("--help") for a in argv):
        serve(argv[1:])
    else:  # --version, serve --help=all, and the fake's own _core child
        fake().main()


if __name__ == "__main__":
    main()
