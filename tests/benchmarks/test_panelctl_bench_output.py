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
