"""CPU of one usage answer (GET /api/usage/'s query) now that each row carries its share of its deployments' energy:
gateway_selectors.usage, which reads the usage at the (hour, deployment) grain and shares each hour's joules out by
output tokens, against the peer measured in the same run: the same sums done by the database alone at the period's
grain, as the query was before energy (no share). Rounds alternate the two.

    python perf/usage_energy.py [--keys 100] [--deployments 8] [--hours 48] [--rounds 20]

Every key used every deployment every hour, the worst case for the grain (keys x deployments x hours usage rows,
deployments x hours energy rows). CPU time of this process (time.process_time: SQLite runs in it), not wall time.
A panel of its own under a temporary folder (perf/inprocess.py: SQLite, embedded Redis)."""
import argparse
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from panelctl import launcher  # noqa: E402
from perf.inprocess import start_panel  # noqa: E402


def seed(keys: int, deployments: int, hours: int, now: datetime) -> int:
    from django.contrib.auth import get_user_model

    from deployments.gateway.models import CallerKey, Usage
    from deployments.models import Deployment, DeploymentEnergy, ModelRepo, Node

    node = Node.objects.create(name="usage-perf")
    model = ModelRepo.objects.create(repo_id="perf/usage")
    rows = [Deployment.objects.create(name=f"d{i}", node=node, model=model, port=9000 + i) for i in range(deployments)]
    owner = get_user_model().objects.create(username="usage-perf")
    callers = CallerKey.objects.bulk_create([CallerKey(owner=owner, name=f"k{i}", prefix=f"vcp-{i:05d}",
                                                       digest=f"{i:064d}") for i in range(keys)])
    first = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=hours - 1)
    usage, energy = [], []
    for h in range(hours):
        hour = first + timedelta(hours=h)
        for d in rows:
            energy.append(DeploymentEnergy(hour=hour, deployment=d, joules=2.0e6, seconds=3600, idle_joules=1.0e5,
                                           idle_seconds=600, output_tokens=keys * 300))
            usage += [Usage(hour=hour, key=k, model_name="m", deployment=d, requests=3, prompt_tokens=900,
                            reasoning_tokens=100, content_tokens=200) for k in callers]
    Usage.objects.bulk_create(usage, batch_size=5000)
    DeploymentEnergy.objects.bulk_create(energy, batch_size=5000)
    return len(usage)


def database_sums(group: str, by: str, days: int, now: datetime) -> list:
    """The peer: the usage sums at the period's grain by the database alone (the query before energy)."""
    from django.db.models import Sum

    from deployments.gateway import selectors
    from deployments.gateway.models import Usage

    since, until = selectors.window(by, days, now)
    rows = (Usage.objects.filter(hour__gte=since, hour__lt=until)
            .annotate(period=selectors.BY[by]("hour", tzinfo=timezone.utc)).values("period", *selectors.GROUPS[group])
            .annotate(**{m: Sum(m) for m in selectors.MEASURES}).order_by("period", *selectors.GROUPS[group]))
    return list(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--deployments", type=int, default=8)
    parser.add_argument("--hours", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    children = launcher.Children()
    try:
        start_panel(Path(tempfile.mkdtemp(prefix="usage-energy-")), children)
        from deployments.gateway import selectors

        now = datetime.now(timezone.utc)
        n = seed(args.keys, args.deployments, args.hours, now)
        days = max(1, -(-args.hours // 24))
        cases = {"with energy": lambda: selectors.usage("key", "hour", days, now=now),
                 "database sums": lambda: database_sums("key", "hour", days, now)}
        answers = {name: len(work()) for name, work in cases.items()}  # warm, and the same number of rows
        took: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(args.rounds):
            for name in (list(cases) if r % 2 == 0 else list(reversed(cases))):
                started = time.process_time()
                cases[name]()
                took[name].append((time.process_time() - started) * 1000)
        print(f"usage rows: {n:,} ({args.keys} keys x {args.deployments} deployments x {args.hours} hours); "
              f"answer rows: {answers}")
        for name, ms in took.items():
            print(f"{name:>14}: median {statistics.median(ms):.1f} ms CPU, p90 {statistics.quantiles(ms, n=10)[-1]:.1f} ms")
        ratio = statistics.median(took["with energy"]) / statistics.median(took["database sums"])
        print(f"ratio_with_energy_to_database_sums = {ratio:.2f}")
        print(f"per_usage_row_us = {statistics.median(took['with energy']) * 1000 / n:.2f}")
    finally:
        children.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
