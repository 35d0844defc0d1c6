"""The helpers every benchmark script shares: a log line, a free port, and the before/after runner.

Standard library only, on purpose: the before/after tools (``bench_host.py``, ``bench_planner.py``) run
a copy of themselves, with this module, inside a worktree of an older commit whose ``asyncbatch`` may lack
anything newer; so this module imports nothing of the package. What needs the package (the machine's
description, writing a results JSON) is ``asyncbatch.bench.report``.

Before/after::

    with ref_worktree("8a388b8", [Path(__file__), COMMON]) as tree:
        doc = run_in_tree(tree, Path(__file__), ["--child", ...], timeout_s=600)

The script runs in a fresh interpreter with ``PYTHONPATH`` = that tree, from that tree's copy, so it
imports the old package and the same measuring code on both sides.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: scripts/harness/common.py
COMMON = Path(__file__).resolve()


def log(message: str) -> None:
    """A progress line on stderr (stdout carries the tables)."""
    print(message, file=sys.stderr, flush=True)


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first paragraph as the description, the whole as the epilog."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (another process could still take it before the server binds;
    the server then fails to start and says so in its log)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def git(*args: str, cwd: Path = ROOT) -> str:
    """``git -C cwd ARGS``'s output; raises ``CalledProcessError`` when git fails."""
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


@contextlib.contextmanager
def ref_worktree(ref: str, files: list[Path]) -> Iterator[Path]:
    """A detached worktree of ``ref`` holding copies of ``files`` (paths in this checkout) at the same
    places: old revisions lack them, and the same measuring code must run on both sides."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-ref-"))
    tree = tmp / "tree"
    try:
        git("worktree", "add", "--detach", str(tree), ref)
        for path in files:
            target = tree / path.resolve().relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        yield tree
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            git("worktree", "prune")


def run_in_tree(tree: Path, script: Path, args: list[str], timeout_s: float | None = None
                ) -> subprocess.CompletedProcess:
    """``tree``'s copy of ``script`` (a path in this checkout) with ``args``, in a fresh interpreter that
    imports ``tree``'s package; output captured. Raises ``TimeoutExpired`` past ``timeout_s``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    target = tree / script.resolve().relative_to(ROOT)
    return subprocess.run([sys.executable, str(target), *args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (all their threads), from /proc; 0.0 for a pid
    that cannot be read (gone, or not Linux)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total
