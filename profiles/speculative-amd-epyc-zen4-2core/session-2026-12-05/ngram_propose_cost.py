"""``ngram_propose``'s time at a few batch shapes (rows x history tokens), k = 3, lookup 2-4, two torch threads, the
mean of 30 calls after 3: run once per tree and compare.

    PYTHONPATH=<tree> python ngram_propose_cost.py
"""
import time

import torch

from asyncbatch.speculative.ngram import ngram_propose

torch.set_num_threads(2)
for rows, width in ((1, 150), (1, 400), (4, 600), (8, 2000), (32, 1024), (64, 2048), (256, 600)):
    history = torch.randint(0, 1000, (rows, width))
    lengths = torch.full((rows,), width - 20)
    for _ in range(3):
        ngram_propose(history, lengths, 3, 2, 4, 4096)
    start = time.perf_counter()
    for _ in range(30):
        ngram_propose(history, lengths, 3, 2, 4, 4096)
    print(f"{rows} x {width}: {(time.perf_counter() - start) / 30 * 1e6:.0f} us")
