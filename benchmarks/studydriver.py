"""The node agent's study driver: one step of every study its deployments are in, each on its own (one broken study
stops neither the others nor the agent).

A step that fails the same way STEP_FAILURES times in a row fails its study, with the error: a deterministic fault
(the statistics given a figure they could not take, math.log(0)) was retried every few seconds forever and the study
stayed "running". The database being away is not the study's fault: its steps wait for it."""
import logging

from django.db import DatabaseError, transaction

from benchmarks import studies
from benchmarks.models import Study

log = logging.getLogger(__name__)
STEP_FAILURES = 5
_failures: dict[int, tuple[str, int]] = {}  # study id -> (the last step's error, how many times in a row)


def studies_drive(node_id: int) -> int:
    """One step of every study the node's deployments are in; returns how many were stepped."""
    ids = list(Study.objects.filter(deployment__node_id=node_id, status__in=Study.DRIVEN).values_list("pk", flat=True))
    for pk in ids:
        try:
            studies.study_step(pk)
            _failures.pop(pk, None)
        except DatabaseError:
            log.warning("study %s: the database did not answer; the step is taken again", pk, exc_info=True)
        except Exception as exc:  # noqa: BLE001 - one broken study must not stop the others, nor the agent
            why = f"{type(exc).__name__}: {exc}"
            last, times = _failures.get(pk, ("", 0))
            times = times + 1 if why == last else 1
            _failures[pk] = (why, times)
            log.exception("study %s: step failed (%d in a row)", pk, times)
            if times >= STEP_FAILURES:
                _failures.pop(pk, None)
                _fail(pk, f"A step failed {times} times in a row with the same error, so the study stopped: {why}")
    studies.persist_applied(node_id)
    return len(ids)


def _fail(study_id: int, message: str) -> None:
    with transaction.atomic():
        study = Study.objects.select_for_update().get(pk=study_id)
        if study.status not in Study.DRIVEN:
            return
        study.transition(Study.Status.FAILED, error=message[:2000])
        study.save()
    studies.publish(study)
