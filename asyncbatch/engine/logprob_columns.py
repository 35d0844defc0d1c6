"""A step's logprobs as ``LogprobColumns`` of its ``StepOutputs``: device results matched to kept rows.

The executor returns one entry per row of ``SamplerExtras.logprobs`` (by sample
index) and per scored prompt position; the applied step keeps a subset of the
sampled rows (``AppliedStep.kept``). Rows whose token was dropped lose their
logprobs with it, so every logprob that reaches a caller belongs to a token it
receives.
"""

from __future__ import annotations

import numpy as np

from asyncbatch.engine.messages import LogprobColumns
from asyncbatch.engine.step_contract import SamplerExtras
from asyncbatch.sampling.logprobs import TokenLogprobs


def sampled_columns(extras: SamplerExtras | None, values: TokenLogprobs | None,
                    kept: np.ndarray | None) -> LogprobColumns | None:
    """Logprobs of the kept rows that asked, ``rows`` being positions among the kept rows."""
    if extras is None or extras.logprobs is None or values is None:
        return None
    index = extras.logprobs.index  # [L] sample indices
    select = slice(None)
    if kept is None:
        rows = index
    else:
        at = np.searchsorted(kept, index)  # kept is ascending
        found = at < len(kept)
        found[found] = kept[at[found]] == index[found]
        if not found.any():
            return None
        rows, select = at[found], found
    return LogprobColumns(rows, extras.logprobs.k[select], values.chosen[select], values.ranks[select],
                          values.top_ids[select], values.top_logprobs[select])


def prompt_columns(extras: SamplerExtras | None, values: TokenLogprobs | None) -> LogprobColumns | None:
    """Prompt logprobs scored in the step, ``rows`` being the request (seq) of each entry."""
    if extras is None or extras.prompt_logprobs is None or values is None:
        return None
    p = extras.prompt_logprobs
    return LogprobColumns(np.repeat(p.seqs, p.counts), np.repeat(p.k, p.counts), values.chosen, values.ranks,
                          values.top_ids, values.top_logprobs, p.target_ids)
