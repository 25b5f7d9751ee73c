"""Unit tests of deployments.host.serveargv: the `vllm serve` argv, and the flags and version an engine reports."""
import os
import textwrap

import pytest

from deployments.host import serveargv
from deployments.host.processes import EngineError


def test_build_argv_turns_engine_args_into_flags_without_a_shell():
    argv = serveargv.build_argv("/venv/bin/vllm", "/models/llama", 8001, "0.0.0.0", {
        "tensor-parallel-size": 8, "enforce-eager": True, "max-model-len": 4096,
        "enable-prefix-caching": False, "kv-cache-dtype": None,
        "allowed-origins": ["a", "b"], "speculative-config": {"method": "ngram"},
        "served-model-name": "m; rm -rf /",
    })
    assert argv == [
        "/venv/bin/vllm", "serve", "/models/llama", "--host", "0.0.0.0", "--port", "8001",
        "--tensor-parallel-size", "8", "--enforce-eager", "--max-model-len", "4096",
        "--allowed-origins", "a", "b", "--speculative-config", '{"method": "ngram"}',
        "--served-model-name", "m; rm -rf /",
    ]


@pytest.mark.parametrize("name", ["port", "--host", "model", "bad flag", "x=1", "trust_remote_code", "Trust-Remote-Code",
                                  "--enforce-eager", "tp"])
def test_build_argv_refuses_reserved_malformed_or_non_canonical_flags(name):
    """The last line of defence: every way in canonicalises (flagpolicy); anything else is refused, not guessed."""
    with pytest.raises(EngineError) as err:
        serveargv.build_argv("vllm", "m", 8000, "127.0.0.1", {name: "1"})
    assert err.value.permanent


@pytest.mark.parametrize("value", ["--trust-remote-code", "-x", -1, "a\nb", ["ok", "--b"]])
def test_build_argv_refuses_a_value_that_would_read_as_another_flag_or_line(value):
    with pytest.raises(EngineError) as err:
        serveargv.build_argv("vllm", "m", 8000, "127.0.0.1", {"enforce-eager": value})
    assert err.value.permanent and "--enforce-eager" in str(err.value)


FLAGS = {"--tensor-parallel-size", "--enforce-eager", "--max-model-len", "--port", "--host",
         "--enable-prefix-caching", "--no-enable-prefix-caching", "--reasoning-parser"}


def test_validate_args_suggests_the_flag_a_typo_meant():
    errors = serveargv.validate_args(
        {"tensor-paralel-size": 2, "max_model_len": 4096, "enforce-eager": True,
         "frobnicate-everything": 1, "port": 9000}, FLAGS)
    assert set(errors) == {"tensor-paralel-size", "max_model_len", "frobnicate-everything", "port"}
    assert "canonical form" in errors["max_model_len"]
    assert "--tensor-paralel-size" in errors["tensor-paralel-size"]
    assert "did you mean --tensor-parallel-size?" in errors["tensor-paralel-size"]
    assert "did you mean" not in errors["frobnicate-everything"]
    assert "set by the panel" in errors["port"]


def test_engine_flags_parses_the_engines_own_help_once(tmp_path):
    calls = tmp_path / "calls"
    fake = tmp_path / "vllm"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1" = serve ] || exit 2
        echo x >> {calls}
        cat <<'EOF'
        usage: vllm serve [model_tag] [options]
        options:
          --port PORT           Port number. (default: 8000)
          --grpc                Launch the gRPC server on
                                --not-a-flag instead of the HTTP server.
          --tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE
          --enable-prefix-caching, --no-enable-prefix-caching
          -h, --help            show this help message and exit
        EOF
        """))
    fake.chmod(0o755)
    flags = serveargv.engine_flags(str(fake))
    assert flags == {"--port", "--grpc", "--tensor-parallel-size", "--enable-prefix-caching",
                     "--no-enable-prefix-caching", "--help"}
    serveargv.engine_flags(str(fake))
    assert calls.read_text().count("x") == 1


def test_engine_version_is_what_vllm_says_after_its_log_lines(tmp_path):
    fake = tmp_path / "vllm"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] || exit 2\n'
                    'echo "INFO 11-29 10:00:00 [__init__.py:1] Automatically detected platform cpu."\necho 0.32.0+cpu\n')
    fake.chmod(0o755)
    assert serveargv.engine_version(str(fake)) == "0.32.0+cpu"
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'Traceback (most recent call last):'\nexit 1\n")
    broken.chmod(0o755)
    assert serveargv.engine_version(str(broken)) == "" and serveargv.engine_version(str(tmp_path / "nope")) == ""


def test_engine_version_is_read_from_the_scripts_own_interpreter_without_running_vllm(tmp_path):
    """`vllm --version` imports vLLM (~15 s of CPU) to print its package metadata: the agent asks the
    interpreter of a pip-installed script for that metadata instead, and the CLI only when that fails."""
    python = tmp_path / "python3.11"
    python.write_text('#!/bin/sh\n[ "$1" = -c ] && case "$2" in *"version(\'vllm\')"*) echo 0.33.1+cpu; exit 0;; esac\n'
                      'exit 3\n')
    python.chmod(0o755)
    fake = tmp_path / "vllm"
    fake.write_text(f"#!{python}\nthis script must not run\n")
    fake.chmod(0o755)
    assert serveargv.engine_version(str(fake)) == "0.33.1+cpu"
    # That interpreter cannot tell (no metadata named vllm): what the CLI itself says.
    other = tmp_path / "other" / "python3"
    other.parent.mkdir()
    other.write_text('#!/bin/sh\n[ "$1" = -c ] && exit 1\n[ "$2" = --version ] && echo 0.32.0+cpu\n')
    other.chmod(0o755)
    cli = tmp_path / "other" / "vllm"
    cli.write_text(f"#!{other}\n")
    cli.chmod(0o755)
    assert serveargv.engine_version(str(cli)) == "0.32.0+cpu"


def test_engine_flags_of_a_missing_engine_is_a_permanent_error(tmp_path):
    with pytest.raises(EngineError) as err:
        serveargv.engine_flags(str(tmp_path / "nope"))
    assert err.value.permanent


def test_engine_flags_are_kept_on_disk_per_binary_and_version_for_the_next_agent(tmp_path, monkeypatch):
    """A new agent process (no in-process cache) reads the flags an earlier one learnt, until the binary or
    its version changes."""
    monkeypatch.setenv("PANEL_CACHE_DIR", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    fake = tmp_path / "vllm"
    script = ('#!/bin/sh\n[ "$1" = --version ] && { echo {version}; exit 0; }\necho x >> ' + str(calls) +
              '\nprintf "options:\\n  --port PORT\\n  --max-num-seqs N\\n"\n')
    fake.write_text(script.replace("{version}", "0.32.0+cpu"))
    fake.chmod(0o755)
    assert serveargv.engine_flags(str(fake)) == {"--port", "--max-num-seqs"}
    serveargv._flags_cached.cache_clear()  # as in a new process
    serveargv._flags_kept.cache_clear()
    assert serveargv.engine_flags(str(fake)) == {"--port", "--max-num-seqs"}
    assert calls.read_text().count("x") == 1
    # An upgrade (new script, new version): asked again.
    os.utime(fake, (1, 1))
    fake.write_text(script.replace("{version}", "0.33.0+cpu"))
    serveargv._flags_cached.cache_clear()
    serveargv._flags_kept.cache_clear()
    serveargv._version_cached.cache_clear()
    assert serveargv.engine_flags(str(fake)) == {"--port", "--max-num-seqs"}
    assert calls.read_text().count("x") == 2
