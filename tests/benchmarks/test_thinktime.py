"""A multi-turn workload's think time as a distribution: fixed (think_s), exponential (mean think_s) or uniform
(think_min_s to think_max_s), seeded by think_seed; taken by the API, the workloads page and panelctl workload
add, and shown in the preview as the spread of its seeded draws."""
import random

import pytest

from benchmarks import workloads
from benchmarks.models import Workload
from panelctl import cli
from plumbing import tokens

pytestmark = pytest.mark.django_db


def draws(seed, how, n=2000, **params):
    rng = [random.Random(f"{seed}/think/{i}") for i in range(1, n + 1)]
    if how == "exponential":
        return sorted(r.expovariate(1 / params["mean"]) for r in rng)
    return sorted(r.uniform(params["low"], params["high"]) for r in rng)


def test_the_api_takes_an_exponential_think_time_and_previews_its_seeded_draws(api):
    made = api.post("/api/workloads/", {"name": "chats", "kind": "multiturn", "turns": 3, "think_s": 2.0,
                                        "think": "exponential", "think_seed": 7}, format="json")
    assert made.status_code == 201, made.json()
    body = made.json()
    assert body["settings"] == {"turns": 3, "think_s": 2.0, "think": "exponential", "think_seed": 7}
    assert body["preview"] == {}  # made by the control worker, not in the request
    workloads.workload_preview(body["id"])
    expected = draws(7, "exponential", mean=2.0)
    think = api.get(f"/api/workloads/{body['id']}/").json()["preview"]["think"]
    assert think["think"] == "exponential" and think["think_seed"] == 7
    assert think["drawn_s"]["p50"] == round(expected[1000], 3) and think["drawn_s"]["p90"] == round(expected[1800], 3)
    assert think["drawn_s"]["mean"] == round(sum(expected) / 2000, 3)


@pytest.mark.parametrize("body, field, says", [
    ({"think": "uniform", "think_min_s": 3, "think_max_s": 1}, "think_min_s", "not be above think_max_s"),
    ({"think": "uniform", "think_min_s": 1}, "think_max_s", "from 0 to 600"),
    ({"think": "gaussian"}, "think", "not a valid choice"),
])
def test_a_think_time_that_cannot_be_drawn_is_refused_naming_the_field(api, body, field, says):
    answer = api.post("/api/workloads/", {"name": "x", "kind": "multiturn", "turns": 2, "think_s": 1, **body},
                      format="json")
    assert answer.status_code == 400
    assert says in answer.json()["error"]["fields"][field][0]
    assert not Workload.objects.exists()


def test_a_fixed_think_time_keeps_the_spec_as_before():
    w = workloads.workload_create(name="fixed", kind="multiturn", values={"turns": 2, "think_s": 1.5, "think": "fixed"})
    assert w.spec == {"kind": "multiturn", "turns": 2, "think_s": 1.5}
    assert workloads.workload_preview(w.pk)["think"] == {"think": "fixed", "think_s": 1.5}


def test_the_workloads_page_takes_a_uniform_think_time_and_shows_its_draws(operator_client):
    answer = operator_client.post("/benchmarks/workloads/", {
        "name": "chats", "kind": "multiturn", "turns": 3, "think": "uniform", "think_min_s": 1, "think_max_s": 5,
        "think_seed": 3, "input_tokens": 50, "max_tokens": 20})
    assert answer.status_code == 302, answer.content.decode()[-2000:]
    w = Workload.objects.get()
    assert w.spec["think"] == "uniform" and (w.spec["think_min_s"], w.spec["think_max_s"], w.spec["think_seed"]) == (1, 5, 3)
    expected = draws(3, "uniform", low=1.0, high=5.0)
    assert "Preview being made" in operator_client.get("/benchmarks/workloads/").content.decode()
    workloads.workload_preview(w.pk)
    page = operator_client.get("/benchmarks/workloads/").content.decode()
    assert f"think uniform 1.0-5.0 s (seed 3; drawn p10 {round(expected[200], 3)}, p50 {round(expected[1000], 3)}" in page


def test_panelctl_workload_add_takes_a_think_distribution(live_server_asgi, operator, capsys):
    login = ["--url", live_server_asgi, "--token", tokens.issue(operator)]
    assert cli.main([*login, "workload", "add", "chats", "--kind", "multiturn", "--turns", "3", "--think", "uniform",
                     "--think-min-s", "0.5", "--think-max-s", "1.5", "--think-seed", "9"]) == 0
    assert "preview being made" in capsys.readouterr().out
    workloads.workload_preview(Workload.objects.get().pk)  # the control worker's task
    assert cli.main([*login, "workloads"]) == 0
    expected = draws(9, "uniform", low=0.5, high=1.5)
    assert f"think uniform (drawn p10 {round(expected[200], 3):g}, p50 {round(expected[1000], 3):g}" in capsys.readouterr().out
    assert Workload.objects.get().spec["think_seed"] == 9
