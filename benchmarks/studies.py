"""Tuning studies: create (validated, with a count and an estimate), drive one step at a time, pause, resume,
cancel, apply the winner.

A study is a state machine kept in the database. The node agent's study driver calls study_step() about twice a
second for each study on its deployments; every step looks at what the rows say (the trial, its deployment, its
benchmark run), does at most one thing (send a redeploy, start a run, record a result) and returns. So a killed agent
loses nothing: the next agent's driver continues from the rows. Each trial is one repeat of one variant: a redeploy
through the normal plan (no timeout of its own: the plan's stall detection decides), then the workload as a normal
BenchmarkRun on the deployment.
"""
import itertools
import logging
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from benchmarks import caps, payloads, studyestimate, studyresults, studyrounds, studystats
from benchmarks import services as runs
from benchmarks.models import BenchmarkRun, Study, StudyTrial, StudyVariant
from deployments import flagpolicy, privileged, userflags
from deployments.models import Deployment, DeploymentEvent
from deployments.services import deploys
from plumbing.errors import ServiceError
from plumbing.roles import is_admin

log = logging.getLogger(__name__)
S, T, D = Study.Status, StudyTrial.Status, Deployment.Status
MAX_ATTEMPTS = 3  # a trial interrupted by an agent restart is run again, this many times in all
MAX_TRIALS = 200
MAX_REPEATS = 20  # a study's repeats; an adaptive one's cap is at most repeats + 9 (_max_repeats: ten looks)
MAX_CAP = MAX_REPEATS + len(studystats.POCOCK_Z) - 1
ENV_NAME = flagpolicy.ENV_NAME
ORDERS = {"interleaved": "interleaved (A B C A B C)", "mirrored": "mirrored (A B C C B A)", "random_blocks": "randomised blocks"}


# --- settings -------------------------------------------------------------------------------------

def variant_settings(study: Study, variant: StudyVariant) -> tuple[dict, dict]:
    """(engine_args, env) a variant runs with."""
    args = {k: v for k, v in {**study.base_engine_args, **variant.engine_args}.items() if v is not False and v is not None}
    env = {k: v for k, v in {**study.base_env, **variant.env}.items() if v not in ("", None)}
    return args, env


def expand_variants(variants: list[dict] | None, dimensions: dict | None) -> list[dict]:
    """Variants given as a list ([{"name", "engine_args", "env"}]) and/or as a product of dimensions
    ({"NCCL_PROTO": ["LL", "Simple"], "max-num-seqs": [8, 16]}: upper-case names are environment
    variables, others engine flags), as one list of {"name", "engine_args", "env"}."""
    out = [{"name": str(v.get("name") or ""), "engine_args": dict(v.get("engine_args") or {}), "env": dict(v.get("env") or {})}
           for v in variants or []]
    dims = [(str(k).lstrip("-"), list(values)) for k, values in (dimensions or {}).items()]
    combinations = 1
    for _, values in dims:
        combinations *= len(values)
    if dims and combinations + len(out) > MAX_TRIALS:
        raise ServiceError(f"{combinations} combinations: at most {MAX_TRIALS} variants.", field="dimensions")
    if dims:
        for combo in itertools.product(*(values for _, values in dims)):
            v = {"name": "", "engine_args": {}, "env": {}}
            for (key, _), value in zip(dims, combo):
                if ENV_NAME.match(key) and key.isupper():
                    v["env"][key] = str(value)
                else:
                    v["engine_args"][key] = value
            out.append(v)
    for v in out:
        v["engine_args"] = {_spelled(flagpolicy.flag_name, k): val for k, val in v["engine_args"].items()}
        v["env"] = {_spelled(flagpolicy.env_name, k): val for k, val in v["env"].items()}
        v["name"] = v["name"] or describe(v["engine_args"], v["env"])
    return out


def _spelled(canonical, name) -> str:
    """The name in canonical form for the variant's name; one that has none stays as given (refused later)."""
    try:
        return canonical(name)
    except flagpolicy.OptionError:
        return str(name)


def describe(engine_args: dict, env: dict) -> str:
    parts = [f"{k}={v}" for k, v in env.items()] + [" ".join(userflags.argv_words({k: v})) or f"no --{k}"
                                                    for k, v in engine_args.items()]
    return ", ".join(parts)[:120] or "baseline"


