"""Values in a generated systemd unit stay values: no variable expansion, no specifiers, no new settings."""
import pytest

from deployments.host import systemd


def _unit(argv, env=None):
    return systemd.render_unit(description="vLLM d", argv=argv, env=env or {}, log_path="/var/log/x.log")


def _exec_start(text):
    return next(line for line in text.splitlines() if line.startswith("ExecStart="))


@pytest.mark.parametrize("value, written", [
    ("$HOME", '"$$HOME"'), ("${SECRET_KEY}", '"$${SECRET_KEY}"'), ("%h/x", '"%%h/x"'),
    ('a"b', '"a\\"b"'), ("a\\b", '"a\\\\b"'), ("it's", '"it\'s"'), ("two words", '"two words"'),
])
def test_an_engine_argument_reaches_execstart_literally(value, written):
    line = _exec_start(_unit(["vllm", "serve", "m", "--served-model-name", value]))
    assert line.endswith(" " + written)


def test_environment_values_escape_specifiers_and_quotes():
    text = _unit(["vllm"], {"NCCL_X": '50%"$HOME'})
    assert 'Environment="NCCL_X=50%%\\"$HOME"' in text.splitlines()


@pytest.mark.parametrize("bad", ["x\nExecStartPre=/bin/touch /tmp/pwned", "x\rY", "x\0"])
def test_a_line_break_cannot_add_a_setting(bad):
    with pytest.raises(systemd.SystemdError):
        _unit(["vllm", bad])
    with pytest.raises(systemd.SystemdError):
        _unit(["vllm"], {"NCCL_X": bad})
