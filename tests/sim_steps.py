"""Step metadata for tests that drive the ``sim`` executor directly."""

from __future__ import annotations

from asyncbatch.engine.step_contract import StepMeta


def one_row_step(staging) -> StepMeta:
    """Step 1: one decode row of one token, greedy, no extras."""
    return StepMeta(step_id=1, staging=staging, num_tokens=1, num_decode=1, decode_max_blocks=1, prefill_rows=[],
                    num_sampled=1, context_tokens=1, all_greedy=True, any_filter=False, any_penalty=False,
                    first_chunk_rows=[])
