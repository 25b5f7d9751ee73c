"""Named workloads: create one (checked, previewed), delete it, and what a run takes from it. The runner's
side (what each request sends, what a prefix cache could reuse) is benchmarks/runner/workloads.py."""
from benchmarks import runner
from benchmarks.models import Workload
from plumbing.errors import ServiceError
from plumbing.queue import enqueue

MAX_FILE_BYTES = 20 * 2**20
# Each kind's own settings: (name, smallest, largest, whole number?).
SETTINGS = {
    Workload.Kind.PREFIX: (("prefixes", 1, 10_000, True), ("prefix_tokens", 1, 200_000, True)),
    Workload.Kind.MULTITURN: (("turns", 1, 100, True), ("think_s", 0, 600, False)),
    Workload.Kind.SHAREGPT: (),
    Workload.Kind.TRACE: (),
}
FILE_KINDS = (Workload.Kind.SHAREGPT, Workload.Kind.TRACE)


def _setting(values: dict, name: str, low, high, whole: bool):
    value = values.get(name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
    if not ok or (whole and value != int(value)):
        raise ServiceError(f"{name} must be a {'whole ' if whole else ''}number from {low:,} to {high:,}.", field=name)
    return int(value) if whole else float(value)


def workload_spec(kind: str, values: dict, file_text: str = "") -> dict:
    """The runner's description of a workload from a form's or the API's values (ServiceError naming the field)."""
    if kind not in Workload.Kind.values:
        raise ServiceError(f"kind must be one of {', '.join(Workload.Kind.values)}.", field="kind")
    low, high = values.get("think_min_s"), values.get("think_max_s")
    if values.get("think") == "uniform" and values.get("think_s") is None and all(
            isinstance(v, (int, float)) for v in (low, high)):
        values = {**values, "think_s": (low + high) / 2}  # think_s is the think time's mean, whatever its shape
    spec = {"kind": kind, **{name: _setting(values, name, *limits) for name, *limits in SETTINGS[kind]}}
    if kind == Workload.Kind.MULTITURN:
        spec.update(_think(values))
    if kind in FILE_KINDS:
        if not file_text.strip():
            raise ServiceError("Upload the file.", field="file")
        if len(file_text.encode()) > MAX_FILE_BYTES:
            raise ServiceError(f"The file is over {MAX_FILE_BYTES // 2**20} MB.", field="file")
        try:
            if kind == Workload.Kind.SHAREGPT:  # prompts as text: they fit the chat and the completions endpoint
                spec["entries"] = runner.workfiles.sharegpt(file_text, runner.COMPLETIONS)
            else:
                spec.update(block_tokens=runner.workfiles.TRACE_BLOCK_TOKENS, requests=runner.workfiles.mooncake(file_text))
        except runner.PromptError as exc:
            raise ServiceError(str(exc), field="file") from exc
    return spec


def _think(values: dict) -> dict:
    """A multi-turn workload's think-time distribution beyond a fixed think_s: exponential (mean think_s) or
    uniform (think_min_s to think_max_s), drawn from think_seed ({} when fixed)."""
    how = values.get("think") or "fixed"
    if how not in runner.workloads.THINKS:
        raise ServiceError(f"think must be one of {', '.join(runner.workloads.THINKS)}.", field="think")
    if how == "fixed":
        return {}
    out = {"think": how, "think_seed": _setting({"think_seed": values.get("think_seed", 0)}, "think_seed", 0, 2**31 - 1, True)}
    if how == "uniform":
        out.update({k: _setting(values, k, 0, 600, False) for k in ("think_min_s", "think_max_s")})
        if out["think_min_s"] > out["think_max_s"]:
            raise ServiceError("think_min_s must not be above think_max_s.", field="think_min_s")
    return out


def workload_create(*, name: str, kind: str, values: dict, file_text: str = "", user=None) -> Workload:
    """Check and save a workload; the preview of what it sends is made by the control worker (workload_preview),
    not in the request: at the file bounds it takes seconds, and a web thread held that long stalls every page."""
    name = name.strip()
    if not name:
        raise ServiceError("Name the workload.", field="name")
    if Workload.objects.filter(name=name).exists():
        raise ServiceError(f"A workload named {name} exists; pick another name.", field="name", code="exists")
    spec = workload_spec(kind, values, file_text)
    lengths = {k: _setting(values, k, 1, 200_000, True) if k in values else runner.spec_default(k)
               for k in ("input_tokens", "max_tokens")}
    workload = Workload.objects.create(name=name, kind=kind, spec=spec, preview={}, created_by=user, **lengths)
    enqueue("benchmarks.workload_preview", args=[workload.pk])
    return workload


def workload_preview(workload_id: int) -> dict | None:
    """Make and keep a workload's preview (the control worker's task); None when it was deleted meanwhile."""
    w = Workload.objects.filter(pk=workload_id).first()
    if w is None:
        return None
    try:
        preview = runner.workfiles.preview(runner.LoadSpec(base_url="http://preview", model="", workload=w.spec,
                                                           input_tokens=w.input_tokens, max_tokens=w.max_tokens))
    except Exception as exc:  # noqa: BLE001 - said on the workload's row rather than lost in a worker log
        preview = {"error": f"No preview: {exc}"[:500]}
    Workload.objects.filter(pk=workload_id).update(preview=preview)
    return preview


def workload_params(workload: Workload, params: dict) -> dict:
    """A run's params with the workload's prompts; a trace with neither levels nor rates replays once at its
    own rate (1x)."""
    params = {**params, "workload": workload.spec, "workload_name": workload.name, "workload_id": workload.pk,
              "input_tokens": workload.input_tokens, "max_tokens": workload.max_tokens}
    if workload.kind == Workload.Kind.TRACE and not params.get("levels") and not params.get("rates"):
        params["rates"] = [round(workload.preview.get("rate") or runner.workloads.trace_rate(workload.spec), 4)]
    return params


def workload_delete(workload: Workload) -> None:
    """Remove a workload; runs that used it keep their own copy of it."""
    workload.delete()
