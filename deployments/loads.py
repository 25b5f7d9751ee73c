"""Load time, as the node measures it: a load's phases, its prediction from earlier loads, the
loader's read rate against the store's own, page-cache residency, pre-warm and the store's measurement.

Beneath both sides: the node's plan follows loads with it, the control plane asks for a measurement
(services/loadtime.py). A finished load's KV-cache calibration is kvcalibration.py, beneath both sides too, so
nothing here imports a control-plane service."""
import hashlib
import json
import logging
import threading
import time
from pathlib import Path

import psutil
from django.utils import timezone

from deployments import contextfit, kvcalibration, payloads, secrets, selectors, warmstart
from deployments.host import compilecache, loadphases, pagecache
from deployments.models import Deployment, DeploymentEvent, ModelCopy, Node

log = logging.getLogger(__name__)
__all__ = ["LoadWatch", "Prewarm", "load_history", "load_key", "load_recommendation", "node_measure_disk",
           "node_measure_disk_once"]
HISTORY = 5           # earlier loads a prediction draws on
RESIDENCY_EVERY_S = 5.0  # mincore over a big model costs a pass over its page table


def load_key(d: Deployment) -> str:
    """What a load's time depends on: model (and commit), flags, engine version, node."""
    parts = {"model": d.model_id, "commit": d.model.commit, "args": d.engine_args, "env": d.env,
             "engine": d.node.engine_version, "node": d.node_id}
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


_loads = selectors.load_events


def load_history(d: Deployment, exclude_event: int | None = None) -> tuple[list[dict], str, float, dict | None]:
    """(totals of earlier loads, what they are, weights scale, the previous load's totals)."""
    same = list(_loads(data__key=load_key(d)).exclude(pk=exclude_event)[:HISTORY])
    if same:
        return ([e.data["totals"] for e in same], f"{len(same)} earlier load{'s' * (len(same) > 1)} "
                "of this model, flags, engine and node", 1.0, same[0].data["totals"])
    other = _loads(data__model=d.model_id).exclude(pk=exclude_event).exclude(deployment__node=d.node).first()
    here, there = (d.node.disk_read or {}).get("bps"), other and (other.deployment.node.disk_read or {}).get("bps")
    if other and here and there:
        return ([other.data["totals"]], f"this model on {other.deployment.node.name}, weights scaled by "
                f"disk read rate ({there / 1e9:.2f} → {here / 1e9:.2f} GB/s)", there / here, None)
    return [], "no earlier load of this model here: phases only", 1.0, None


def _model_files(d: Deployment) -> list[Path]:
    copy = ModelCopy.objects.filter(model=d.model, node=d.node).first()
    try:
        return pagecache.weight_files(copy.path) if copy and copy.path else []
    except OSError:
        return []


