"""A verify step's tokens applied as arrays (``StepApplier._apply_runs``) against one position at a time.

The array path appends every row's emitted tokens in one scatter and cuts each row at its first finishing
token (``emitted_cut.first_finish``); the reference (``StepApplier.vectorised = False``) applies position by
position through the plain rules. The lockstep test drives two schedulers over the same requests and the
same device outcomes (random emitted counts, EOS, stop ids, ``max_tokens``, non-finite rows, aborts between
steps, preemption in a tight KV cache with prefix caching), applied one step late as in overlap mode, and
requires every request's tokens and finish codes, the errored requests, the row arrays, the free lists, the
block tables and every request's counters to agree after every step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from asyncbatch.engine.block_manager import BlockManager, IntegrityError
from asyncbatch.engine.emitted_cut import first_finish
from asyncbatch.engine.messages import AppliedStep, Finish
from asyncbatch.engine.request import Request
from asyncbatch.engine.row_state import NO_SEQ
from asyncbatch.engine.scheduler import Scheduler
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.speculative.config import SpeculativeConfig
from asyncbatch.structured_outputs import StructuredOutputsParams

BLOCK, MAX_BLOCKS, ROWS, BUDGET = 16, 10, 24, 256
EOS, VOCAB, DEPTH = 3, 40, 4
GRAMMAR = StructuredOutputsParams(regex="[a-z]+")  # the scheduler only reads that a request has one


def _scheduler(vectorised: bool, num_blocks: int, method: str = "ngram") -> Scheduler:
    blocks = BlockManager(num_blocks, BLOCK, ROWS, MAX_BLOCKS, prefix_caching=True)
    spec = SpeculativeConfig(method=method, model="draft" if method == "draft_model" else None,
                             num_speculative_tokens=DEPTH, disable_by_batch_size=None)
    sched = Scheduler(blocks, BUDGET, eos_token_id=EOS, speculative=spec)
    sched.applier.vectorised = vectorised
    return sched


def _by_request(applied: AppliedStep) -> dict[int, list[tuple[int, int]]]:
    """Each request's (token, finish code) in order, whichever layout the step has."""
    flat = applied.per_token()
    out: dict[int, list[tuple[int, int]]] = {}
    for seq, token, code in zip(flat.seqs.tolist(), flat.token_ids.tolist(), flat.finish.tolist()):
        out.setdefault(seq, []).append((token, code))
    return out


def _state(sched: Scheduler, requests: dict[int, Request]) -> tuple:
    st, blocks = sched.rows, sched.blocks
    held = np.flatnonzero(st.seq != NO_SEQ).tolist()
    rows = [(r, int(st.seq[r]), int(st.num_computed[r]), int(st.num_scheduled[r]), int(st.num_outputs[r]),
             int(st.spec_over[r]), st.outputs(r), blocks.block_table[r, :blocks.num_row_blocks[r]].tolist())
            for r in held]
    reqs = [(seq, r.status, r.num_outputs, r.num_pending, r.finish_reason, r.stop_reason, list(r.output_token_ids),
             r.token_row) for seq, r in sorted(requests.items())]
    return (rows, reqs, list(sched._free_rows), blocks.free_blocks(), sorted(sched._off_row),
            sched.prefix_cache_stats(), sched.num_preemptions)


