"""The servers under test as subprocesses: asyncbatch serve and transformers serve, on free loopback ports.

A ``ManagedServer`` starts its command in a new session (so the whole process group, an engine-core
child included, can be signalled), writes its stdout and stderr to a log file, is ready when ``GET
/health`` answers 200 within the start-up timeout (it fails early, with the log's tail, if the
process exits first), and is stopped by SIGTERM to its group, then SIGKILL after the stop timeout.
``with`` blocks stop it on any exit, and an ``atexit`` hook stops any left running if the interpreter
exits another way.

Both servers get the same model directory, dtype and device; transformers' continuous batching gets
asyncbatch's per-step token budget. Its KV cache (left alone it sizes it from free memory) is by
default sized for the workload (``workload_kv_tokens``: every request of a load point in flight at
full length, so capacity never limits it), not matched to asyncbatch's: on CPU its step cost grows
with the cache's size (measured on SmolLM2-135M: a 125-token prefill took 0.4-0.7 s with 64 blocks of
256 tokens and 4.7-8.5 s with asyncbatch's 182; it allocates an attention bias of max-batch-tokens x
cache tokens, the likely cause), which would measure that cliff rather than the server. ``kv_capacity_tokens``
gives asyncbatch's capacity for the ``match`` setting.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import asyncbatch
from asyncbatch.bench.serving_client import TRANSFORMERS, VLLM, Dialect, ServingRequest, served_model
from harness.common import free_port

_POLL_S = 0.25
_LOG_TAIL_CHARS = 4000
_RUNNING: set[ManagedServer] = set()
TRANSFORMERS_PAGE_SIZE = 256  # transformers serve's default page (block) size


class ServerStartError(RuntimeError):
    """The server exited, or did not answer /health with 200, before the start-up timeout."""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to run one server: its command line (port included), its request dialect, and what it is."""

    name: str
    argv: list[str]
    port: int
    dialect: Dialect
    description: str
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    host: str = "127.0.0.1"
    cwd: Path | None = None  # its working folder (None: this process's); for ``python -m``, sys.path's first entry

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _python_path_env() -> dict[str, str]:
    """PYTHONPATH with the checkout this benchmark runs from first, so the child serves the same code."""
    root = str(Path(asyncbatch.__file__).resolve().parents[1])
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": root if not rest else f"{root}{os.pathsep}{rest}"}


def _threads_env(torch_threads: int | None) -> dict[str, str]:
    """torch sizes its intra-op pool from OMP_NUM_THREADS at start-up; both servers get the same value."""
    return {} if torch_threads is None else {"OMP_NUM_THREADS": str(torch_threads)}


