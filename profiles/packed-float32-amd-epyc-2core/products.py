"""float32 products of SmolLM2-135M's weight shapes: MKL (``F.linear``) against oneDNN's packed product, same
process, same inputs, 2 torch threads; best of repeats. One row reads distinct weights (96 MiB of them per
shape, more than the caches hold) as a decode step does; 64-1,024 rows multiply one weight (prefill sizes).
Prints the read rate at one row and ms at the larger sizes, with a ``sum()`` over 512 MiB for the bandwidth.

    python profiles/packed-float32-amd-epyc-2core/products.py
"""

import time

import torch
import torch.nn.functional as F

SHAPES = {"q/k/v": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536), "lm head": (49152, 576)}


def best_ms(fn, repeats: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def packed_product(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main() -> None:
    torch.set_num_threads(2)
    probe = torch.ones(128 << 20)
    print(f"sum() over 512 MiB: {probe.numel() * 4 / best_ms(probe.sum, 5) / 1e6:.1f} GB/s\n")
    print("| product | one row: MKL GB/s | one row: oneDNN packed GB/s | 64 / 256 / 1,024 rows: MKL ms | oneDNN ms |")
    print("| --- | ---: | ---: | --- | --- |")
    gen = torch.Generator().manual_seed(0)
    for name, shape in SHAPES.items():
        count = max(1, (96 << 20) // (shape[0] * shape[1] * 4))
        weights = [torch.randn(*shape, generator=gen) / 30 for _ in range(count)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
        x = torch.randn(1, shape[1], generator=gen)
        nbytes = count * shape[0] * shape[1] * 4
        mkl = nbytes / best_ms(lambda: [F.linear(x, w) for w in weights]) / 1e6
        dnn = nbytes / best_ms(lambda: [packed_product(x, p) for p in packed]) / 1e6
        big_mkl, big_dnn = [], []
        for rows in (64, 256, 1024):
            xs = torch.randn(rows, shape[1], generator=gen)
            big_mkl.append(best_ms(lambda: F.linear(xs, weights[0]), 5))
            big_dnn.append(best_ms(lambda: packed_product(xs, packed[0]), 5))
        print(f"| {name} {shape[0]} x {shape[1]} | {mkl:.1f} | {dnn:.1f} | "
              f"{' / '.join(f'{v:.2f}' for v in big_mkl)} | {' / '.join(f'{v:.2f}' for v in big_dnn)} |")


if __name__ == "__main__":
    main()
