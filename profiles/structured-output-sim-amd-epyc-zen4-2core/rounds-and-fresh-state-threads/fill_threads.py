"""Batch grammar fills at fresh matcher states: one thread against two, as the engine would split a step's fill.

Two sets of ``R`` matchers of ``bench_structured.py``'s schema (the default model's vocabulary) walk the same random
path: each step's tokens are drawn uniformly from the first set's masks, as the sim's random logits do, and both
sets accept them, so each fill is the first at its state (the engine fills every matcher once a step, right after
its token). Each step fills both sets once, in alternating order, and their masks must come out equal:

* ``threads R T``: the first set by a one-thread ``xgrammar.BatchGrammarMatcher``, the second by one with
  ``max_threads=T`` (xgrammar's own pool);
* ``halves``: 128 rows, the first set in one call, the second as two calls of 64 rows at once, one of them on a
  helper thread of ours with its own one-thread batch matcher (the call releases the GIL).

Prints each side's median fill a step and the ratio of their sums (``halves`` also the costliest steps).

    python profiles/structured-output-sim-amd-epyc-zen4-2core/rounds-and-fresh-state-threads/fill_threads.py threads 128 2
    python profiles/structured-output-sim-amd-epyc-zen4-2core/rounds-and-fresh-state-threads/fill_threads.py halves
"""
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xgrammar as xgr

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_structured import SCHEMA

from asyncbatch.model.loader import load_config, load_tokenizer, resolve_model_path
from asyncbatch.sampling.grammar_xgrammar import XGrammarLib
from asyncbatch.sampling.token_bitmask import bitmask_words
from asyncbatch.structured_outputs import StructuredOutputsParams

Fill = Callable[[list, np.ndarray, list[int]], None]


def walk(rows: int, steps: int, fill_a: Fill, fill_b: Fill) -> tuple[np.ndarray, np.ndarray]:
    """Milliseconds of each step's fill of set A (``fill_a``) and set B (``fill_b``), the sets walking together."""
    path = resolve_model_path(None)
    tokenizer = load_tokenizer(path)
    vocab = int(load_config(path)[0].vocab_size)
    lib = XGrammarLib(tokenizer, vocab, tokenizer.eos_token_id)
    compiled = lib.compile(StructuredOutputsParams(json=SCHEMA))
    set_a = [lib.matcher(compiled) for _ in range(rows)]
    set_b = [lib.matcher(compiled) for _ in range(rows)]
    mask_a = np.zeros((rows, bitmask_words(vocab)), dtype=np.int32)
    mask_b = np.zeros_like(mask_a)
    every = list(range(rows))
    lib.fill_batch(set_a, mask_a, every)
    lib.fill_batch(set_b, mask_b, every)
    rng = np.random.default_rng(0)
    times_a, times_b = [], []
    for step in range(steps):
        bits = np.unpackbits(mask_a.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        tokens = [int(rng.choice(np.flatnonzero(row))) for row in bits]
        lib.accept_batch(set_a, tokens)
        lib.accept_batch(set_b, tokens)
        sides = [(fill_a, [m._h for m in set_a], mask_a, times_a), (fill_b, [m._h for m in set_b], mask_b, times_b)]
        for fill, handles, mask, times in sides if step % 2 else sides[::-1]:
            t0 = time.perf_counter()
            fill(handles, mask, every)
            times.append((time.perf_counter() - t0) * 1e3)
        if not np.array_equal(mask_a, mask_b):
            raise AssertionError(f"step {step}: the two fills disagree")
    return np.array(times_a), np.array(times_b)


def batch_fill(threads: int) -> Fill:
    ffi = xgr.BatchGrammarMatcher(max_threads=threads)._handle.batch_fill_next_token_bitmask
    return lambda handles, mask, rows: ffi(handles, mask, rows, False)


def halves_fill() -> Fill:
    """Two halves at once: the second half on a helper thread (its own batch matcher), the first on the caller's."""
    mine, helpers = batch_fill(1), batch_fill(1)
    go, done = threading.Event(), threading.Event()
    job: list = []

    def helper() -> None:
        while True:
            go.wait()
            go.clear()
            helpers(*job)
            done.set()

    threading.Thread(target=helper, daemon=True).start()

    def fill(handles: list, mask: np.ndarray, rows: list[int]) -> None:
        half = len(handles) // 2
        job[:] = [handles[half:], mask, rows[half:]]
        go.set()
        mine(handles[:half], mask, rows[:half])
        done.wait()
        done.clear()

    return fill


def main() -> None:
    if sys.argv[1] == "threads":
        rows, threads = int(sys.argv[2]), int(sys.argv[3])
        one, many = walk(rows, 40, batch_fill(1), batch_fill(threads))
        print(f"rows {rows}: 1 thread median {np.median(one):.3f} ms (sum {one.sum():.1f}); {threads} threads median "
              f"{np.median(many):.3f} ms (sum {many.sum():.1f}); ratio of sums {many.sum() / one.sum():.2f}")
    else:
        one, halves = walk(128, 100, batch_fill(1), halves_fill())
        print(f"fresh states, 128 rows: one call median {np.median(one):.3f} ms (sum {one.sum():.1f}); two halves at "
              f"once median {np.median(halves):.3f} ms (sum {halves.sum():.1f})")
        top = np.argsort(-one)[:6]
        print("costliest steps (step, one call ms, halves ms):",
              [(int(i), round(float(one[i]), 3), round(float(halves[i]), 3)) for i in top])


if __name__ == "__main__":
    main()