def validate_variants(d: Deployment, variants: list[dict], user) -> None:
    """Each variant's flags and environment as a deploy would check them, before anything starts."""
    known = set(d.node.engine_flags) if d.node.engine_flags else None
    base_args, base_env = d.engine_args, d.env
    for v in variants:
        for name, value in v["engine_args"].items():
            if not isinstance(value, (str, int, float, bool)) and value is not None:
                raise ServiceError(f"{v['name']}: --{str(name)[:40]}: a value is a string, number or true/false.",
                                   field="variants")
        try:  # stored so: the trials' redeploys, the admin check and the argv see one spelling (flagpolicy)
            v["engine_args"] = flagpolicy.canonical_flags(v["engine_args"])
            v["env"] = flagpolicy.canonical_env({k: val for k, val in v["env"].items() if val is not None})
        except flagpolicy.OptionError as exc:
            raise ServiceError(f"{v['name']}: {exc}", field="variants") from exc
        flags = {k: val for k, val in v["engine_args"].items() if val is not False and val is not None}
        if errors := userflags.check_flags(flags, known):
            raise ServiceError(f"{v['name']}: {errors['extra_flags']}", field="variants")
        env = {k: val for k, val in v["env"].items() if val not in ("", None)}
        if errors := userflags.check_env(env):
            raise ServiceError(f"{v['name']}: {errors['env']}", field="variants")
        args = {k: val for k, val in {**base_args, **v["engine_args"]}.items() if val is not False and val is not None}
        privileged.check(engine_args=args, env={**base_env, **env}, model_dir=privileged.model_dir(d.model, d.node),
                         admin=is_admin(user), old_args=base_args, old_env=base_env)


def study_preview(d: Deployment, variants: list[dict], repeats: int, workload: dict, max_repeats: int = 0) -> dict:
    """How many variants and trials a study would run and how long it would take, from what the node
    measured of the deployment (benchmarks.studyestimate); an adaptive one's at most (its cap's)."""
    trials = (len(variants) + 1) * max(repeats, max_repeats)
    workload = {**runs.DEFAULTS, **workload, "repeats": 1}  # as each trial's run will have it
    workload["levels"] = sorted({int(c) for c in workload["levels"]})
    preview = {"variants": len(variants) + 1, "trials": trials, **studyestimate.study_estimate(d, trials, workload)}
    if max_repeats > repeats:
        preview["adaptive"] = (f"Adaptive: judged after {repeats} repeats and after each round more, ended once every "
                               f"variant is decided or after {max_repeats}; the trials and time are at most these.")
    if repeats < studystats.MIN_REPEATS:
        preview["warning"] = (f"{repeats} repeat{'s' if repeats != 1 else ''} per variant: the study will measure, but "
                              f"give no interval and no verdict ({studystats.too_few(repeats)}).")
    return preview


def _max_repeats(repeats: int, max_repeats: int) -> int:
    """An adaptive study's cap, checked (0: not adaptive); ServiceError naming max_repeats."""
    if not max_repeats or max_repeats == repeats:
        return 0
    looks = max_repeats - repeats + 1
    if max_repeats < repeats or looks > len(studystats.POCOCK_Z) or repeats < studystats.MIN_REPEATS:
        raise ServiceError(f"max_repeats is 0 (not adaptive) or from repeats ({repeats}, at least "
                           f"{studystats.MIN_REPEATS} to judge) to repeats + {len(studystats.POCOCK_Z) - 1}, "
                           f"not {max_repeats}.", field="max_repeats")
    return max_repeats


