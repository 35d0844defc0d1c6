"""The local Ray this process started, and making sure none of it outlives the server.

``ray.shutdown()`` stops the processes the driver started itself (GCS, raylet, dashboard, log monitor), but
not always what the raylet started: Ray's ``DashboardAgent`` and ``RuntimeEnvAgent`` were seen alive 80 s
after the server was gone, ignoring SIGTERM. So before shutting Ray down, the server takes a snapshot of its
own process tree (every Ray process it started descends from it: the raylet's agents and workers, and the
replicas' engine-core processes under those), and after ``ray.shutdown()`` it ends whatever of that
snapshot still runs: SIGTERM, a grace period, then SIGKILL.

Only for a Ray this process started. With ``--address`` (a cluster someone else runs) nothing is killed:
the server removes its own Serve application and disconnects (``lifecycle``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import psutil
import ray

log = logging.getLogger("asyncbatch.cluster")


@dataclass(frozen=True, slots=True)
class Leftovers:
    terminated: list[str]  # "name(pid)" of processes that needed SIGTERM after ray.shutdown
    killed: list[str]  # ... and of those, the ones that needed SIGKILL


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:  # is_running also checks the pid's reuse
                out.append(p)
        except psutil.Error:
            pass
    return out


def _label(p: psutil.Process) -> str:
    try:
        return f"{p.name()}({p.pid})"
    except psutil.Error:
        return f"?({p.pid})"


def end_processes(procs: list[psutil.Process], grace_s: float = 5.0, term_s: float = 5.0) -> Leftovers:
    """Wait up to ``grace_s`` for ``procs`` to exit by themselves, SIGTERM the rest and wait ``term_s``,
    then SIGKILL what remains. Returns who needed which."""
    _, alive = psutil.wait_procs(_alive(procs), timeout=grace_s)
    terminated = [_label(p) for p in alive]
    _send(alive, psutil.Process.terminate)
    _, alive = psutil.wait_procs(alive, timeout=term_s)
    killed = [_label(p) for p in alive]
    _send(alive, psutil.Process.kill)
    psutil.wait_procs(alive, timeout=5.0)
    return Leftovers(terminated, killed)


def _send(procs: list[psutil.Process], signal_one) -> None:
    """``signal_one(p)`` (``terminate`` or ``kill``) for each of ``procs``; one that is gone already is skipped."""
    for p in procs:
        try:
            signal_one(p)
        except psutil.Error:
            pass


def shutdown_owned_ray(grace_s: float = 5.0, term_s: float = 5.0) -> Leftovers:
    """``ray.shutdown()``, then end every process this one started that is still running (see the module
    docstring). Call only when this process started the local Ray."""
    before = descendants()
    ray.shutdown()
    # A process started while Ray shut down (a worker the raylet was starting) is in the tree too.
    seen = {p.pid for p in before}
    left = end_processes(before + [p for p in descendants() if p.pid not in seen], grace_s, term_s)
    if left.terminated:
        log.info("after ray.shutdown(), %d processes of this server's Ray needed SIGTERM: %s%s",
                 len(left.terminated), ", ".join(left.terminated),
                 f"; SIGKILL: {', '.join(left.killed)}" if left.killed else "")
    return left
