"""Facts about the host for report headers: the CPU's name and the checkout's commit."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    fallback = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), fallback)
    except OSError:
        return fallback


def git_commit(mark_dirty: bool = False) -> str | None:
    """Short hash of this checkout's HEAD (None outside a git checkout); ``mark_dirty`` appends
    " + uncommitted changes" when the working tree differs from it."""
    try:
        commit = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        if commit and mark_dirty and subprocess.run(["git", "-C", str(_REPO), "status", "--porcelain"],
                                                    capture_output=True, text=True, check=False,
                                                    timeout=10).stdout.strip():
            commit += " + uncommitted changes"
        return commit or None
    except (OSError, subprocess.SubprocessError):
        return None
