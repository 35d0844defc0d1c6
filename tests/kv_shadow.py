"""A model of the device's KV cache for planner tests: what every slot holds, checked on every read.

The keys and values at position p are a function of the tokens at positions
0..p, so a slot is modelled as ``(token, prefix id)`` with ``prefix id[p] =
hash((prefix id[p - 1], token[p]))``. ``ShadowDevice.run`` executes a written
plan the way the device does, in launch order, from the staging buffer alone:

1. every row first *reads* its context before this step (positions below its
   chunk, or below its decode position) through its block table, and each
   slot must hold exactly the row's own prefix: a shared block with other
   content, a block freed or evicted while a row still lists it, or a cached
   block written only by this same step fails here;
2. then it *writes* its tokens' slots (``slot_mapping``);
3. sampled rows get a token that depends on the seed, the sample step and the
   input token (so a wrong input changes the output), written to the token
   buffer for the next decode step, as on the device.

A row's prefix tokens come from the device itself (its earlier chunks, its
decode inputs), except the part of a first chunk reused from the prefix
cache: the device never saw those tokens, so the host's tokens are what the
reused blocks must hold. ``check_records`` checks every cached block against
its record: the tokens, and the prefix chain through its parent record.
"""

from __future__ import annotations

import numpy as np

from asyncbatch.engine.block_manager import BlockManager
from asyncbatch.engine.host_staging import StagingBuffer
from asyncbatch.engine.prefix_cache import ROOT_SERIAL
from asyncbatch.engine.step_metadata import StepMeta
from asyncbatch.engine.step_plan import StepPlan

ROOT_ID = 0
FIRST_TOKEN, VOCAB = 20, 60  # sampled tokens lie in FIRST_TOKEN .. FIRST_TOKEN + VOCAB - 1


def next_id(prefix_id: int, token: int) -> int:
    return hash((prefix_id, token))


class ShadowDevice:
    def __init__(self, max_seqs: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[int, int]] = {}  # flat slot -> (token, prefix id)
        self.tokens: list[list[int]] = [[] for _ in range(max_seqs)]  # per token row: the sequence so far
        self.ids: list[list[int]] = [[] for _ in range(max_seqs)]  # per token row: prefix id per position
        self.token_buffer = np.zeros(max_seqs, dtype=np.int64)
        self.reads = 0  # context positions checked

    def _extend(self, row: int, tokens: list[int]) -> None:
        ids = self.ids[row]
        for token in tokens:
            ids.append(next_id(ids[-1] if ids else ROOT_ID, token))
            self.tokens[row].append(token)

    def _read(self, row: int, table: np.ndarray, length: int, what: str) -> None:
        bs = self.block_size
        for q in range(length):
            slot = int(table[q // bs]) * bs + q % bs
            want = (self.tokens[row][q], self.ids[row][q])
            got = self.slots.get(slot)
            assert got == want, f"{what}: position {q} (slot {slot}) holds {got}, expected {want}"
        self.reads += length

    def run(self, plan: StepPlan, meta: StepMeta, staging: StagingBuffer) -> np.ndarray:
        """Execute one written plan; returns the sampled tokens ``[R]`` in sample order."""
        nd = plan.num_decode
        writes: list[tuple[int, int, int]] = []  # (row, position, slot)
        for i, row in enumerate(plan.decode_rows.tolist()):
            p = int(plan.decode_positions[i])
            assert len(self.tokens[row]) == p, f"decode row {row} at position {p} after {len(self.tokens[row])}"
            self._read(row, staging.decode_block_tables[i], p, f"decode row {row}")
            self._extend(row, [int(self.token_buffer[row])])
            writes.append((row, p, int(staging.slot_mapping[i])))
        for k, chunk in enumerate(plan.prefill):
            row, start, n = chunk.token_row, chunk.start, chunk.num_tokens
            t = meta.prefill_rows[k].token_start
            if chunk.first:
                # The reused prefix: the host's tokens, which the shared blocks must hold.
                self.tokens[row], self.ids[row] = [], []
                self._extend(row, chunk.request.all_token_ids()[:start])
            assert len(self.tokens[row]) == start, f"chunk of row {row} starts at {start}, device has " \
                                                   f"{len(self.tokens[row])}"
            self._read(row, staging.prefill_block_tables[k], start, f"prefill row {row}")
            self._extend(row, staging.input_ids[t:t + n].tolist())
            writes.extend((row, start + j, int(staging.slot_mapping[t + j])) for j in range(n))
        for row, p, slot in writes:  # after every read: no row sees what another writes in the same step
            self.slots[slot] = (self.tokens[row][p], self.ids[row][p])
        r = meta.num_sampled
        rows = staging.sample_token_rows[:r]
        fed = np.asarray([self.tokens[row][-1] for row in rows.tolist()], dtype=np.int64)
        mixed = (staging.sample_seed[:r] * 1_000_003 + staging.sample_step[:r] * 7919 + fed * 31 + 12345)
        tokens = FIRST_TOKEN + (mixed * 2654435761 % (1 << 32)) % VOCAB
        self.token_buffer[rows] = tokens
        assert nd + sum(c.samples for c in plan.prefill) == r
        return tokens

    def check_records(self, blocks: BlockManager) -> None:
        """Every cached block holds its record's tokens after the prefix its parent record names."""
        cache = blocks.prefix
        if cache is None:
            return
        bs = self.block_size
        records = [cache.record(b) for b in np.flatnonzero(cache.cached).tolist()]
        by_serial = {rec.serial: rec for rec in records}
        for rec in records:
            held = [self.slots.get(rec.block * bs + i) for i in range(bs)]
            assert all(h is not None for h in held), f"cached block {rec.block} was never written"
            assert tuple(h[0] for h in held) == rec.tokens, f"cached block {rec.block} holds other tokens"
            parent = by_serial.get(rec.parent_serial)
            if rec.parent_serial == ROOT_SERIAL:
                before = ROOT_ID
            elif parent is not None:
                before = self.slots[parent.block * bs + bs - 1][1]
            else:
                before = None  # the parent was evicted: nothing left to compare with
            if before is not None:
                assert held[0][1] == next_id(before, held[0][0]), f"cached block {rec.block} follows another prefix"
            for i in range(1, bs):
                assert held[i][1] == next_id(held[i - 1][1], held[i][0])