@transaction.atomic
def study_create(*, deployment: Deployment, variants: list[dict], workload: dict, repeats: int = 3,
                 order: str = "interleaved", rule: dict | None = None, finish_with: str = "baseline", name: str = "",
                 user=None, max_repeats: int = 0) -> Study:
    """Create a study of the deployment as it is (the baseline) against `variants`, and let the node's
    agent drive it. Refuses what a deploy would refuse, before anything is stopped. With `max_repeats` above
    `repeats` it is adaptive (benchmarks/studyrounds.py)."""
    d = Deployment.objects.select_for_update().select_related("node", "model").get(pk=deployment.pk)
    if not variants:
        raise ServiceError("Add at least one variant to compare with the baseline.", field="variants")
    if d.status not in (D.READY, D.STOPPED, D.FAILED):
        raise ServiceError(f"{d.name} is {d.get_status_display().lower()}; wait until it is ready.", field="deployment",
                           code="busy")
    if Study.objects.filter(deployment=d, status__in=Study.ACTIVE).exists():
        raise ServiceError(f"A study of {d.name} is already running; wait for it or cancel it.", field="deployment",
                           code="busy")
    if BenchmarkRun.objects.filter(deployment=d, status__in=BenchmarkRun.ACTIVE).exists():
        raise ServiceError(f"A benchmark is measuring {d.name}; wait or cancel it.", field="deployment", code="busy")
    max_repeats = _max_repeats(repeats, max_repeats)
    if (len(variants) + 1) * max(repeats, max_repeats) > MAX_TRIALS:
        raise ServiceError(f"{(len(variants) + 1) * max(repeats, max_repeats)} trials: at most {MAX_TRIALS} per study.",
                           field="variants")
    validate_variants(d, variants, user)
    # One measurement a level in each trial: a study repeats whole trials (each a redeploy), which is what it judges.
    workload = {**runs.DEFAULTS, **workload, "repeats": 1}
    workload["levels"] = sorted({int(c) for c in workload["levels"]})
    caps.check_study(d, workload, variants)  # every trial's run would be refused later, with the study half done
    rule = rule or {"kind": "throughput", **({"level": max(workload["levels"])} if workload["levels"] else {})}
    preview = study_preview(d, variants, repeats, workload, max_repeats)
    study = Study.objects.create(
        name=name or f"{d.name} tuning {timezone.now():%Y-%m-%d %H:%M}", deployment=d, repeats=repeats,
        max_repeats=max_repeats, order=order,
        workload=workload, base_engine_args=d.engine_args, base_env=d.env, rule=rule, finish_with=finish_with,
        estimate_s=preview["estimate_s"], estimate_basis=preview["basis"][:300], created_by=user)
    rows = [StudyVariant.objects.create(study=study, position=0, name="baseline", is_baseline=True)]
    rows += [StudyVariant.objects.create(study=study, position=i, name=v["name"][:120], engine_args=v["engine_args"],
                                         env=v["env"]) for i, v in enumerate(variants, 1)]
    StudyTrial.objects.bulk_create([StudyTrial(study=study, variant=rows[v], position=i, repeat=r)
                                    for i, (v, r) in enumerate(studyrounds.schedule(len(rows), repeats, order, seed=study.pk))])
    payloads.send_study(study.pk, studyresults.study_live(study))
    return study


# --- controls ------------------------------------------------------------------------------------

def _locked(study: Study) -> Study:
    return Study.objects.select_for_update().get(pk=study.pk)


def study_pause(study: Study) -> Study:
    """Pause after the trial in progress (its result is kept); resume continues with the next one."""
    with transaction.atomic():
        study = _locked(study)
        if study.status not in (S.QUEUED, S.RUNNING):
            raise ServiceError(f"The study is {study.get_status_display().lower()}.", code="not_running")
        study.pause_requested = True
        study.save(update_fields=["pause_requested"])
    publish(study)
    return study


def study_resume(study: Study) -> Study:
    """Continue a paused study with its next trial."""
    with transaction.atomic():
        study = _locked(study)
        if study.status == S.RUNNING and study.pause_requested:
            study.pause_requested = False
            study.save(update_fields=["pause_requested"])
        elif study.status != S.PAUSED:
            raise ServiceError(f"The study is {study.get_status_display().lower()}, not paused.", code="not_paused")
        else:
            study.transition(S.RUNNING, pause_requested=False)
            study.save()
    publish(study)
    return study


def study_cancel(study: Study) -> Study:
    """Stop the study: the run in progress is cancelled, finished trials stay, the baseline is redeployed."""
    with transaction.atomic():
        study = _locked(study)
        if study.status not in Study.ACTIVE or study.status == S.FINISHING:
            raise ServiceError(f"The study is {study.get_status_display().lower()}.", code="not_running")
        study.cancel_requested = True
        if study.status == S.QUEUED:
            study.trials.filter(status=T.PENDING).update(status=T.SKIPPED, error="The study was cancelled.")
            study.transition(S.CANCELLED)
        elif study.status == S.PAUSED:
            study.transition(S.FINISHING)
        study.save()
    publish(study)
    return study


def study_apply(study: Study, variant: StudyVariant, user=None, persist: bool = False) -> Deployment:
    """Redeploy the deployment with a variant's settings (the winner, usually); optionally as a service."""
    if study.status not in Study.TERMINAL:
        raise ServiceError("The study is still running; apply a variant once it has finished.", code="busy")
    if variant.study_id != study.pk:
        raise ServiceError("That variant belongs to another study.", field="variant")
    if variant.failed:
        raise ServiceError(f"{variant.name} failed in the study: {variant.failed}", field="variant")
    args, env = variant_settings(study, variant)
    d = deploys.deployment_redeploy(study.deployment, engine_args=args, env=env, user=user)
    if persist:
        study.results = {**study.results, "persist_after_apply": variant.pk}
        Study.objects.filter(pk=study.pk).update(results=study.results)
    return d


