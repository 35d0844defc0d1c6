"""The ``sim`` device's drawn output lengths, kept per token row (``SimExecutor.row_output_length``): always the
draw of the row's current seed, however rows change hands, and the same for every distribution."""

from __future__ import annotations

import numpy as np
import pytest

from asyncbatch.config import SimConfig
from asyncbatch.executors.sim_executor import SimExecutor


@pytest.mark.parametrize("distribution", ["uniform", "geometric", "fixed"])
def test_row_lengths_are_the_draws_of_the_rows_current_seeds(distribution):
    executor = SimExecutor(SimConfig(output_len_distribution=distribution, output_len_min=1, output_len_max=300),
                           vocab_size=1000, eos_token_id=2, max_num_seqs=16)
    try:
        rng = np.random.default_rng(3)
        seeds = np.zeros(16, dtype=np.int64)  # what each row holds now; seed 0 included (the cache's start)
        for _ in range(200):
            rows = rng.choice(16, size=rng.integers(1, 17), replace=False).astype(np.int64)
            moved = rows[rng.random(len(rows)) < 0.3]  # another request takes these rows
            seeds[moved] = rng.integers(0, 2**63 - 1, len(moved))
            assert executor.row_output_length(rows, seeds[rows]).tolist() == executor.output_length(seeds[rows]).tolist()
    finally:
        executor.close()