def _outcome(rng: random.Random, plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The device's result for ``plan``: tokens ``[R, 1 + depth]``, emitted counts, finite flags."""
    r, nd, width = len(plan.sample_rows), plan.num_decode, plan.spec_depth + 1
    tokens = np.array([[EOS if rng.random() < 0.04 else rng.randrange(4, VOCAB) for _ in range(width)]
                       for _ in range(r)], dtype=np.int64).reshape(r, width)
    emitted = np.array([rng.randint(1, width) if i < nd else 1 for i in range(r)], dtype=np.int64)
    finite = np.array([rng.random() > 0.01 for _ in range(r)], dtype=bool)
    emitted[~finite] = 1
    return tokens, emitted, finite


def _grammar_rows_verifying(sched: Scheduler, plan) -> int:
    """How many decode rows with a grammar a verify plan has: they reserve ``1 + spec_depth`` tokens like the
    others (the host fills a mask per position along their drafts, whichever method made them)."""
    if not plan.spec_depth:
        return 0
    return int(sched.rows.has_grammar[plan.decode_rows].sum())


@pytest.mark.parametrize("seed, method", [(0, "ngram"), (1, "ngram"), (2, "draft_model"), (3, "draft_model")])
def test_array_apply_equals_position_by_position(seed: int, method: str) -> None:
    rng = random.Random(seed)
    fast, ref = _scheduler(True, 32, method), _scheduler(False, 32, method)
    requests: list[dict[int, Request]] = [{}, {}]
    prefix = [rng.randrange(4, VOCAB) for _ in range(2 * BLOCK)]
    seq, in_flight, finished, grammar_rows = 0, [], 0, 0
    codes_seen: set[int] = set()
    for step in range(600):
        if step < 300 and rng.random() < 0.4:
            for _ in range(rng.randrange(1, 6)):
                prompt = prefix[:rng.randrange(1, 2 * BLOCK)] + [rng.randrange(4, VOCAB) for _ in range(8)]
                params = SamplingParams(max_tokens=rng.randrange(1, 70), temperature=0.0,
                                        ignore_eos=rng.random() < 0.3,
                                        stop_token_ids=[rng.randrange(4, VOCAB)] if rng.random() < 0.3 else None,
                                        structured_outputs=GRAMMAR if rng.random() < 0.2 else None)
                for sched, reqs in zip((fast, ref), requests):
                    request = Request(str(seq), seq, list(prompt), params, seq, 0.0)
                    reqs[seq] = request
                    sched.add(request)
                seq += 1
        if rng.random() < 0.05 and requests[0]:  # an abort between steps
            victim = rng.choice(sorted(requests[0]))
            for sched, reqs in zip((fast, ref), requests):
                sched.finish(reqs[victim], Finish.ABORT.reason)
        plans = [sched.schedule() for sched in (fast, ref)]
        assert (plans[0] is None) == (plans[1] is None)
        if plans[0] is not None:
            assert plans[0].decode_seqs.tolist() == plans[1].decode_seqs.tolist()
            grammar_rows += _grammar_rows_verifying(fast, plans[0])
            for sched, plan in zip((fast, ref), plans):
                sched.release_drained(plan)
            in_flight.append((plans, _outcome(rng, plans[0])))
        if len(in_flight) > 1 or (in_flight and plans[0] is None):
            done, (tokens, emitted, finite) = in_flight.pop(0)
            got = [sched.apply_verified(plan, tokens, emitted, finite) for sched, plan in zip((fast, ref), done)]
            assert _by_request(got[0]) == _by_request(got[1])
            assert got[0].errored == got[1].errored
            codes_seen.update(got[1].finish.tolist())
            finished += int(np.count_nonzero(got[0].finish))
        for sched in (fast, ref):
            sched.check_integrity()
        assert _state(fast, requests[0]) == _state(ref, requests[1])
        if step > 300 and not in_flight and not fast.has_work():
            break
    assert not ref.has_work() and not in_flight
    # The workload reached every rule and the paths around them.
    assert {int(Finish.EOS), int(Finish.STOP_TOKEN), int(Finish.LENGTH)} <= codes_seen
    assert fast.num_preemptions > 0 and finished > 0 and grammar_rows > 0
    assert fast.blocks.num_free_blocks == fast.blocks.num_usable_blocks


def test_first_finish_cuts_at_the_first_finishing_token() -> None:
    tokens = np.array([[5, EOS, 6, 7, 8],   # EOS at 1
                       [5, EOS, 6, 7, 8],   # ignore_eos: max_tokens at 3
                       [5, 6, 9, 7, 8],     # stop id 9 at 2, but only two emitted
                       [5, 6, 9, 7, 8],     # stop id 9 at 2
                       [5, 6, 7, 8, 9]])    # nothing within the four emitted
    emitted = np.array([5, 5, 2, 5, 4])
    num_outputs = np.array([0, 6, 0, 0, 0])
    max_tokens = np.array([50, 10, 50, 50, 50])
    ignore_eos = np.array([False, True, False, False, False])
    stop_hits = tokens == 9
    stop_hits[[0, 1, 4]] = False
    cut = first_finish(tokens, emitted, num_outputs, max_tokens, ignore_eos, EOS, stop_hits)
    assert cut.kept.tolist() == [2, 4, 2, 3, 4]
    assert cut.codes.tolist() == [Finish.EOS, Finish.LENGTH, Finish.NONE, Finish.STOP_TOKEN, Finish.NONE]


def test_eos_outranks_a_stop_id_and_max_tokens_at_the_same_token() -> None:
    tokens = np.array([[EOS, 5]])
    cut = first_finish(tokens, np.array([2]), np.array([4]), np.array([5]), np.array([False]), EOS,
                       np.array([[True, False]]))
    assert cut.kept.tolist() == [1] and cut.codes.tolist() == [Finish.EOS]


def test_per_token_layout_puts_the_finish_on_a_rows_last_token() -> None:
    step = AppliedStep(np.array([7, 9]), np.array([1, 2, 3, 4]), np.array([0, Finish.EOS], dtype=np.int8),
                       num_tokens=np.array([3, 1]))
    flat = step.per_token()
    assert flat.seqs.tolist() == [7, 7, 7, 9]
    assert flat.token_ids.tolist() == [1, 2, 3, 4]
    assert flat.finish.tolist() == [0, 0, 0, Finish.EOS]


def test_a_row_keeps_at_most_two_steps_of_rejected_drafts():
    """``check_integrity``'s bound on what a speculative row may hold past its counted tokens: 2k. Step A
    reserves 1 + k positions from 24, step B (planned before A is reconciled) 1 + k more after A's drafts, both
    steps' drafts are all rejected, and step C, planned while waiting prompts take the whole token budget
    (``prefill_first``), verifies nothing and counts one token: the row then holds blocks 2k - 1 tokens past its count, a block more than a (k + 1)-token
    bound allows. One block more than that is a leak and is caught."""
    sched = _scheduler(True, 64)
    request = Request("0", 0, list(range(4, 28)), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), 0,
                      0.0)
    sched.add(request)

    def plan_and_release():
        plan = sched.schedule()
        sched.release_drained(plan)
        return plan

    prefill = plan_and_release()
    sched.apply(prefill, np.array([5]), np.ones(1, dtype=bool))
    step_a = plan_and_release()
    step_b = plan_and_release()
    assert step_a.spec_depth == step_b.spec_depth == DEPTH
    rejected = (np.full((1, DEPTH + 1), 5, dtype=np.int64), np.ones(1, dtype=np.int64), np.ones(1, dtype=bool))
    sched.apply_verified(step_a, *rejected)
    for seq in (1, 2):  # 2 x 130 prompt tokens: more than the budget left
        sched.add(Request(str(seq), seq, [6 + seq] * 130, SamplingParams(max_tokens=4, temperature=0.0), seq, 0.0))
    step_c = plan_and_release()
    assert step_c.spec_depth == 0
    sched.apply_verified(step_b, *rejected)
    row = request.token_row
    counted, held = int(sched.rows.num_computed[row]), int(sched.blocks.num_row_blocks[row])
    assert (counted, held) == (27, 3)  # blocks for 24 + 2 * (1 + k) = 34 tokens, 7 past the count
    assert held > sched.blocks.blocks_for(counted + DEPTH + 1)
    sched.check_integrity()
    sched.blocks.append_block(np.array([row]))  # a block nothing reserved
    with pytest.raises(IntegrityError, match="holds blocks for other than its computed tokens"):
        sched.check_integrity()