# --- one step (benchmarks/studydriver.py takes one of each study in turn) ------------------------------

def study_step(study_id: int) -> Study:
    """Advance the study by at most one action; safe to call again at any time (idempotent)."""
    with transaction.atomic():
        study = Study.objects.select_for_update().select_related("deployment__node").get(pk=study_id)
        before = (study.status, list(study.trials.values_list("status", flat=True)))
        if study.status == S.QUEUED:
            study.transition(S.RUNNING)
            study.save()
        if study.status == S.RUNNING:
            _running(study)
        if study.status == S.FINISHING:
            _finishing(study)
        changed = before != (study.status, list(study.trials.values_list("status", flat=True)))
    if changed:
        publish(study)
    return study


def _running(study: Study) -> None:
    trial = study.trials.filter(status__in=StudyTrial.OPEN).select_related("variant", "run").first()
    results = None
    if trial is None and not study.cancel_requested:
        results = studyresults.compute(study)
        if studyrounds.another_round(study, results):
            return
    if study.cancel_requested or trial is None:
        study.trials.filter(status=T.PENDING).update(status=T.SKIPPED, error="The study was cancelled.")
        study.results = results or studyresults.compute(study)
        study.transition(S.FINISHING)
        study.save()
        return
    if trial.status == T.PENDING and study.pause_requested:
        study.transition(S.PAUSED, pause_requested=False)
        study.save()
        return
    _advance(study, trial)


def _agent_pid(study: Study) -> int | None:
    return type(study.deployment.node).objects.filter(pk=study.deployment.node_id).values_list("agent_pid", flat=True).first()


def _advance(study: Study, trial: StudyTrial) -> None:
    d = Deployment.objects.select_related("node", "model").get(pk=study.deployment_id)
    now = timezone.now()
    if trial.status == T.PENDING:
        if trial.variant.failed:
            _close(trial, T.SKIPPED, f"{trial.variant.name} failed earlier: {trial.variant.failed}")
            return
        if d.status in Deployment.IN_FLIGHT or d.benchmark_runs.filter(status__in=BenchmarkRun.ACTIVE).exists():
            return  # something else is deploying or measuring it: wait
        args, env = variant_settings(study, trial.variant)
        trial.started, trial.attempts, trial.agent_pid = now, trial.attempts + 1, _agent_pid(study)
        trial.ready_at = None
        try:
            deploys.deployment_redeploy(d, engine_args=args, env=env, user=study.created_by)
        except ServiceError as exc:
            _variant_failed(trial, exc.message)
            return
        trial.transition(T.DEPLOYING)
        trial.save()
        return
    agent_restarted = trial.agent_pid is not None and _agent_pid(study) != trial.agent_pid
    if trial.status == T.DEPLOYING:
        ours = d.ready_at and trial.started and d.ready_at >= trial.started
        if d.status == D.READY and ours and _smoke_tested(d, trial):
            trial.ready_at = d.ready_at
            trial.ready_s = round((now - trial.started).total_seconds(), 2)
            run = runs.run_create(params=study.workload, deployment=d, user=study.created_by,
                                  name=f"{study} · {trial.variant.name} · repeat {trial.repeat}")
            trial.transition(T.BENCHMARKING, run=run, agent_pid=_agent_pid(study))
            trial.save()
        elif d.status in Deployment.TERMINAL and d.stopped_at and trial.started and d.stopped_at >= trial.started:
            if agent_restarted and trial.attempts < MAX_ATTEMPTS:
                _retry(trial, "the node agent restarted during the redeploy")
            elif d.status == D.STOPPED:
                _close(trial, T.FAILED, "The deployment was stopped outside the study.")
            else:
                _variant_failed(trial, d.status_message or "the engine did not start")
        return
    run = trial.run
    if run is None:
        _retry(trial, "its benchmark run was deleted")
        return
    run.refresh_from_db()
    if run.status == BenchmarkRun.Status.DONE:
        _close(trial, T.DONE, "")
    elif run.status in BenchmarkRun.TERMINAL:
        d.refresh_from_db()
        if d.status == D.FAILED:
            _variant_failed(trial, f"the engine failed under load: {d.status_message or run.error}")
        else:
            _close(trial, T.FAILED, run.error or run.get_status_display())
    elif agent_restarted:
        runs.run_abandon(run, "The node agent restarted during the run.")
        if trial.attempts < MAX_ATTEMPTS:
            _retry(trial, "the node agent restarted during its benchmark")
        else:
            _close(trial, T.FAILED, "The node agent restarted during its benchmark, every attempt.")


