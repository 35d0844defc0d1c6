"""``method="draft_model"``: a smaller model's greedy tokens as drafts, with its own paged KV cache.

The draft's cache mirrors the target's block layout: the same number of blocks, the same block size, a
token's keys and values at the same slot in both. So the target's block tables, slot mappings, prefix cache
and preemption serve the draft unchanged. The invariant that makes that true:

    every slot the target writes in a step with a token the row keeps (a position below the row's length after
    the step), the draft writes in the same step, with the same token at the same position; and the draft
    writes no slot the target does not write in that step (``propose`` and ``follow`` together). The slots
    the target writes and the draft does not hold drafts the step rejected or did not check: past the row's
    length, overwritten before anything reads them, never offered as cached (``docs/speculative.md``).

So the draft's KV is valid wherever the target's is: a reused cached prefix block, a recomputed (preempted)
request and a chunked prefill need nothing of their own. The price is a draft forward over every step's
tokens, a step that verifies nothing included (its share: the draft's size over the target's).

A draft_model step on the device, no host round trip (``TorchStep``):

    [propose: k greedy draft forwards of the decode rows][follow: the rest of the target's tokens][target: verify]

``propose`` runs at the start of the step that verifies the drafts, not at the end of the step before (as
the n-gram proposer does): drafting needs KV slots up to ``length + k - 1``, and only this step's block
tables, planned for ``1 + depth`` tokens a row, reserve them. Its first forward feeds each decode row's
input token at ``length`` (the token buffer, as ever); forward ``j`` feeds draft ``j`` at ``length + j``;
each draft is the argmax of the draft's logits (deterministic: ``docs/speculative.md`` says why that keeps
the tokens identical to plain decoding). A row that drafts nothing this step (its recent acceptance is low,
or its reserved KV has no room) takes part in the first forward only, which writes its input token's KV.
``follow`` then computes what the target computes and ``propose`` did not: the last usable draft of each
drafting row (the target checks it; if accepted, its KV is needed next step) and every prefill chunk; in a
step without proposals (nothing verified: ``disable_by_batch_size``, sampler extras, prefill only), the
whole batch.

The CPU reads two small device values per step here (which rows still draft, which tail tokens to follow);
a GPU version would keep static shapes and mask instead.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.llama import CausalLM
from asyncbatch.speculative.device_state import SpeculativeState, query_targets

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class DraftModel:
    """The draft model and its KV cache (``[num_blocks, block_size, kv_heads, head_dim]`` per layer, the
    target's block count and size), and the two draft forwards of a step."""

    def __init__(self, model: CausalLM, kv_caches: KVCaches, max_model_len: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.block_size = kv_caches[0][0].shape[1]

    def propose(self, state: SpeculativeState, rows: torch.Tensor, depth: int, tables: torch.Tensor,
                reserved: torch.Tensor, token_buffer: torch.Tensor, dummy_slot: int) -> None:
        """Drafts for the decode rows ``rows`` ``[D]`` of a step that verifies up to ``depth`` drafts a row, into
        ``state`` (``SpeculativeState.set_drafts``). ``tables`` ``[D, B]`` and ``reserved`` ``[D]``: the rows'
        block tables and reserved KV positions in this step (positions at or past ``reserved`` are written
        to the dummy slot, and the drafts they feed are not usable)."""
        start = state.length.index_select(0, rows)  # [D] the input token's position
        room = torch.minimum(reserved - start - 1, self.max_model_len - start - 1)  # [D]
        num = torch.where(state.quiet(rows), 0, room.clamp(min=0, max=depth))  # [D] drafts each row makes
        drafts = torch.zeros(len(rows), state.k, dtype=torch.int64, device=rows.device)  # [D, k]
        tokens = token_buffer.index_select(0, rows)  # [D] this forward's input
        active = torch.arange(len(rows), device=rows.device)  # [A] rows (indices into ``rows``) still drafting
        most = int(num.max()) if len(rows) else 0  # the CPU reads this; a GPU would run k forwards, masked
        for j in range(most):
            if j:  # rows whose drafts end here are done; they need none of the later forwards
                keep = num.index_select(0, active) > j
                active, tokens = active[keep], tokens[keep]
            logits = self._decode(tokens, start.index_select(0, active) + j, tables.index_select(0, active),
                                  reserved.index_select(0, active), dummy_slot)
            tokens = logits.argmax(dim=-1)  # [A] greedy
            drafts[active, j] = tokens
        if not most:  # no row drafts: the first forward still writes every input token's KV
            self._decode(tokens, start, tables, reserved, dummy_slot)
        state.set_drafts(rows, drafts, num)

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, reserved: torch.Tensor,
                dummy_slot: int) -> torch.Tensor:
        """One draft forward of single-token rows: ``tokens`` at ``positions`` (``[A]``) -> logits ``[A, vocab]``."""
        computed, slots, contexts = query_targets(positions[:, None], reserved, tables, self.block_size, dummy_slot,
                                                  self.max_model_len)  # [A, 1] each
        batch = ForwardBatch(input_ids=tokens, positions=computed.squeeze(1), slot_mapping=slots.squeeze(1),
                             num_decode=len(tokens), decode_block_tables=tables,
                             decode_context_lens=contexts.squeeze(1), prefill_rows=[],
                             logits_indices=torch.arange(len(tokens), device=tokens.device))
        return self.model(batch, self.kv_caches)

    def follow(self, batch: ForwardBatch, num_rows: int, usable: torch.Tensor | None) -> None:
        """The draft's forward over the target's tokens of this step that ``propose`` did not compute.

        ``batch``: the target's (decode rows first, ``num_rows`` of them, ``batch.num_decode // num_rows``
        tokens each); ``usable`` ``[D]``: the drafts each row verifies, when ``propose`` ran (None: it did
        not, and the whole batch is computed)."""
        if usable is None:
            if len(batch.input_ids):
                self.model(replace(batch, logits_indices=batch.logits_indices[:0]), self.kv_caches)
            return
        nt = batch.num_decode
        width = nt // num_rows if num_rows else 1
        rows = (usable > 0).nonzero().squeeze(1)  # [F] drafting rows: their last usable draft
        tail = rows * width + usable.index_select(0, rows)  # [F] its token index in the batch
        shift = nt - len(tail)
        if not len(tail) and len(batch.input_ids) == nt:
            return

        def pick(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t.index_select(0, tail), t[nt:]])

        follow = ForwardBatch(input_ids=pick(batch.input_ids), positions=pick(batch.positions),
                              slot_mapping=pick(batch.slot_mapping), num_decode=len(tail),
                              decode_block_tables=batch.decode_block_tables.index_select(0, tail),
                              decode_context_lens=batch.decode_context_lens.index_select(0, tail),
                              prefill_rows=[PrefillRow(r.token_start - shift, r.q_len, r.ctx_len, r.block_table)
                                            for r in batch.prefill_rows],
                              logits_indices=batch.logits_indices[:0])
        self.model(follow, self.kv_caches)
