"""Issue 24 part 0: which library reads a one-row float32 decode step's weights fastest on this CPU.

* ``gemv [ROUNDS]``: SmolLM2-135M's 150 decoder products' shapes (30 layers of q/k/v 960x576, gate and up
  1536x576, down 576x1536, o 576x576; 425 MB of random float32) times one row, each library in its own
  process (so no library's idle worker threads spin beside another's), rounds interleaved: a ``sum()`` over as
  many bytes (the read bandwidth), oneDNN's packed product (``mkldnn._linear_pointwise``, what the engine uses
  for float32 on AMD) and ``torch.mv`` (MKL) at 2 torch threads, and numpy's ``matmul`` (OpenBLAS) with
  OPENBLAS_NUM_THREADS 1 and 2 beside a 1-thread torch. Median of 15 passes per process; GB/s = bytes /
  median.
* ``step [ROUNDS]``: the real one-row float32 decode step (``harness.decode_step``, context 128), its linears
  and LM head through oneDNN's packed copy at 2 torch threads, or through numpy (OpenBLAS, 2 threads) at 1
  and 2 torch threads, alternating in one process; step ms per mode, median of 7 steps per round.

    python profiles/lean-decode-step-amd-epyc-2core/openblas-gemv-zen4/gemv_paths.py gemv 3
    OPENBLAS_NUM_THREADS=2 python profiles/lean-decode-step-amd-epyc-2core/openblas-gemv-zen4/gemv_paths.py step 5
"""
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SHAPES = [(960, 576)] * 30 + [(1536, 576)] * 60 + [(576, 1536)] * 30 + [(576, 576)] * 30


def one_library(method: str, threads: int) -> float:
    """Median seconds of 15 passes of ``method`` over the 150 products (child process)."""
    import numpy as np
    import torch
    torch.set_num_threads(threads)
    weights = [torch.randn(*shape) for shape in SHAPES]
    xs = {k: torch.randn(1, k) for k in (576, 1536)}
    if method == "sum":
        total = torch.ones(sum(w.numel() for w in weights))

        def run() -> None:
            total.sum()
    elif method == "onednn-packed":
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]

        def run() -> None:
            for w, p in zip(weights, packed):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
    elif method == "torch-mv":
        def run() -> None:
            for w in weights:
                torch.mv(w, xs[w.shape[1]][0])
    else:  # numpy-openblas
        arrays = [w.numpy() for w in weights]
        vectors = {k: v.numpy()[0] for k, v in xs.items()}

        def run() -> None:
            for w in arrays:
                np.matmul(w, vectors[w.shape[1]])
    times = []
    with torch.inference_mode():
        for _ in range(15):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemv(rounds: int) -> None:
    nbytes = sum(a * b for a, b in SHAPES) * 4
    cases = [("sum", 2, None), ("onednn-packed", 2, None), ("torch-mv", 2, None), ("numpy-openblas", 1, "1"),
             ("numpy-openblas", 1, "2")]
    results: dict[str, list[float]] = {}
    for _ in range(rounds):
        for method, threads, openblas in cases:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            if openblas is not None:
                env["OPENBLAS_NUM_THREADS"] = openblas
            out = subprocess.run([sys.executable, __file__, "child", method, str(threads)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            label = f"{method} (torch threads {threads}" + (f", OpenBLAS threads {openblas})" if openblas else ")")
            results.setdefault(label, []).append(float(out))
    print(f"{nbytes / 1e6:.0f} MB of float32 weights, one row; median of 15 passes per process, {rounds} rounds")
    for label, values in results.items():
        per_round = " ".join(f"{nbytes / v / 1e9:.1f}" for v in values)
        print(f"{label:48s} {statistics.median(values) * 1e3:6.1f} ms  {nbytes / statistics.median(values) / 1e9:5.1f}"
              f" GB/s  (rounds: {per_round} GB/s)")


def step(rounds: int) -> None:
    os.environ["ASYNCBATCH_F32_PACKED"] = "0"  # plain nn.Linear weights, swapped below for both paths
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    import numpy as np
    import torch
    from harness.decode_step import DecodeStepBench
    from torch import nn

    from asyncbatch.model.emulated_bf16 import swap_decoder_linears
    from asyncbatch.model.packed_linears import _packed_product

    mode = {"numpy": False}

    class Either(nn.Module):
        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            self.weight = linear.weight.detach().contiguous()
            self.array = self.weight.numpy()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
            self.out_features, self.in_features = self.weight.shape

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if mode["numpy"] and x.shape[0] == 1:
                return torch.from_numpy(np.matmul(x.numpy(), self.array.T))
            return _packed_product(x, self.packed, None)

    bench = DecodeStepBench(dtype="float32", threads=2)
    model = bench.model
    swap_decoder_linears(model, Either)
    head = model.output_weight.detach()
    head_array, head_packed = head.numpy(), torch.ops.mkldnn._reorder_linear_weight(head, 1)

    class Head(nn.Module):
        def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            if mode["numpy"]:
                return torch.from_numpy(np.matmul(hidden.numpy(), head_array.T))
            return _packed_product(hidden, head_packed, None)

    model.packed_lm_head = Head()
    mode["numpy"] = False
    reference = bench.step(1)
    mode["numpy"] = True
    assert torch.equal(bench.step(1), reference), "the two paths chose different tokens"
    modes = [("oneDNN packed, torch threads 2", False, 2), ("OpenBLAS, torch threads 1", True, 1),
             ("OpenBLAS, torch threads 2", True, 2)]
    # The floor as bench_lean_step.py takes it: the bytes the step reads in full (every product's weight and the
    # LM head) over the best of 5 sum() passes at 2 threads, measured at the start of each round.
    nbytes = sum(m.weight.nbytes for m in model.modules() if isinstance(m, Either)) + head.nbytes
    results: dict[str, list[float]] = {}
    floors: list[float] = []
    ones = torch.ones(512 * 2**20 // 4)
    for _ in range(rounds):
        torch.set_num_threads(2)
        passes = []
        for _ in range(5):
            t0 = time.perf_counter()
            ones.sum()
            passes.append(time.perf_counter() - t0)
        floors.append(nbytes / (ones.nbytes / min(passes)) * 1e3)
        for label, numpy_path, threads in modes:
            mode["numpy"] = numpy_path
            torch.set_num_threads(threads)
            results.setdefault(label, []).append(bench.time_steps(1, repeats=7, warmup=2).median_ms)
    floor = statistics.median(floors)
    print(f"one-row float32 decode step, context 128; weights read {nbytes / 2**20:.0f} MiB; floor {floor:.1f} ms "
          f"(rounds: {' '.join(f'{f:.1f}' for f in floors)}); OPENBLAS_NUM_THREADS="
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}; {rounds} rounds, median of 7 steps each; same greedy "
          "token both paths")
    for label, values in results.items():
        ratio = statistics.median(v / f for v, f in zip(values, floors))
        print(f"{label:34s} {statistics.median(values):7.1f} ms  {ratio:5.2f}x the floor (median of the rounds' "
              f"ratios)  (rounds: {' '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    if sys.argv[1] == "child":
        print(one_library(sys.argv[2], int(sys.argv[3])))
    elif sys.argv[1] == "gemv":
        gemv(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
    else:
        step(int(sys.argv[2]) if len(sys.argv) > 2 else 5)
