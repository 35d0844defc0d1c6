"""``asyncbatch serve --replicas N`` from start to exit: start (or join) Ray, deploy, serve until a stop
signal, drain, and leave nothing running that this process started.

    start ──► Ray (local: started here, owned; --address: joined) ──► deploy ──► serving
    SIGTERM / SIGINT ─► ingress.drain(--shutdown-timeout): /health 503, new requests 503;
                        in-flight streams finish, or at the timeout end with finish_reason "abort" + [DONE]
                        (a 2nd signal: abort them now)
                   ─► owned Ray:  serve.shutdown(), ray.shutdown(), then SIGTERM/SIGKILL whatever of this
                                  process's tree still runs (ray_processes) ─► exit 0
                   ─► joined Ray: serve.delete(our application), disconnect; the cluster keeps running ─► exit 0

A stop signal while Ray starts tears down what was started. One while the application deploys is acted on
once it runs (the ingress may already have taken requests: they are drained); a second one then leaves the
deploy at once. The exit status is 0 after a drain, as for the single-engine server (``serve.server``).
"""

from __future__ import annotations

import logging
import sys
import time

import ray
from ray import serve

from asyncbatch.cluster import launch
from asyncbatch.cluster.ingress import ABORTED_END_S
from asyncbatch.cluster.ray_processes import shutdown_owned_ray
from asyncbatch.cluster.stop_signals import StopSignals
from asyncbatch.serve.settings import ServeSettings

log = logging.getLogger("asyncbatch.cluster")

DRAIN_SLACK_S = 30.0  # beyond the drain's own bounds, before the server stops waiting for the ingress


class StopDuringStart(BaseException):
    """A stop signal arrived while Ray or the application was starting: leave the start, tear down."""


def serve_until_stopped(spec: launch.ClusterSpec, model: str | None, engine_kwargs: dict,
                        settings: ServeSettings, host: str, port: int, address: str | None = None) -> int:
    """Run the cluster server until SIGTERM or SIGINT (see the module docstring); returns the exit status."""
    signals = StopSignals()
    # Known before ray.init: a stop during ray.init must still end the processes it started.
    owned = address is None and not ray.is_initialized()
    signals.interrupt = StopDuringStart
    signals.install()
    try:
        try:
            launch.start_ray(address, spec.num_replicas, spec.replica_num_cpus)
            signals.install()  # ray.init replaced SIGTERM's handler with one that aborts the process
            if signals.requested:
                raise StopDuringStart
            signals.interrupt_at = 2
            launch.deploy(spec, model, engine_kwargs, settings, host, port)
            signals.interrupt = None
        except StopDuringStart:
            log.info("stop signal %s during the start: shutting down", signals.last)
            return 0
        print(f"asyncbatch serve: {settings.served_model_names[0]} on http://{host}:{port}, {spec.num_replicas} "
              f"replicas on Ray Serve (OpenAI API under /v1; /health, /metrics)", file=sys.stderr, flush=True)
        while not signals.wait(0.5):
            pass
        log.info("stop signal %s: draining (up to %.0f s)", signals.last, settings.shutdown_timeout_s)
        report = drain(signals, settings.shutdown_timeout_s)
        if report is not None:
            log.info("drained: %d in flight, %d aborted, %d not ended", report["in_flight"],
                     report["aborted"], report["unfinished"])
    finally:
        signals.interrupt = None  # a signal during the teardown must not break it off
        teardown(owned)
        signals.restore()
    return 0


def drain(signals: StopSignals, timeout_s: float) -> dict | None:
    """Ask the ingress to drain (``Ingress.drain``) and wait for it; a second signal makes it abort now.
    None if the ingress did not answer (it is torn down anyway)."""
    handle = serve.get_deployment_handle(launch.INGRESS_DEPLOYMENT, app_name=launch.APP_NAME)
    response = handle.drain.remote(timeout_s)
    hurried = False
    give_up = time.monotonic() + timeout_s + ABORTED_END_S + DRAIN_SLACK_S
    while time.monotonic() < give_up:
        try:
            return response.result(timeout_s=0.25)
        except TimeoutError:
            pass
        except Exception as exc:  # noqa: BLE001 - a dead ingress must not stop the shutdown
            log.warning("the ingress did not drain (%s: %s); shutting down anyway", type(exc).__name__, exc)
            return None
        if signals.hurry and not hurried:
            log.info("second stop signal: aborting in-flight requests now")
            handle.abort_now.remote()
            hurried = True
    log.warning("the ingress did not finish draining in time; shutting down anyway")
    return None


def teardown(owned: bool) -> None:
    """Owned Ray: shut Serve and Ray down and end what remains. Joined: remove our application only."""
    start = time.monotonic()
    if owned:  # also after a stop inside ray.init: what it started is in this process's tree
        _stop_serve(serve.shutdown)
        serve_s = time.monotonic() - start
        shutdown_owned_ray()
        log.info("Serve stopped in %.1f s, the local Ray in %.1f s more", serve_s, time.monotonic() - start - serve_s)
    elif ray.is_initialized():
        _stop_serve(lambda: serve.delete(launch.APP_NAME))
        ray.shutdown()  # disconnects this driver; the cluster and its other applications keep running
        log.info("application %r deleted in %.1f s; the Ray cluster keeps running", launch.APP_NAME,
                 time.monotonic() - start)


def _stop_serve(stop) -> None:
    if not ray.is_initialized():
        return
    try:
        stop()
    except Exception as exc:  # noqa: BLE001 - Ray itself is still shut down after this
        log.warning("stopping the Serve application failed (%s: %s)", type(exc).__name__, exc)
