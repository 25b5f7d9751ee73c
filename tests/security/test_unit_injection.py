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


def test_root_never_takes_a_stored_unit_name_for_a_path():
    """Root unlinks `<unit dir>/<name>` and asks systemctl about it: a name an admin's edit put in the database
    (`../../etc/passwd`, another service's) is refused before anything runs, and the admin form cannot set it."""
    from unittest import mock

    from deployments.admin import DeploymentAdmin

    with mock.patch("deployments.host.systemd.systemctl", autospec=True) as called:
        for name in ("../../etc/passwd", "sshd.service", "vllm-x.service/../../y.service", "", "vllm-x.timer"):
            for act in (systemd.uninstall, systemd.disable, systemd.stop, systemd.start, systemd.main_pid):
                with pytest.raises(systemd.SystemdError, match="is not a unit name of the panel's"):
                    act(name)
        assert not called.called
    assert {"systemd_unit", "log_path"} <= set(DeploymentAdmin.readonly_fields)
