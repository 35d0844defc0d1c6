"""The command line speaks to people: a user's mistake is one line naming the option, exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncbatch.cli.main import USAGE_ERROR, build_parser, main
from asyncbatch.cli.serve import _model_settings_kwargs
from asyncbatch.config import EngineConfig


@pytest.mark.parametrize(("argv", "option"), [
    (["generate", "--prompt", "hi", "--temperature", "-1", "--device", "sim"], "--temperature"),
    (["generate", "--prompt", "hi", "--max-tokens", "0", "--device", "sim"], "--max-tokens"),
    (["generate", "--prompt", "hi", "--max-tokens", "100000", "--device", "sim"], "--max-tokens"),  # past the context
    (["generate", "--prompt", "hi " * 9000, "--device", "sim"], "--prompt"),  # no room left for an output
    (["generate", "--prompt", "", "--device", "sim"], "--prompt"),
    (["generate", "--chat", "", "--device", "sim"], "--chat"),
    (["generate", "--prompt", "hi", "--model", "/nonexistent/model", "--device", "sim"], "--model"),
    (["generate", "--prompt", "hi", "--max-num-seqs", "0", "--device", "sim"], "--max-num-seqs"),
])
def test_user_errors_are_one_line_naming_the_option(capsys, argv, option):
    assert main(argv) == USAGE_ERROR
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"asyncbatch generate: error: {option}: "), err


@pytest.mark.parametrize(("argv", "message"), [
    (["profile", "--num-requests", "0"], "argument --num-requests: expected an integer >= 1, got '0'"),
    (["profile", "--request-rate", "-1"], "argument --request-rate: expected a float >= 0, got '-1'"),
    (["profile", "--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
    (["demo", "--rounds", "0"], "argument --rounds: expected an integer >= 1, got '0'"),
    (["demo", "--num-requests", "x"], "argument --num-requests: expected an integer >= 1, got 'x'"),
    (["generate", "--prompt", "hi", "--speculative-config", "{bad"], "argument --speculative-config: not valid JSON"),
])
def test_counts_rates_and_json_options_are_checked_when_parsed(capsys, argv, message):
    """Counts that must be at least one, rates that may not be negative and JSON options are usage errors (exit
    2, no traceback), not a crash after the engine started (a profile of 0 requests died in its report)."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*argv, "--device", "sim"])
    assert exited.value.code == USAGE_ERROR
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="temperature"):
        main(["--debug", "generate", "--prompt", "hi", "--temperature", "-1", "--device", "sim"])


def test_an_unknown_option_is_argparse_s_usage_error():
    proc = subprocess.run([sys.executable, "-m", "asyncbatch", "generate", "--prompt", "hi", "--bogus"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == USAGE_ERROR and "unrecognized arguments: --bogus" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("flag", "warm"), [([], True), (["--no-structured-outputs-warmup"], False)])
def test_serve_builds_the_grammar_compiler_at_start_unless_told_not_to(flag, warm):
    """A server's first structured request should not wait for the grammar compiler; ``LLM`` leaves it off."""
    class Settings:
        def __init__(self, *args, **kwargs) -> None:
            pass

    args = build_parser().parse_args(["serve", "--device", "sim", *flag])
    _, _, kwargs = _model_settings_kwargs(args, Settings)
    assert kwargs["structured_outputs_warmup"] is warm
    assert EngineConfig.from_kwargs(**kwargs).structured_outputs_warmup is warm
    assert EngineConfig(device="sim").structured_outputs_warmup is False
    with pytest.raises(TypeError, match="structured_outputs_warmup must be a bool"):
        EngineConfig(device="sim", structured_outputs_warmup="yes")
