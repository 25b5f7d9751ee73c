"""A study's trials in rounds: the order a round runs the variants in, and an adaptive study's next round, added
while a variant is undecided on the rule's figure and rounds are left (benchmarks/studies.py drives them)."""
import random

from django.db.models import Max

from benchmarks import studyresults
from benchmarks.models import Study, StudyTrial


def schedule(n_variants: int, repeats: int, order: str, seed: int = 0) -> list[tuple[int, int]]:
    """(variant position, repeat) in the order trials run: A B C A B C …; mirrored, A B C C B A … (steady drift favours
    no variant, and even repeats end on the baseline: no closing reload); or each block shuffled."""
    rng = random.Random(seed)
    out = []
    for repeat in range(1, repeats + 1):
        block = list(range(n_variants))
        if order == "random_blocks":
            rng.shuffle(block)
        elif order == "mirrored" and repeat % 2 == 0:
            block.reverse()
        out += [(v, repeat) for v in block]
    return out


def another_round(study: Study, results: dict) -> bool:
    """An adaptive study judged after its last round (`results`, studyresults.compute's, gains "adaptive": what was
    judged and why it stops): a variant still undecided on the rule's figure and rounds left under max_repeats add the
    next round's trials and keep the look's results on the study (True); else it is done (False)."""
    if study.max_repeats <= study.repeats:
        return False
    done = study.trials.aggregate(n=Max("repeat"))["n"] or 0
    waiting = studyresults.undecided(results)
    more = bool(waiting) and study.repeats <= done < study.max_repeats
    results["adaptive"] = {"repeats": study.repeats, "max_repeats": study.max_repeats, "repeats_done": done,
                           "undecided": waiting, "z": results.get("z"),
                           "stopped": "" if more else "at the cap" if waiting else "every variant decided"}
    if not more:
        return False
    variants = list(study.variants.order_by("position"))
    first = study.trials.aggregate(n=Max("position"))["n"] + 1
    block = [(v, r) for v, r in schedule(len(variants), done + 1, study.order, seed=study.pk) if r == done + 1]
    StudyTrial.objects.bulk_create([StudyTrial(study=study, variant=variants[v], position=first + i, repeat=r)
                                    for i, (v, r) in enumerate(block)])
    study.results = results  # the look's figures, on the page while the next round runs
    study.save(update_fields=["results"])
    return True
