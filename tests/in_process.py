"""Run a program as ``python script.py ARGS`` or ``python -m module ARGS`` would, inside the test worker.

Why: a fresh interpreter costs ~5 s of CPU to import torch and transformers, and its first engine another
~5 s for the fork server that starts its core process; on the 2-core CI machine the suite is CPU-bound, so
the dozen end-to-end program runs paid ~2 minutes of imports. The worker has both warm. What an in-process
run does not exercise -- that the program starts and parses its arguments in a fresh interpreter -- is
checked for every program the docs show by ``test_readme_commands.py``'s ``--help`` run.

Each run gets the program's own ``sys.argv``, working directory, ``sys.path`` and ``__main__`` name, and
leaves the worker as it found it: environment, torch's thread count, signal handlers, logging and
``sys.path`` are put back. What the program prints through ``sys.stdout`` / ``sys.stderr`` is captured;
child processes it starts write to the worker's own file descriptors (pytest captures those).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import runpy
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Completed:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would return; ``returncode`` 1 with the
    traceback in ``stderr`` for an exception that escaped the program."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _restored_process_state(cwd: Path):
    environ, path, argv, threads = dict(os.environ), list(sys.path), list(sys.argv), torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    root = logging.getLogger()
    log_state = (list(root.handlers), root.level)
    old_cwd = os.getcwd()
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:], sys.argv[:] = path, argv
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        root.handlers[:], root.level = log_state


def run_program(argv: list[str], cwd: Path = ROOT) -> Completed:
    """``argv`` as given to ``subprocess.run``: ``[python, "-m", module, *args]`` or ``[python, path, *args]``
    (``python`` is ignored; this interpreter runs it)."""
    if argv[1] == "-m":
        module, args = argv[2], argv[3:]
        program_argv = [module, *args]
    else:
        script, args = str(Path(cwd, argv[1])), argv[2:]
        program_argv = [script, *args]
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with _restored_process_state(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        sys.argv[:] = program_argv
        try:
            if argv[1] == "-m":
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, str(Path(script).parent))  # what ``python script.py`` puts first
                runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if isinstance(exc.code, str):
                err.write(exc.code + "\n")
        except Exception:  # noqa: BLE001 -- the program's crash is its result, as a subprocess's would be
            code = 1
            err.write(traceback.format_exc())
    return Completed(list(argv), code, out.getvalue(), err.getvalue())