def asyncbatch_spec(model_path: str, device: str, dtype: str, max_num_seqs: int, max_num_batched_tokens: int,
                    seed: int, extra_args: list[str] | None = None, port: int | None = None,
                    torch_threads: int | None = None) -> ServerSpec:
    port = port or free_port()
    argv = [sys.executable, "-m", "asyncbatch", "serve", model_path, "--host", "127.0.0.1", "--port", str(port),
            "--device", device, "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens), "--seed", str(seed)]
    if torch_threads is not None:
        argv += ["--num-threads", str(torch_threads)]  # the cpu backend sets its own count otherwise
    argv += extra_args or []
    return ServerSpec("asyncbatch", argv, port, VLLM, "asyncbatch serve (OpenAI-compatible, engine-core process)",
                      env={**_python_path_env(), **_threads_env(torch_threads)})


def transformers_cli() -> str:
    """The ``transformers`` console script of this interpreter's environment (else the one on PATH)."""
    beside = Path(sys.executable).parent / "transformers"
    found = str(beside) if beside.exists() else shutil.which("transformers")
    if found is None:
        raise FileNotFoundError("the `transformers` command is not installed (pip install 'transformers[serving]')")
    return found


def kv_capacity_tokens(model_path: str, device: str, dtype: str, max_num_seqs: int,
                       max_num_batched_tokens: int) -> int:
    """Tokens of KV cache asyncbatch serve allocates with these settings (block 0 is its dummy block)."""
    from asyncbatch.config import EngineConfig
    from asyncbatch.engine.builder import choose_num_blocks, kv_bytes_per_token
    from asyncbatch.model.loader import load_config, max_model_len, resolve_dtype

    hf_config, _ = load_config(model_path)
    config = EngineConfig(model=model_path, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    torch_dtype = resolve_dtype(dtype, device)
    blocks = choose_num_blocks(config, device, kv_bytes_per_token(hf_config, torch_dtype), max_model_len(hf_config))
    return (blocks - 1) * config.block_size


def workload_kv_tokens(point_requests: list[list[ServingRequest]], page_size: int = TRANSFORMERS_PAGE_SIZE) -> int:
    """KV tokens, in whole pages, for every request of the largest load point at once at full length
    (prompt as counted here, plus one token of slack for a server that adds BOS, plus max_tokens)."""
    def pages(r: ServingRequest) -> int:
        length = (r.prompt_len if r.prompt_len is not None else len(r.prompt)) + 1 + r.max_tokens
        return -(-length // page_size)
    return max(sum(pages(r) for r in reqs) for reqs in point_requests) * page_size


def transformers_spec(model_path: str, device: str, dtype: str, max_num_batched_tokens: int,
                      kv_tokens: int | None, extra_args: list[str] | None = None,
                      port: int | None = None, torch_threads: int | None = None) -> ServerSpec:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"transformers serve runs on a real device (cpu or cuda), not {device!r}")
    port = port or free_port()
    argv = [transformers_cli(), "serve", "--continuous-batching", "--device", device, "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--cb-max-batch-tokens", str(max_num_batched_tokens)]
    if kv_tokens is not None:
        argv += ["--cb-num-blocks", str(-(-kv_tokens // TRANSFORMERS_PAGE_SIZE))]
    argv += [*(extra_args or []), model_path]
    return ServerSpec("transformers", argv, port, TRANSFORMERS, "transformers serve --continuous-batching",
                      env=_threads_env(torch_threads))


class ManagedServer:
    """One server subprocess; use as a context manager (``start`` + ``wait_ready`` ... ``stop``)."""

    def __init__(self, spec: ServerSpec, log_path: Path, startup_timeout_s: float = 300.0,
                 stop_timeout_s: float = 30.0, poll_s: float = _POLL_S) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s  # between two GET /health: the resolution of ``ready_s``
        self.process: subprocess.Popen | None = None
        self.ready_s: float | None = None  # start to first 200 from /health
        self.returncode: int | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def pgid(self) -> int | None:
        """The server's process group (its own session: its pid), None when not running."""
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.spec.argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env={**os.environ, **self.spec.env},
                                            cwd=self.spec.cwd, start_new_session=True)
        _RUNNING.add(self)
        self._started = time.perf_counter()

    def log_tail(self, chars: int = _LOG_TAIL_CHARS) -> str:
        try:
            return self.log_path.read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""

    def wait_ready(self) -> float:
        """Seconds from start until ``/health`` answered 200; raises ``ServerStartError`` otherwise."""
        assert self.process is not None, "start() first"
        deadline = self._started + self.startup_timeout_s
        with httpx.Client(base_url=self.base_url, timeout=5.0, trust_env=False) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise ServerStartError(f"{self.spec.name} exited with code {code} before it was ready; "
                                           f"log {self.log_path}:\n{self.log_tail()}")
                try:
                    if client.get("/health").status_code == 200:
                        self.ready_s = time.perf_counter() - self._started
                        return self.ready_s
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.perf_counter() > deadline:
                    self.stop()
                    raise ServerStartError(f"{self.spec.name} did not answer GET /health with 200 within "
                                           f"{self.startup_timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")
                time.sleep(self.poll_s)

    def served_model(self) -> str:
        """The first model ``GET /v1/models`` lists: the name requests must give."""
        return served_model(self.base_url)

    def stop(self) -> int | None:
        """SIGTERM to the process group, SIGKILL after ``stop_timeout_s``; returns the exit code."""
        proc = self.process
        if proc is None:
            return self.returncode
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=30)
        # Children that outlived their parent (an engine core) get the same treatment.
        _signal_group(proc, signal.SIGKILL)
        self.returncode = proc.returncode
        self.process = None
        _RUNNING.discard(self)
        return self.returncode

    def __enter__(self) -> ManagedServer:  # noqa: PYI034 - not meant to be subclassed
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Signal the process group this server leads (its own session, so nothing else is in it)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()
