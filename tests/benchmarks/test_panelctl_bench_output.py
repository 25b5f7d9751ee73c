"""panelctl bench's lines say what was measured: a level with no TPOT (every token came in one read)
prints a dash, never a made-up 0.00, a level measured on GPUs says its joules per output token, and a finished run
says where it saturated, as the run page and the API do."""
from panelctl import cli, runs

POINT = {"concurrency": 1, "output_throughput": 120.0, "ttft_ms": {"median": 41.5}, "tpot_ms": {},
         "tok_s_per_user": 0.0, "prompt_tokens_requested": 32, "prompt_tokens_mean": 32.0}
RUN = {"id": 7, "params": {"levels": [1, 2]}, "status": "done", "warnings": [], "single_stream_tok_s": None,
       "error": "", "saturation": {"level": 2, "reason": "throughput", "text": "Saturated at c=2: output throughput rose 1 %."}}


class Panel:
    """The API's answers for one finished run (the shapes GET /api/runs/{id}/ and its points give)."""

    def post(self, path, body, key=None):
        return {**RUN, "status": "queued"}

    def get(self, path):
        if path.endswith("points/"):
            return [POINT, {**POINT, "concurrency": 2, "tpot_ms": {"median": 5.17}, "energy_j": 1234.5, "output_tokens": 1000,
                             "watts_per_gpu": 612.0, "energy_net_j": 834.5}]
        return RUN


def test_a_level_without_tpot_prints_a_dash_and_the_run_says_where_it_saturated(capsys):
    # Parsed as panelctl parses it, so the test keeps up with the command's options.
    args = cli.parser().parse_args(["bench", "http://e:8000", "--model", "m", "--concurrency", "1,2",
                                    "--max-tokens", "16", "--input-tokens", "32", "--requests-per-user", "1", "--wait",
                                    "--timeout", "5"])
    assert runs.cmd_bench(Panel(), args) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip().startswith("c=")]
    assert "TPOT — ms" in lines[0] and "0.00" not in lines[0], lines
    assert "TPOT 5.17 ms" in lines[1] and "TTFT 41.5 ms" in lines[0]
    assert "Saturated at c=2" in err
    energy = [line.strip() for line in err.splitlines() if line.strip().startswith("energy")]
    assert energy == ["energy 1.234 J per output token, 0.835 net of idle (1,234 J, 612 W per GPU)"]  # c=2 only: c=1 measured none


def test_a_rate_level_is_named_by_its_rate_not_as_concurrency_0(capsys):
    class Rates(Panel):
        def get(self, path):
            if path.endswith("points/"):
                return [{**POINT, "kind": "rate", "rate": 4.0, "concurrency": 0, "achieved_rate": 3.98,
                         "lag_ms": {"p99": 1.5}, "slot_wait_ms": {}}]
            return RUN

    args = cli.parser().parse_args(["bench", "http://e:8000", "--model", "m", "--rate", "4", "--wait", "--timeout", "5"])
    assert runs.cmd_bench(Rates(), args) == 0
    err = capsys.readouterr().err
    assert "  4 req/s " in err and "c=0" not in err, err


def test_a_run_of_repeats_names_each_repeat_and_says_each_levels_median_with_its_interval(capsys):
    figures = {"throughput": {"median": 1005.0, "low": 990.25, "high": 1021.5, "why": ""}}
    few = {"throughput": {"median": 1050.0, "low": None, "high": None, "why": "too few repeats to judge: 2 repeats"}}

    class Repeats(Panel):
        def get(self, path):
            if path.endswith("points/"):
                return [{**POINT, "repeat": r} for r in range(3)]
            return {**RUN, "over_repeats": [{"label": "c=1", "repeats": 3, "figures": figures},
                                            {"label": "c=2", "repeats": 2, "figures": few}]}

    args = cli.parser().parse_args(["bench", "http://e:8000", "--model", "m", "--concurrency", "1", "--repeats", "3",
                                    "--wait", "--timeout", "5"])
    assert runs.cmd_bench(Repeats(), args) == 0
    err = capsys.readouterr().err
    assert [line.split()[0:2] for line in err.splitlines() if line.strip().startswith("c=1 ")] == [
        ["c=1", "120.0"], ["c=1", "#2"], ["c=1", "#3"], ["c=1", "over"]]
    assert "c=1 over 3 repeats: 1,005.0 output tok/s median (95 % interval 990.2 to 1,021.5)" in err
    assert "c=2 over 2 repeats: 1,050.0 output tok/s median (too few repeats to judge: 2 repeats)" in err
