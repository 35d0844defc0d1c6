"""The command line speaks to people: a user's mistake is one line naming the option, exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncbatch.cli.main import USAGE_ERROR, main


@pytest.mark.parametrize(("argv", "option"), [
    (["generate", "--prompt", "hi", "--temperature", "-1", "--device", "sim"], "--temperature"),
    (["generate", "--prompt", "hi", "--max-tokens", "0", "--device", "sim"], "--max-tokens"),
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


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="temperature"):
        main(["--debug", "generate", "--prompt", "hi", "--temperature", "-1", "--device", "sim"])


def test_an_unknown_option_is_argparse_s_usage_error():
    proc = subprocess.run([sys.executable, "-m", "asyncbatch", "generate", "--prompt", "hi", "--bogus"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == USAGE_ERROR and "unrecognized arguments: --bogus" in proc.stderr
    assert "Traceback" not in proc.stderr