class LoadWatch:
    """One load followed: phases from the log, prediction, read rate, residency, free RAM."""

    def __init__(self, d: Deployment, fresh: bool = True):
        self.d = d
        self.t0 = d.started.timestamp() if d.started else time.time()
        # A load followed again after an agent restart (fresh=False) replays old lines at today's clock:
        # shown, not kept. (Not judged by the clock: on a busy host the watch may start long after launch.)
        self.fresh = fresh
        if not fresh:  # the lost agent's load step never ended: it is closed saying so, not left open beside this one
            DeploymentEvent.objects.filter(deployment=d, step="load", ended=None).update(
                ended=timezone.now(), level=DeploymentEvent.Level.WARNING,
                message="The node agent following this load was lost; a new agent follows it from here (the outage "
                        "is not the engine's: this load's timings are not compared nor kept).")
        self.clock = loadphases.PhaseClock()
        self.history, self.basis, self.scale, self.previous = load_history(d)
        self.files = _model_files(d)
        self.model_bytes = sum(p.stat().st_size for p in self.files if p.exists())
        self.io = (time.monotonic(), pagecache.process_read_bytes(d.pid) if d.pid else 0)
        self.read_bps = 0.0
        self.residency: pagecache.Residency | None = None
        self.residency_at = 0.0
        self.event_id: int | None = None
        self.engine_kv = contextfit.EngineKv()  # the KV-cache size the engine logs, for calibration
        self.start = dict((d.load_detail or {}).get("start") or {})  # compile cache and profile (plan._launch)
        self.cache_hits = compilecache.HitWatch()  # what the engine's log says its compile cache did

    def now(self) -> float:
        return time.time() - self.t0

    def read(self, follow) -> None:
        """The lines `follow` (a lifecycle.LogFollow) finds written since its last read: fed to the phases and
        sent to the page, redacted."""
        if lines := follow.read():
            self.feed(lines)
            payloads.send_log_lines(self.d.pk, secrets.redact_lines(self.d, lines[-200:]))

    def feed(self, lines: list[str]) -> None:
        now = self.now()
        for line in lines:
            self.clock.feed(line, now)
            self.engine_kv.feed(line)
            self.cache_hits.feed(line)

    def detail(self) -> dict:
        """What the page shows beside the bar; called about once a second."""
        mono = time.monotonic()
        if self.d.pid:
            read = pagecache.process_read_bytes(self.d.pid)
            if mono - self.io[0] >= 1.0:
                self.read_bps = max(0.0, (read - self.io[1]) / (mono - self.io[0]))
                self.io = (mono, read)
        if self.files and mono - self.residency_at >= RESIDENCY_EVERY_S:
            self.residency_at = mono
            try:
                self.residency = pagecache.residency([p for p in self.files if p.exists()])
            except (OSError, pagecache.PageCacheError):
                self.residency = None
        now = self.now()
        prediction = loadphases.predict(self.clock, now, self.history, self.basis, self.scale)
        return {"phases": self.clock.as_data(), "elapsed_s": round(now, 1), "basis": self.basis,
                "prediction": prediction and {"total_s": prediction.total_s, "seconds_left": prediction.seconds_left,
                                              "percent": prediction.percent},
                "previous": self.previous, "read_bps": round(self.read_bps), "disk_bps": (self.d.node.disk_read or {}).get("bps"),
                "model_bytes": self.model_bytes, "ram_available": psutil.virtual_memory().available,
                "resident_bytes": self.residency.resident if self.residency else None, "start": self.start}

    def ready(self) -> str:
        """The API answered: the smoke test starts. Returns the comparison with the previous load.
        The API answering is the API up, whether or not its log lines were read before /health answered."""
        now = self.now()
        if "api_up" not in (phase for phase, _, _ in self.clock.segments):
            self.clock.enter("api_up", now)
        self.clock.enter("smoke_test", now)
        if not self.fresh:  # replayed at today's clock, the agent's outage inside: no comparison to blame the engine
            return ""
        return "; ".join(loadphases.compare(self.clock.totals(), self.previous or {}))

    def finish(self) -> None:
        """The smoke test is done: keep this load's phases for history and the page."""
        self.clock.finish(self.now())
        data = {**self.clock.as_data(), "elapsed_s": round(self.now(), 1), "model_bytes": self.model_bytes,
                **warmstart.load_data(self.d, self.start, self.cache_hits, self.engine_kv)}  # cold or warm, and why
        if self.fresh:
            data.update(key=load_key(self.d), model=self.d.model_id)
        else:
            data.pop("totals")  # replayed timings: not a load to learn from
            data.pop("profile")  # nor a profile to reuse: its GPUs and settings were not seen at its launch
        if self.event_id:
            DeploymentEvent.objects.filter(pk=self.event_id).update(data=data)
        # Measured here on the node (its RAM, its disk, its vLLM's flags), shown on the page, never applied.
        self.d.load_detail = {**self.d.load_detail, "phases": self.clock.as_data(), "recommend": load_recommendation(self.d),
                              "start": {**self.start, "kind": data["start"], "warm_by": data["warm_by"],
                                        "compile_cache": data["compile_cache"]}}  # the API's and page's last start
        Deployment.objects.filter(pk=self.d.pk).update(load_detail=self.d.load_detail)
        if self.fresh and not self.start.get("profile_reused"):  # the estimate against the engine's own KV size
            # corrects the next one (a reused profile's size was given, not chosen)
            try:
                kvcalibration.load_calibrate(self.d, self.engine_kv)
            except Exception:  # noqa: BLE001 - a calibration must never fail a load that is ready
                log.exception("deployment %s: the KV-cache calibration after the load failed", self.d.pk)


def node_measure_disk(node_id: int, max_bytes: int = 1 << 30) -> dict:
    """Measure the model store's sequential read rate (cold where it can) on the largest model files
    here that no active engine serves, and keep it on the node."""
    node = Node.objects.get(pk=node_id)
    copies = ModelCopy.objects.filter(node=node).exclude(path="").select_related("model")
    busy = set(node.deployments.filter(status__in=Deployment.ACTIVE).values_list("model_id", flat=True))
    files, keep = [], set()
    for copy in copies:
        found = pagecache.weight_files(copy.path) if Path(copy.path).is_dir() else []
        files += found
        if copy.model_id in busy:
            keep.update(found)
    files.sort(key=lambda p: p.stat().st_size, reverse=True)
    rate = pagecache.measure_read_rate(files, max_bytes=max_bytes, keep=frozenset(keep))
    node.disk_read = {"bps": round(rate.bps), "bytes": rate.bytes, "cold": rate.cold, "at": timezone.now().isoformat()}
    Node.objects.filter(pk=node.pk).update(disk_read=node.disk_read)
    return node.disk_read