def _smoke_tested(d: Deployment, trial: StudyTrial) -> bool:
    """The plan's last step (the smoke test) of this trial's load has ended: the benchmark may start."""
    return DeploymentEvent.objects.filter(deployment=d, step="smoke_test", started__gte=trial.started,
                                          ended__isnull=False).exists()


def _retry(trial: StudyTrial, why: str) -> None:
    trial.transition(T.PENDING, error=f"Run again: {why}.", run=None)
    trial.save()


def _close(trial: StudyTrial, status: str, error: str) -> None:
    trial.transition(status, error=error, finished=timezone.now())
    if trial.started:
        trial.startup, trial.overhead_s = studyresults.trial_times(trial)
    trial.save()


def _variant_failed(trial: StudyTrial, reason: str) -> None:
    StudyVariant.objects.filter(pk=trial.variant_id).update(failed=reason[:2000])
    trial.variant.failed = reason
    _close(trial, T.FAILED, reason)


def _finishing(study: Study) -> None:
    """Redeploy the baseline (or the winner, when asked), wait for it, and end the study."""
    d = Deployment.objects.select_related("node", "model").get(pk=study.deployment_id)
    fin = study.finish_trial or {}
    end = S.CANCELLED if study.cancel_requested else S.DONE
    study.trials.filter(status=T.PENDING).update(status=T.SKIPPED, error="The study was cancelled.")
    open_trial = study.trials.filter(status__in=(T.DEPLOYING, T.BENCHMARKING)).select_related("run", "variant").first()
    if open_trial is not None:  # cancelled mid-trial: let its run or redeploy settle first
        if open_trial.run and open_trial.run.status in BenchmarkRun.ACTIVE:
            if not open_trial.run.cancel_requested:
                runs.run_cancel(open_trial.run)
            return
        if d.status in Deployment.IN_FLIGHT:
            return
        _close(open_trial, T.FAILED, "The study was cancelled.")
        return
    if not study.results:
        study.results = studyresults.compute(study)
        study.save(update_fields=["results"])
    if fin.get("skip"):
        study.transition(end)
        study.save()
        return
    variant = studyresults.finishing_variant(study)
    args, env = variant_settings(study, variant) if variant else (study.base_engine_args, study.base_env)
    if not fin.get("sent"):
        if d.status in Deployment.IN_FLIGHT:
            return
        if d.status == D.READY and d.engine_args == args and d.env == env:
            study.transition(end)  # the last trial left it so: no need to load it again
            study.save()
            return
        sent = timezone.now()
        try:
            deploys.deployment_redeploy(d, engine_args=args, env=env, user=study.created_by)
        except ServiceError as exc:
            study.transition(S.FAILED, error=f"Could not redeploy {variant.name if variant else 'the baseline'}: {exc.message}")
            study.save()
            return
        study.finish_trial = {"variant": variant.pk if variant else None, "sent": sent.isoformat(),
                              "agent_pid": _agent_pid(study)}
        study.save(update_fields=["finish_trial"])
        return
    sent = datetime.fromisoformat(fin["sent"])
    if d.status == D.READY and d.ready_at and d.ready_at >= sent:
        study.transition(end)
        study.save()
    elif d.status in Deployment.TERMINAL and d.stopped_at and d.stopped_at >= sent:
        if fin.get("agent_pid") != _agent_pid(study):
            study.finish_trial = {**fin, "sent": None}  # the agent restarted: send the redeploy again
            study.save(update_fields=["finish_trial"])
            return
        study.transition(S.FAILED, error=f"The closing redeploy failed: {d.status_message}")
        study.save()


def persist_applied(node_id: int) -> None:
    """After "apply and persist": once the winner runs, ask the node to make it a systemd service."""
    for study in Study.objects.filter(deployment__node_id=node_id, status__in=Study.TERMINAL,
                                      results__has_key="persist_after_apply"):
        d = study.deployment
        if d.status == D.READY:
            study.results.pop("persist_after_apply")
            Study.objects.filter(pk=study.pk).update(results=study.results)
            try:
                deploys.deployment_persist(d)
            except ServiceError as exc:
                log.warning("study %s: could not persist %s: %s", study.pk, d.name, exc)


def publish(study: Study) -> None:
    payloads.send_study(study.pk, studyresults.study_live(Study.objects.get(pk=study.pk)))
