"""The engine core's live requests: admission (after a grammar compiles, if any), ends, grammar advances.

Planner thread only, except ``GrammarState``'s compile worker, which talks back
through the core's inbox:

    frontend ── AddRequests ──► admit ─┬─ no grammar ─────────────────► Scheduler.add
                                       └─ grammar ─► compile worker ─► inbox: GrammarCompiled ─► Scheduler.add
    frontend ── Abort/Finish ─► end (a request still compiling ends there; its compile result is dropped)

Every request added and not yet ended is in exactly one of ``requests`` (the
scheduler knows it) and ``compiling`` (it does not yet).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from asyncbatch.engine.messages import AppliedStep, Finish, NewRequest, ended_only
from asyncbatch.engine.request import Request
from asyncbatch.engine.scheduler import RequestRefused, Scheduler
from asyncbatch.engine.structured_state import GrammarState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GrammarCompiled:
    """The compile worker finished a request's grammar (an inbox message of the core's own)."""

    seq: int
    future: Future


class LiveRequests:
    """Requests by seq between their ``AddRequests`` and their end; their grammar matchers."""

    def __init__(self, scheduler: Scheduler, grammar: GrammarState | None, send: Callable[[object], None],
                 inbox: queue.SimpleQueue, strict: bool = False) -> None:
        self.scheduler = scheduler
        # A request that fails to queue for a reason the scheduler did not foresee (a bug) ends alone and is
        # logged; ``strict`` (``debug_check_integrity``) raises instead, so that tests see the bug.
        self._strict = strict
        self.grammar = grammar
        self._send = send
        self._inbox = inbox
        self.requests: dict[int, Request] = {}
        self.compiling: dict[int, NewRequest] = {}  # waiting for their grammar; not in the scheduler yet

    def __len__(self) -> int:
        return len(self.requests) + len(self.compiling)

    def admit(self, requests: list[NewRequest]) -> None:
        refused = []
        for new in requests:
            if new.params.structured_outputs is not None and self.grammar is not None:
                self.compiling[new.seq] = new
                future = self.grammar.compile_async(new.params.structured_outputs)
                future.add_done_callback(lambda f, seq=new.seq: self._inbox.put(GrammarCompiled(seq, f)))
            elif not self._add(new):
                refused.append(new.seq)
            elif self.grammar is not None:  # allowed_token_ids / bad_words: masks without a grammar
                self.grammar.constrain(new.seq, new.params)
        if refused:
            self._send(ended_only(refused, Finish.REFUSED))

    def compiled(self, message: GrammarCompiled) -> None:
        new = self.compiling.pop(message.seq, None)
        if new is None:  # ended while compiling
            return
        try:
            matcher = message.future.result()
        except Exception:  # noqa: BLE001 - validated at submission; if the core disagrees, only this request ends
            self._send(ended_only([new.seq], Finish.GRAMMAR))
            return
        if not self._add(new):
            self._send(ended_only([new.seq], Finish.REFUSED))
            return
        self.grammar.add(new.seq, matcher)
        self.grammar.constrain(new.seq, new.params)

    def _add(self, new: NewRequest) -> bool:
        """Queue ``new``; False if the scheduler refused it (that request alone ends; the engine goes on)."""
        request = Request(str(new.seq), new.seq, new.prompt_token_ids, new.params, new.seed, new.arrival_time)
        try:
            self.scheduler.add(request)
        except RequestRefused:
            return False
        except Exception:
            if self._strict:
                raise
            # Scheduler.add changes shared state only by its last step (queuing), so the engine goes on intact.
            logger.exception("engine core: request seq %d could not be queued; it alone ends", new.seq)
            return False
        self.requests[new.seq] = request
        return True

    def end(self, seq: int, code: Finish) -> bool:
        """End ``seq`` (an abort, a stop string); False if it already ended."""
        if self.compiling.pop(seq, None) is not None:
            return True
        request = self.requests.get(seq)
        if request is None:
            return False
        self.forget(seq)
        self.scheduler.finish(request, Finish(code).reason)
        return True

    def forget(self, seq: int) -> None:
        """``seq`` ended (the scheduler has finished it): drop the references to it."""
        self.requests.pop(seq, None)
        if self.grammar is not None:
            self.grammar.drop(seq)

    def advance_grammars(self, applied: AppliedStep, ended: np.ndarray, ended_codes: np.ndarray
                         ) -> tuple[AppliedStep, np.ndarray, np.ndarray]:
        """Feed the kept tokens to their matchers; a token the grammar rejects ends its request
        (``Finish.GRAMMAR``) and is not kept. Returns the step's kept rows and ended seqs/codes, updated."""
        if self.grammar is None or not self.grammar.active:
            return applied, ended, ended_codes
        emptied = self.grammar.emptied
        if emptied and len(ended):  # a row its own constraints left nothing to sample: not the model's NaN
            ended_codes = np.where(np.isin(ended, list(emptied)), Finish.CONSTRAINED, ended_codes).astype(np.int8)
        # A row may have several tokens in a verify step: the matchers read them one by one, in order (the
        # masks allowed each after the ones before it). Tokens keep their order (logprob columns index them).
        applied = applied.per_token()
        rejected = self.grammar.advance(applied.seqs, applied.token_ids)
        if not rejected:
            return applied, ended, ended_codes
        ending = dict.fromkeys(applied.seqs[rejected].tolist())  # the requests that end, in order
        finished = set(applied.seqs[applied.finish != Finish.NONE].tolist())  # by the step itself (a stop)
        for seq in ending:
            if seq not in finished:
                self.scheduler.finish(self.requests[seq], Finish.GRAMMAR.reason)  # both codes' reason: "error"
        keep = np.ones(len(applied.seqs), dtype=bool)
        keep[rejected] = False
        kept, positions = applied.token_keys()
        bad = np.fromiter(ending, dtype=np.int64, count=len(ending))
        return (AppliedStep(applied.seqs[keep], applied.token_ids[keep], applied.finish[keep], applied.errored,
                            kept[keep], positions=positions[keep]),
                np.concatenate([ended, bad]),
                np.concatenate([ended_codes, np.where(np.isin(bad, list(emptied)), Finish.CONSTRAINED,
                                                      Finish.GRAMMAR).astype(np.int8)]))