PREWARM_RAM_SHARE = 0.8  # never fill more than this share of the available RAM with the model


class Prewarm:
    """The pre-warm plan step: reads the new model's shards into the page cache in a thread while
    the plan stops other engines; `wait` reports its progress on the timeline until it is done."""

    def __init__(self, model_path: str, workers: int = 4):
        self.files = pagecache.weight_files(model_path) if Path(model_path).is_dir() else []
        self.total = sum(p.stat().st_size for p in self.files)
        self.done = 0
        self.rate: pagecache.ReadRate | None = None
        self.error: str | None = None
        self.skipped = ""
        available = psutil.virtual_memory().available
        if not self.files:
            self.skipped = "no weight files to pre-warm"
        elif self.total > PREWARM_RAM_SHARE * available:
            self.skipped = (f"the model ({self.total / 1e9:.1f} GB) does not fit in {PREWARM_RAM_SHARE:.0%} of the "
                            f"free RAM ({available / 1e9:.1f} GB)")
        self._thread = None
        if not self.skipped:
            self._thread = threading.Thread(target=self._run, args=(workers,), name="prewarm", daemon=True)
            self._thread.start()

    def _add(self, n: int) -> None:
        self.done += n  # one writer per chunk; a lost increment only makes the progress lag

    def _run(self, workers: int) -> None:
        try:
            self.rate = pagecache.prewarm(self.files, workers=workers, on_bytes=self._add)
        except OSError as exc:
            self.error = str(exc)

    def wait(self, event: DeploymentEvent) -> str:
        """Block until the reads finish, showing progress as the step's message about once a second."""
        def on_progress(message: str) -> None:
            event.message = message
            DeploymentEvent.objects.filter(pk=event.pk).update(message=message)
            payloads.send_timeline_step(event)

        if self._thread is None:
            return f"Skipped: {self.skipped}."
        while self._thread.is_alive():
            on_progress(f"Pre-warming: {self.done / 1e9:.2f} of {self.total / 1e9:.2f} GB in the page cache…")
            self._thread.join(1.0)
        if self.error:
            return f"Pre-warm stopped: {self.error}."
        resident = pagecache.residency(self.files)
        return (f"{self.rate.bytes / 1e9:.2f} GB read in {self.rate.seconds:.1f} s ({self.rate.bps / 1e9:.2f} GB/s); "
                f"{resident.percent:.0f} % of the model is in the page cache.")


def load_recommendation(d: Deployment) -> list[str]:
    """Load options worth trying, from the node's measurements and the flags its vLLM offers (shown, never applied)."""
    flags, args = set(d.node.engine_flags or []), d.engine_args
    copy = ModelCopy.objects.filter(model=d.model, node=d.node).first()
    size = sum(p.stat().st_size for p in _model_files(d)) if copy else 0
    disk = (d.node.disk_read or {}).get("bps")
    out = []
    if "safetensors-load-strategy" in flags and "safetensors-load-strategy" not in args and size:
        ram = psutil.virtual_memory().available
        if size < PREWARM_RAM_SHARE * ram:
            out.append("--safetensors-load-strategy prefetch: the model fits in free RAM, so vLLM can read the shards "
                       "ahead into the page cache (published: DeepSeek-V3 1500 s → 435 s on 8×B200).")
    last = selectors.load_events(deployment=d).first()
    if last and disk and size and last.data["totals"].get("weights"):
        rate = size / max(last.data["totals"]["weights"], 0.001)
        if rate < 0.5 * disk and "load-format" in flags:
            out.append(f"The last load read weights at {rate / 1e9:.2f} GB/s against the disk's {disk / 1e9:.2f} GB/s: "
                       "another --load-format this vLLM offers (e.g. fastsafetensors, runai_streamer; see "
                       "`vllm serve --help=all`) may read faster.")
    return out


def node_measure_disk_once(node_id: int) -> dict:
    """At agent start: measure the store once, when it was never measured and holds a model."""
    if Node.objects.filter(pk=node_id, disk_read={}).exists() and ModelCopy.objects.filter(node_id=node_id).exclude(path="").exists():
        try:
            return node_measure_disk(node_id)
        except (OSError, pagecache.PageCacheError) as exc:
            log.info("node %s: store read rate not measured: %s", node_id, exc)
    return {}
