"""How long a user waits before the engine answers: ``asyncbatch serve`` and ``generate`` on ``sim``, this tree
against an older one, side by side.

    python scripts/bench_startup.py --ref HEAD~2 --repeat 3     # a temporary worktree of the older commit
    python scripts/bench_startup.py --ref-tree /tmp/wt          # an existing checkout
    python scripts/bench_startup.py                             # this tree only

Each command runs as a user runs it, a fresh ``python -m asyncbatch`` with ``PYTHONPATH`` = the tree and the
tree as its working folder; the trees alternate within each repeat, so load from other users of the machine
hits both alike. Medians are printed, every run goes to ``--json``:

- ``serve_health_s``: from the start of ``asyncbatch serve --device sim`` to its first ``/health`` 200;
- ``serve_first_answer_s``: to the first answered completion (3 tokens) after that;
- ``generate_s``: the whole of ``asyncbatch generate --device sim --prompt Hello --max-tokens 8``, to its exit.

Only ``sim``: what these measure is imports and process starts (the weights are not read), the same on every
device. The model's files must be in the cache already (``scripts/setup_env.sh``).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.common import ROOT, free_port, parser, ref_worktree
from harness.serving_servers import ManagedServer, ServerSpec

from asyncbatch.bench.serving_client import VLLM

SERVE_TIMEOUT_S = 180.0


def _env(tree: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(tree))


def _post_status(url: str, body: dict) -> int:
    """The status of a JSON POST to ``url`` (0: no answer)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError), \
            urllib.request.urlopen(request, timeout=30) as response:
        return response.status
    return 0


def serve_times(tree: Path, log_path: Path) -> dict[str, float]:
    """``asyncbatch serve`` of ``tree`` (its working folder: ``-m`` puts it first on sys.path) as a
    ``ManagedServer``, polled every 50 ms; its log at ``log_path``."""
    port = free_port()
    argv = [sys.executable, "-m", "asyncbatch", "serve", "--device", "sim", "--port", str(port), "--sim-step-ms", "10"]
    spec = ServerSpec("asyncbatch", argv, port, VLLM, "asyncbatch serve --device sim", env={"PYTHONPATH": str(tree)},
                      cwd=tree)
    with ManagedServer(spec, log_path, startup_timeout_s=SERVE_TIMEOUT_S, poll_s=0.05) as server:
        healthy = time.perf_counter()
        if _post_status(server.base_url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3}) != 200:
            raise RuntimeError(f"serve in {tree} did not answer a completion; log {log_path}:\n{server.log_tail()}")
        return {"serve_health_s": server.ready_s, "serve_first_answer_s": server.ready_s + time.perf_counter() - healthy}


def generate_time(tree: Path) -> dict[str, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "asyncbatch", "generate", "--device", "sim", "--prompt", "Hello",
                           "--max-tokens", "8"], cwd=tree, env=_env(tree), capture_output=True, text=True,
                          timeout=SERVE_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"generate in {tree} failed:\n{done.stderr[-2000:]}")
    return {"generate_s": time.perf_counter() - start}


def main() -> int:
    cli = parser(__doc__)
    cli.add_argument("--ref", help="commit to compare against (a temporary worktree is made)")
    cli.add_argument("--ref-tree", type=Path, help="an existing checkout to compare against")
    cli.add_argument("--repeat", type=int, default=3, help="runs of each command per tree (default 3)")
    cli.add_argument("--json", type=Path, help="write every run here")
    args = cli.parse_args()
    if args.repeat < 1:
        cli.error(f"--repeat must be >= 1, got {args.repeat}")
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-startup-")))
        trees = {"this": ROOT}
        if args.ref is not None:
            trees = {"ref": stack.enter_context(ref_worktree(args.ref, [])), **trees}
        elif args.ref_tree is not None:
            trees = {"ref": args.ref_tree.resolve(), **trees}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for k in range(args.repeat):
            for name, tree in trees.items():
                runs[name].append({**serve_times(tree, logs / f"serve-{name}-{k}.log"), **generate_time(tree)})
    keys = list(next(iter(runs.values()))[0])
    print(f"{'median of ' + str(args.repeat):<24}" + "".join(f"{name:>10}" for name in runs)
          + ("     this/ref" if "ref" in runs else ""))
    for key in keys:
        medians = {name: statistics.median(r[key] for r in rs) for name, rs in runs.items()}
        ratio = f"{medians['this'] / medians['ref']:>13.2f}" if "ref" in medians else ""
        print(f"{key:<24}" + "".join(f"{m:>10.2f}" for m in medians.values()) + ratio)
    if args.json is not None:
        doc = {"ref": args.ref, "trees": {k: str(v) for k, v in trees.items()}, "runs": runs}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
