"""The user-facing API, shaped like vLLM's ``LLM``.

``LLM`` is thread-safe: any thread may call ``generate``, ``stream``, ``chat``
or ``abort`` at any time; requests from all of them are batched together by
the one planner thread.

It is the in-process ``EngineClient`` (``frontend.engine_client``): ``AsyncLLM``,
the HTTP server and the Ray replicas use it through that surface only. Every
prompt is validated once, by ``self.processor`` (``frontend.input_processor``);
``submit`` takes the validated requests as they are.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from numbers import Integral
from pathlib import Path

from asyncbatch.config import EngineConfig
from asyncbatch.engine.builder import resolve_model
from asyncbatch.engine.client import CoreClient
from asyncbatch.engine.control import (
    CheckIntegrity,
    CountRangesStart,
    CountRangesStop,
    DescribeExecutor,
    LastLaunchedStep,
    NumFreeBlocks,
    NumPreemptions,
    PrefixCacheKeys,
    PrefixCacheStats,
    ResetPrefixCache,
    SetNvtx,
)
from asyncbatch.engine.fork_server import start_early
from asyncbatch.engine.gil_tuning import hold_switch_interval, release_switch_interval
from asyncbatch.engine.messages import AbortRequests, AddRequests, NewRequest
from asyncbatch.errors import EngineDeadError
from asyncbatch.frontend.detokenizer import IncrementalDetokenizer, NullDetokenizer, decode_deferred
from asyncbatch.frontend.generation_defaults import sampling_defaults
from asyncbatch.frontend.input_processor import InputProcessor, ProcessedRequest, Prompt, with_priority
from asyncbatch.frontend.output_processor import OutputProcessor
from asyncbatch.frontend.request_handle import DeltaSink, RequestHandle
from asyncbatch.frontend.stop_strings import StopStringMatcher
from asyncbatch.model.loader import resolve_dtype
from asyncbatch.outputs import Logprobs, RequestMetrics, RequestOutput, StreamDelta, merge_completions
from asyncbatch.profiling.marks import RangeCounter, count_ranges, enable_nvtx, mark
from asyncbatch.profiling.timeline import Timeline
from asyncbatch.sampling_params import MAX_SEED, SamplingParams

__all__ = ["LLM", "Prompt"]


class LLM:
    """An inference engine over one model.

    ``LLM(model=None, device="auto", dtype="auto", max_num_seqs=256, max_num_batched_tokens=2048,
    max_model_len=None, block_size=16, seed=0, overlap=True, engine_process=True, sim=SimConfig(), ...)``;
    see ``EngineConfig`` for every keyword. An unknown keyword is a ``TypeError``.

    This object is the frontend: tokenization, detokenization, stop strings, streaming and metrics run
    in the caller's process; the engine core runs in a child process (``engine_process=False``: a thread).
    """

    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        if self.config.engine_process:
            start_early()  # the core's fork server imports the engine while the model resolves (engine.fork_server)
        resolved = resolve_model(self.config)
        defaults = sampling_defaults(resolved.spec.path, self.config.generation_config,
                                     self.config.override_generation_config)
        self._spec = resolved.spec
        self.tokenizer = resolved.tokenizer
        self.model_path: Path = resolved.spec.path
        self.device = resolved.spec.device
        self.dtype = None if self.device == "sim" else resolve_dtype(self.config.dtype, self.device)
        self.max_model_len = resolved.spec.max_model_len
        self.simulated = self.device == "sim"
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._handles: dict[int, RequestHandle] = {}  # unfinished, by seq (the output thread removes them)
        self._by_id: dict[str, RequestHandle] = {}  # by request_id, for abort and the uniqueness check
        self.timeline = Timeline()
        eos = self._spec.eos_token_id
        # The client's threads must not hold this object: an LLM dropped without close() is collected,
        # and its __del__ stops the core. So they get the client's own send and a weak callback.
        processor = OutputProcessor(self._handles, self.timeline, frozenset(t for t in (eos,) if t is not None),
                                    _unset_send, ack_steps=not self.config.overlap)
        self._switch_interval_held = False
        if not self.config.engine_process and self.config.switch_interval_s is not None:
            hold_switch_interval(self.config.switch_interval_s)  # the core's threads share this process
            self._switch_interval_held = True
        fail_all = weakref.WeakMethod(self._fail_all)
        self._client = CoreClient(self.config, self._spec, processor.process,
                                    lambda error: (fail_all() or _ignore)(error))
        processor.send = self._client.send
        self._usable_tokens = self._client.ready.num_usable_blocks * self.config.block_size
        self.processor = InputProcessor(self.tokenizer, self._spec.vocab_size, self.max_model_len,
                                        self._usable_tokens, self._spec.eos_token_id,
                                        self.config.structured_outputs_backend, self.config.scheduling_policy,
                                        defaults)
        if self.config.structured_outputs_warmup:
            self.processor.warm_up_grammar()
        self._preemptions = 0
        self._prefix_cache: dict = {"hit_rate": 0.0, "cached_blocks": 0}

    @property
    def _core(self):
        """The engine core object (``engine_process=False`` only: tests and debugging reach into it)."""
        if self._client.core is None:
            raise RuntimeError("the engine core runs in another process; use LLM(..., engine_process=False)")
        return self._client.core

    # -- submission -----------------------------------------------------------
    def submit(self, requests: Sequence[ProcessedRequest], request_ids: Sequence[str | None] | None = None, *,
               streaming: bool = False, make_sink: Callable[[], DeltaSink] | None = None,
               text_by_caller: bool = False, parent_id: str | None = None) -> list[RequestHandle]:
        """Register a handle per request, then send them to the core in one message.

        ``requests`` come from ``self.processor`` and are not checked again. ``request_ids`` names each one
        (None: ``req-<n>``); ``make_sink`` gives each streaming handle its delta sink (the asyncio API's),
        instead of a blocking queue. ``text_by_caller``: the caller decodes the texts the output thread would
        decode at each end (``RequestHandle.text_by_caller``; ``generate`` does, with ``decode_deferred``).
        ``parent_id``: they are the completions of that stream (``submit_stream``).
        """
        names = list(request_ids) if request_ids is not None else [None] * len(requests)
        if len(names) != len(requests):
            raise ValueError(f"request_ids has {len(names)} entries for {len(requests)} requests")
        for name in names:
            if name is not None and not isinstance(name, str):
                raise TypeError(f"request_id must be a string, got {type(name).__name__}")
        handles, new = [], []
        with mark("submit"), self._lock:
            if self._client.error is not None:
                raise EngineDeadError("the engine has failed; create a new LLM") from self._client.error
            if len(self._by_id) > 4096:
                self._by_id = {k: h for k, h in self._by_id.items() if not h.finished}
            for name in names:  # before anything is registered: a refusal leaves no trace
                existing = self._by_id.get(name) if name is not None else None
                if existing is not None and not existing.finished:
                    raise ValueError(f"request_id {name!r} is already in use by a live request")
            if len({n for n in names if n is not None}) < sum(n is not None for n in names):
                raise ValueError("request_ids must be distinct")
            for request in requests:
                if request.params.n != 1:
                    raise ValueError(f"SamplingParams.n must be 1 for a request submitted alone, got {request.params.n}"
                                     ": generate() and chat() serve n > 1 (one RequestOutput, n outputs), stream() "
                                     "and the asyncio API's generate() n streams (submit_stream)")
            for name, request in zip(names, requests):
                ids, params = request.prompt_token_ids, request.params
                seq = next(self._ids)
                rid = name if name is not None else f"req-{seq}"
                seed = params.seed if params.seed is not None else _derive_seed(self.config.seed, seq)
                now = time.perf_counter()
                handle = RequestHandle(
                    seq, rid, request.prompt, ids,
                    self._detokenizer(ids, params),
                    StopStringMatcher(params.stop_strings, params.include_stop_str_in_output),
                    RequestMetrics(arrival_time=now), simulated=self.simulated, streaming=streaming,
                    logprobs=None if params.logprobs is None else Logprobs(),
                    prompt_logprobs=None if params.prompt_logprobs is None else Logprobs(),
                    text_by_caller=text_by_caller, include_stop_token=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens, parent_id=parent_id)
                if make_sink is not None:
                    handle.deltas = make_sink()
                self._handles[seq] = handle
                self._by_id[rid] = handle
                handles.append(handle)
                new.append(NewRequest(seq, ids, params, seed, now))
            self._client.send(AddRequests(new))
        return handles

    def _detokenizer(self, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | NullDetokenizer:
        if self.tokenizer is None or not params.detokenize:
            return NullDetokenizer()
        return IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        Every prompt is validated before any is submitted, so a bad one raises
        and queues nothing. ``priority`` (vLLM's argument): one per prompt, the
        ``SamplingParams.priority`` of each (``scheduling_policy="priority"``).
        ``SamplingParams.n > 1``: the prompt's ``n`` completions are ``n`` requests, batched with the rest and
        returned as one ``RequestOutput`` whose ``outputs`` hold them in index order. With prefix caching (the
        default) the first computes the prompt and the others wait a step and reuse its blocks.
        """
        # One text prompt may be passed bare; token-id prompts always come in a list ([[1, 2, 3]]),
        # so a flat list of ints is a list of (invalid) prompts, never silently one prompt.
        if isinstance(prompts, str) or prompts is None or not isinstance(prompts, Sequence):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(prompts)
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
            params_list = [with_priority(sp, p) for sp, p in zip(params_list, priority)]
        groups = [self.processor.process(p, sp).completions() for p, sp in zip(prompts, params_list)]
        handles = self.submit([request for group in groups for request in group], text_by_caller=True)
        outputs = iter(self._collect(handles, use_tqdm))
        return [merge_completions([next(outputs) for _ in group]) for group in groups]

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``, ``chat`` and ``stream`` use when given no ``SamplingParams`` (vLLM's): the model's
        ``generation_config.json`` sampling fields under ``generation_config="auto"``, else the neutral defaults. A
        new object each call."""
        return self.processor.default_params()

    def get_tokenizer(self):
        """The engine's tokenizer (a transformers tokenizer; None with ``skip_tokenizer_init``), vLLM's."""
        return self.tokenizer

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
            self._decode_texts(handles)
            return outputs
        except BaseException:
            for handle in handles:
                if not handle.finished:
                    self.abort(handle.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()

    def _decode_texts(self, handles: list[RequestHandle]) -> None:
        """The texts the output thread left to the caller (``RequestHandle.undecoded``), decoded together once
        every output is in: the engine no longer needs the CPU, and ``decode_batch`` releases the GIL and uses
        every core. Timed into ``stats()``' ``generate_detok_ms``."""
        undecoded = [handle for handle in handles if handle.undecoded]
        if not undecoded:
            return
        start = time.perf_counter()
        with mark("detokenize"):
            try:
                texts: list[str | None] = list(decode_deferred([handle.detokenizer for handle in undecoded]))
            except Exception:  # noqa: BLE001 - one request's failure must not cost the others their texts
                texts = [None] * len(undecoded)
        for handle, text in zip(undecoded, texts):
            if text is not None:
                handle.publish_text(text)
                continue
            try:
                handle.publish_text(decode_deferred([handle.detokenizer])[0])
            except Exception as exc:  # noqa: BLE001 - as the output thread does, this request fails alone
                handle.publish_text("", error=f"output processing failed: {exc!r}")
        self.timeline.add_caller_decode(len(undecoded), time.perf_counter() - start)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.
        ``continue_final_message=True`` (with ``add_generation_prompt=False``) continues the last message, an
        assistant message that starts the answer, instead of starting a new one. As vLLM's ``LLM.chat``:
        ``chat_template`` replaces the model's template for these conversations, ``chat_template_kwargs`` go to
        the template as variables, and ``tools`` go to it as ``tools`` (rendered by a template that has a tools
        section; no output is parsed into calls here: the server's ``tools`` does that)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = dict(chat_template_kwargs or {})
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools is not None:
            kwargs["tools"] = tools
        token_prompts = [self.chat_prompt_ids(conv, add_generation_prompt, continue_final_message, **kwargs)
                         for conv in conversations]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, **template_kwargs: object) -> list[int]:
        """The token ids of one conversation under the model's chat template (or ``chat_template=``)."""
        return self.processor.chat_prompt_ids(messages, add_generation_prompt, continue_final_message,
                                              **template_kwargs)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """Yield deltas as tokens arrive; closing the iterator early aborts the request. Leaving a ``for`` loop
        over ``llm.stream(...)`` closes it (the loop held its only reference); an iterator kept elsewhere (a
        list of streams) is only suspended by leaving a loop over it, and its request runs on until ``close()``
        or ``abort``. With ``n > 1`` the completions' deltas interleave, each with its ``index``, until every
        one has finished (``StreamDelta``)."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], Integral):  # token ids: numpy's too
            raise TypeError("stream takes one prompt (a string, a list of token ids or a prompt dict), got a list of "
                            f"{type(prompt[0]).__name__}; generate takes a list, or stream each prompt")
        request = self.processor.process(prompt, sampling_params)
        shared: queue.SimpleQueue = queue.SimpleQueue()  # every completion's deltas, in arrival order
        parent, handles = self.submit_stream(request, request_id, make_sink=lambda: shared)
        return self._stream(parent, handles, shared)

    def submit_stream(self, request: ProcessedRequest, request_id: str | None,
                      make_sink: Callable[[], DeltaSink]) -> tuple[str, list[RequestHandle]]:
        """Submit one streamed request's ``params.n`` completions; returns the stream's request id and their
        handles in index order. With ``n > 1`` completion ``k`` runs as request ``<request_id>-<k>`` (the id
        is made here when None) and ``abort(request_id)`` stops them all."""
        children = request.completions()
        if len(children) == 1:
            (handle,) = self.submit(children, [request_id], streaming=True, make_sink=make_sink)
            return handle.request_id, [handle]
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        parent = request_id if request_id is not None else f"req-{next(self._ids)}"
        with self._lock:
            live = self._by_id.get(parent)
            if (live is not None and not live.finished) or self._completions_of(parent):
                raise ValueError(f"request_id {parent!r} is already in use by a live request")
        handles = self.submit(children, [f"{parent}-{k}" for k in range(len(children))], streaming=True,
                              make_sink=make_sink, parent_id=parent)
        return parent, handles

    def _completions_of(self, parent: str) -> list[RequestHandle]:
        """The live completions of stream ``parent`` (``submit_stream``): rare, so the live handles are scanned."""
        return [h for h in list(self._handles.values()) if h.parent_id == parent]

    def _stream(self, parent: str, handles: list[RequestHandle], deltas: queue.SimpleQueue) -> Iterator[StreamDelta]:
        index = {handle.request_id: k for k, handle in enumerate(handles)}
        unfinished = len(handles)
        try:
            while unfinished:
                item = deltas.get()
                if isinstance(item, BaseException):
                    raise item
                if len(handles) > 1:
                    item.request_id, item.index = parent, index[item.request_id]
                yield item
                if item.finish_reason is not None:
                    unfinished -= 1
        finally:
            for handle in handles:
                if not handle.finished:
                    self.abort(handle.request_id)

    def num_requests(self) -> tuple[int, int]:
        """(unfinished, not yet scheduled) requests as this process sees them now; asks the core nothing."""
        handles = list(self._handles.values())
        return len(handles), sum(h.metrics.first_scheduled_time is None for h in handles)

    def abort(self, request_id: str) -> None:
        """Stop a request (or every completion of a stream of ``n > 1``); it finishes with
        ``finish_reason="abort"`` within one step."""
        handle = self._by_id.get(request_id)
        if handle is not None:
            handles = [handle]
        else:
            handles = self._completions_of(request_id)
        seqs = [h.seq for h in handles if not h.finished]
        if seqs and self._client.alive:
            self._client.send(AbortRequests(seqs))

    def abort_all(self) -> int:
        """Abort every unfinished request (a server's drain timeout); returns how many."""
        handles = [h for h in list(self._handles.values()) if not h.finished]
        for handle in handles:
            self.abort(handle.request_id)
        return len(handles)

    @property
    def alive(self) -> bool:
        """False once the engine failed or was closed."""
        return self._client.alive

    # -- measurement ----------------------------------------------------------
    def stats(self) -> dict:
        """Timeline summary of the current window (see ``asyncbatch.profiling.timeline.summarize``)."""
        stats = self.timeline.stats()
        if self._client.alive:  # after close() or a failure, the last count read stands
            self._preemptions = self._client.call(NumPreemptions())
            self._prefix_cache = self.prefix_cache_stats()
        stats.update(mode="overlap" if self.config.overlap else "sync", backend=self.device,
                     simulated=self.simulated, preemptions=self._preemptions,
                     prefix_cache_hit_rate=self._prefix_cache["hit_rate"],
                     prefix_cached_blocks=self._prefix_cache["cached_blocks"])
        return stats

    def prefix_cache_stats(self, timeout: float = 60.0) -> dict:
        """The engine core's prefix-cache counters (``enabled``, ``prompt_tokens``, ``cached_tokens``,
        ``hit_rate``, ``cached_blocks``, ``evictions``), read now."""
        return self._client.call(PrefixCacheStats(), timeout=timeout)

    def prefix_cache_keys(self, max_blocks: int = 4096, timeout: float = 60.0) -> list[int]:
        """Chain keys (``engine.prefix_cache.chain_keys``) of up to ``max_blocks`` cached KV blocks, held ones
        first, then the most recently released: what a cache-aware router matches a prompt's keys against."""
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        return self._client.call(PrefixCacheKeys(max_blocks), timeout=timeout)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block no running request uses, and zero the hit counters; True if the cache
        is now empty (False: blocks of running requests stay cached)."""
        return self._client.call(ResetPrefixCache())

    def reset_stats(self) -> None:
        self.timeline.reset()

    def wait_settled(self, timeout_s: float) -> bool:
        """Wait until every step launched so far was applied and output-processed (a last overlap step may
        still run after ``generate`` returned); False if that took longer than ``timeout_s``."""
        return self.timeline.wait_for_step(self._client.call(LastLaunchedStep()), timeout_s)

    def export_trace(self, path, torch_trace=None) -> dict:
        """Write the current timeline window as Chrome/Perfetto trace JSON (see ``profiling.trace_export``)."""
        from asyncbatch.profiling.trace_export import export_trace

        return export_trace(self, path, torch_trace=torch_trace)

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` if KV block or token-row accounting is inconsistent (call when idle)."""
        self._client.call(CheckIntegrity())

    @property
    def num_free_blocks(self) -> int:
        return self._client.call(NumFreeBlocks())

    def set_nvtx(self, on: bool) -> None:
        """NVTX ranges on or off in this process and in the engine core's (for an Nsight session)."""
        enable_nvtx(on)
        if self.config.engine_process:
            self._client.call(SetNvtx(on))

    @contextlib.contextmanager
    def count_ranges(self) -> Iterator[RangeCounter]:
        """``profiling.marks.count_ranges`` over the frontend and the engine core: ranges on while counting."""
        with count_ranges() as counter:
            if self.config.engine_process:
                self._client.call(CountRangesStart())
            try:
                yield counter
            finally:
                if self.config.engine_process:
                    counter.add_counts(*self._client.call(CountRangesStop()))

    @property
    def executor_info(self) -> dict:
        """The executor's ``describe()``, read now (CUDA graph counters move as steps run)."""
        return self._client.call(DescribeExecutor())

    @property
    def num_usable_blocks(self) -> int:
        return self._client.ready.num_usable_blocks

    # -- lifetime -------------------------------------------------------------
    def _fail_all(self, error: BaseException) -> None:
        for handle in list(self._handles.values()):
            handle.fail(error)

    def close(self) -> None:
        """Stop the engine core; callers still waiting get ``EngineDeadError``."""
        client = getattr(self, "_client", None)
        if client is None:
            return
        client.close()
        processor = getattr(self, "processor", None)
        if processor is not None:
            processor.close()
        if self._switch_interval_held:
            self._switch_interval_held = False
            release_switch_interval(self.config.switch_interval_s)
        self._fail_all(EngineDeadError("the engine was closed before the request finished"))

    def __enter__(self) -> LLM:  # noqa: PYI034 - LLM is not meant to be subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn modules down
            self.close()


def _unset_send(message: object) -> None:
    raise RuntimeError("the output processor sent a message before the engine core was connected")


def _ignore(error: BaseException) -> None:
    """The LLM is gone; nobody is waiting."""


def _derive_seed(engine_seed: int, seq: int) -> int:
    """A per-request seed from the engine seed and arrival order (deterministic across runs)."""
    return uuid.uuid5(uuid.NAMESPACE_OID, f"{engine_seed}:{seq}").int & MAX_SEED
