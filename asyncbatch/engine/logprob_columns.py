"""A step's logprobs as ``LogprobColumns`` of its ``StepOutputs``: device results matched to kept rows.

The executor returns one entry per row of ``SamplerExtras.logprobs`` (by sample
index; a decode row of a verify step one per position it computed,
``LogprobRows.entries``) and per scored prompt position; the applied step keeps a
subset of the sampled rows' tokens (``AppliedStep.token_keys``). Tokens that
were dropped (or drafts that were not accepted) lose their logprobs with them,
so every logprob that reaches a caller belongs to a token it receives.
"""

from __future__ import annotations

import numpy as np

from asyncbatch.engine.messages import AppliedStep, LogprobColumns
from asyncbatch.engine.step_contract import SamplerExtras
from asyncbatch.sampling.logprobs import TokenLogprobs


def sampled_columns(extras: SamplerExtras | None, values: TokenLogprobs | None, applied: AppliedStep,
                    num_decode: int, width: int) -> LogprobColumns | None:
    """Logprobs of the kept tokens whose rows asked, ``rows`` being each one's index in the step's
    ``token_ids`` (``width``: positions a decode row computed, ``LogprobRows.entries``)."""
    if extras is None or extras.logprobs is None or values is None:
        return None
    lp = extras.logprobs
    rows, positions = lp.entries(num_decode, width)  # [E]
    kept, kept_positions = applied.token_keys()  # [T], ascending by (sample, position)
    if not len(kept):
        return None
    keys, token_keys = lp.index[rows] * width + positions, kept * width + kept_positions
    at = np.searchsorted(token_keys, keys)
    found = at < len(token_keys)
    found[found] = token_keys[at[found]] == keys[found]
    if not found.any():
        return None
    return LogprobColumns(at[found], lp.k[rows[found]], values.chosen[found], values.ranks[found],
                          values.top_ids[found], values.top_logprobs[found])


def prompt_columns(extras: SamplerExtras | None, values: TokenLogprobs | None) -> LogprobColumns | None:
    """Prompt logprobs scored in the step, ``rows`` being the request (seq) of each entry."""
    if extras is None or extras.prompt_logprobs is None or values is None:
        return None
    p = extras.prompt_logprobs
    return LogprobColumns(np.repeat(p.seqs, p.counts), np.repeat(p.k, p.counts), values.chosen, values.ranks,
                          values.top_ids, values.top_logprobs, p.target_ids)
