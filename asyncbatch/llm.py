"""The user-facing API, shaped like vLLM's ``LLM``.

``LLM`` is thread-safe: any thread may call ``generate``, ``stream``, ``chat``
or ``abort`` at any time; requests from all of them are batched together by
the one planner thread.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from asyncbatch.config import EngineConfig
from asyncbatch.engine.builder import build_engine
from asyncbatch.engine.request import Request
from asyncbatch.frontend.detokenizer import IncrementalDetokenizer
from asyncbatch.frontend.prompt_validation import check_fits, prompt_token_ids
from asyncbatch.frontend.request_handle import RequestHandle
from asyncbatch.frontend.stop_strings import StopStringMatcher
from asyncbatch.outputs import RequestMetrics, RequestOutput, StreamDelta
from asyncbatch.profiling.marks import mark
from asyncbatch.sampling_params import MAX_SEED, SamplingParams

Prompt = str | list[int]


class LLM:
    """An inference engine over one model.

    ``LLM(model=None, device="auto", dtype="auto", max_num_seqs=256, max_num_batched_tokens=2048,
    max_model_len=None, block_size=16, seed=0, overlap=True, sim=SimConfig(), ...)``; see
    ``EngineConfig`` for every keyword. An unknown keyword is a ``TypeError``.
    """

    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        built = build_engine(self.config)
        self._engine = built
        self._core = built.core
        self.tokenizer = built.tokenizer
        self.model_path: Path = built.model_path
        self.device = built.device
        self.dtype = built.dtype
        self.max_model_len = built.max_model_len
        self.simulated = built.device == "sim"
        self._ids = itertools.count()
        self._usable_tokens = self._core.scheduler.blocks.num_usable_blocks * self.config.block_size

    # -- submission -----------------------------------------------------------
    def _prepare(self, prompt: Prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        ids = prompt_token_ids(prompt, self.tokenizer, self._engine.vocab_size)
        check_fits(len(ids), params, self.max_model_len, self._usable_tokens)
        return ids, params

    def _submit(self, prompt: Prompt, ids: list[int], params: SamplingParams, request_id: str | None = None,
                streaming: bool = False) -> RequestHandle:
        with mark("submit"):
            seq = next(self._ids)
            rid = request_id if request_id is not None else f"req-{seq}"
            if not isinstance(rid, str):
                raise TypeError(f"request_id must be a string, got {type(rid).__name__}")
            seed = params.seed if params.seed is not None else _derive_seed(self.config.seed, seq)
            now = time.perf_counter()
            handle = RequestHandle(
                rid, prompt if isinstance(prompt, str) else None, ids,
                IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens),
                StopStringMatcher(params.stop_strings, params.include_stop_str_in_output),
                RequestMetrics(arrival_time=now), simulated=self.simulated, streaming=streaming)
            self._core.submit(Request(rid, seq, ids, params, seed, now, handle=handle))
        return handle

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        Every prompt is validated before any is submitted, so a bad one raises
        and queues nothing.
        """
        # One text prompt may be passed bare; token-id prompts always come in a list ([[1, 2, 3]]),
        # so a flat list of ints is a list of (invalid) prompts, never silently one prompt.
        if isinstance(prompts, str) or prompts is None or not isinstance(prompts, Sequence):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(prompts)
        prepared = [self._prepare(p, sp) for p, sp in zip(prompts, params_list)]
        handles = [self._submit(p, ids, sp) for p, (ids, sp) in zip(prompts, prepared)]
        return self._collect(handles, use_tqdm)

    def _collect(self, handles: list[RequestHandle], use_tqdm: bool) -> list[RequestOutput]:
        bar = None
        if use_tqdm and len(handles) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(handles), desc="generate", unit="req", dynamic_ncols=True)
        try:
            outputs = []
            for handle in handles:
                outputs.append(handle.wait())
                if bar is not None:
                    bar.update(1)
            return outputs
        except BaseException:
            for handle in handles:
                if not handle.finished:
                    self.abort(handle.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
                   for conv in conversations]
        token_prompts = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """Yield deltas as tokens arrive; leaving the loop early aborts the request."""
        ids, params = self._prepare(prompt, sampling_params)
        handle = self._submit(prompt, ids, params, request_id, streaming=True)
        return self._stream(handle)

    def _stream(self, handle: RequestHandle) -> Iterator[StreamDelta]:
        try:
            while True:
                item = handle.deltas.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not handle.finished:
                self.abort(handle.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; it finishes with ``finish_reason="abort"`` within one step."""
        self._core.abort(request_id)

    # -- measurement ----------------------------------------------------------
    def stats(self) -> dict:
        """Timeline summary of the current window (see ``asyncbatch.profiling.timeline.summarize``)."""
        stats = self._core.timeline.stats()
        stats.update(mode="overlap" if self.config.overlap else "sync", backend=self.device,
                     simulated=self.simulated, preemptions=self._core.scheduler.num_preemptions)
        return stats

    def reset_stats(self) -> None:
        self._core.timeline.reset()

    def export_trace(self, path, torch_trace=None) -> dict:
        """Write the current timeline window as Chrome/Perfetto trace JSON (see ``asyncbatch.profiling.trace_export``)."""
        from asyncbatch.profiling.trace_export import export_trace

        return export_trace(self, path, torch_trace=torch_trace)

    @property
    def timeline(self):
        return self._core.timeline

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` if KV block or token-row accounting is inconsistent (call when idle)."""
        self._core.scheduler.check_integrity()

    @property
    def num_free_blocks(self) -> int:
        return self._core.scheduler.blocks.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self._core.scheduler.blocks.num_usable_blocks

    # -- lifetime -------------------------------------------------------------
    def close(self) -> None:
        """Stop every engine thread; callers still waiting get ``EngineDeadError``."""
        core = getattr(self, "_core", None)
        if core is not None:
            core.close()

    def __enter__(self) -> LLM:  # noqa: PYI034 - LLM is not meant to be subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn modules down
            self.close()


def _derive_seed(engine_seed: int, seq: int) -> int:
    """A per-request seed from the engine seed and arrival order (deterministic across runs)."""
    return uuid.uuid5(uuid.NAMESPACE_OID, f"{engine_seed}:{seq}").int & MAX_SEED
