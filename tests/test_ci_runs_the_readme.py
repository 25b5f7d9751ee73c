"""CI runs the tests the README names: the README's test command, as the README writes it, is a command line of
.ci/run (not a comment, not a pytest call of its own), and what that command leaves out is what the README says it
leaves out (tests/gpu, collected only on a GPU host)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_command() -> str:
    block = re.search(r"## Two commands\n\n```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return next(line for line in block.splitlines() if line.startswith("./panel test"))


def test_ci_runs_the_readmes_test_command_as_the_readme_writes_it():
    command = _readme_command()
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in lines, f"{command!r} is not a line of .ci/run"
    runs = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
    assert not [line for line in runs if re.search(r"\bpytest\b", line)], "CI calls pytest other than through ./panel test"
    # The first test run is the README's; the others are `./panel test` again with arguments, on PostgreSQL.
    tests = [line for line in runs if line.startswith("./panel test")]
    assert tests[0] == command and all(line.startswith("./panel test ") for line in tests[1:]), tests


def test_what_the_readmes_command_leaves_out_is_what_the_readme_says():
    from tests import conftest

    assert conftest.collect_ignore == ["gpu"]
    assert "but the real-GPU checks in `tests/gpu`" in (ROOT / "README.md").read_text()
