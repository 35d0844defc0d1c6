"""The ``cuda`` backend: three streams, pinned staging buffers, and captured graphs for decode steps.

The planner thread launches each step itself; nothing here waits for the
device except ``wait`` (the caller's later wait for step N's tokens). The one
wait on the launch path is the planner's staging fence, which fires on the
``h2d_end`` event recorded below.

    planner     [launch N: pad, pack, 1 copy, replay, D2H]   [launch N+1 ...]      [wait N: d2h event]
    H2D stream     [staging A → static set A]●h2d_end                [staging B → set B]●
    compute                   (wait ●)[start● graph(A, bucket, variant) end●]  (wait ●)[ step N+1 ...
    D2H stream                                          (wait end●)[ids N]●d2h → set A free again

Which path a step takes (``_graph_plan``): a captured graph when graphs are
on, the step is decode-only (``num_decode == num_tokens``) and fits the
largest bucket; otherwise the eager path (prefill, mixed steps, oversized
batches), whose inputs are copied into fresh device tensors and which runs
the same model with the Triton prefill kernel. A decode step with penalties
or sampler extras (bias, logprobs, grammar) replays the graph of its forward
alone (``SamplingVariant.HIDDEN``: the final hidden states) and computes its
logits and samples eagerly after the replay, so one such request no longer
turns every step it is in into an eager one (2.8x slower on an H200:
profiles/gpu-check-nvidia-h200-2026-12-04).

The step's model, KV cache, token buffer and eager path are a ``TorchStep``
(shared with the ``cpu`` backend), called from the planner thread: no device
thread exists on this backend.

A step with grammar rows enqueues only its forward at launch; the planner
fills the mask while it runs and ``masks_ready`` enqueues the mask's copy (from
a pinned buffer), the sampling and the D2H copy behind it on the same streams:

    planner     [launch N+1: forward only][wait N][apply N, fill mask N+1][masks_ready: sample N+1, D2H]
    compute       [ step N ][ forward N+1 ...............................][sample N+1]

Stream-order invariants:
  * the H2D copy into static set ``s`` waits for ``_set_free[s]``, the D2H event
    of the last step that replayed set ``s`` (its graph read the inputs before
    that and its outputs were copied out by then); a graph's outputs are set
    ``s``'s static outputs, outside the graphs' shared pool, so step N+1's
    replay (the other set) cannot overwrite step N's while they are copied out;
  * the compute stream waits for the step's ``h2d_end``; the D2H stream waits
    for its ``end``;
  * an eager step's device tensors stay referenced in ``_in_flight`` until
    ``wait`` has seen its D2H event;
  * every host-to-device copy reads the step's staging buffer, behind its fence;
    the pinned output buffers alternate by step, which holds because at most
    two steps are in flight (step N+2 is launched only after ``wait(N)``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from asyncbatch.engine.step_contract import StepMeta, blocks_for_tokens
from asyncbatch.executors.base import Executor, StepHandle, StepResult
from asyncbatch.executors.decode_graph import DecodeGraphStep, SamplingVariant
from asyncbatch.executors.torch_executor import DeviceStep, StepOutcome, TorchStep
from asyncbatch.model.llama import CausalLM
from asyncbatch.model.paged_attention import triton_kernels
from asyncbatch.profiling.marks import mark
from asyncbatch.sampling.token_bitmask import bitmask_words
from cuda_graphs import CudaGraphBackend, GraphRunner, normalize_batch_sizes

logger = logging.getLogger(__name__)

# "1": the model's norms, residual adds, rotary and SiLU x up run as ``fused_elementwise``'s kernels (off until
# a GPU has timed them: scripts/gpu_check.sh profiles a step both ways).
FUSED_ELEMENTWISE_ENV = "ASYNCBATCH_FUSED_ELEMENTWISE"
STAGING_BUFFERS = 2  # the engine's double buffer: one static input set per staging buffer
# Event times are float32 milliseconds since a reference event: 1 s keeps them to ~0.06 us (after 33 s
# their step would be ~4 us, as large as the idle gaps being measured), so the reference moves on.
REANCHOR_MS = 1000.0
DEFAULT_CAPTURE_VARIANTS = (SamplingVariant.GREEDY, SamplingVariant.SAMPLE)  # FILTERED is captured on first use


class GraphPlan(NamedTuple):
    set_index: int
    rows: int
    bucket: int
    variant: SamplingVariant


@dataclass(slots=True)
class _StepEvents:
    h2d_start: torch.cuda.Event = field(default_factory=lambda: torch.cuda.Event(enable_timing=True))
    h2d_end: torch.cuda.Event = field(default_factory=lambda: torch.cuda.Event(enable_timing=True))
    start: torch.cuda.Event = field(default_factory=lambda: torch.cuda.Event(enable_timing=True))
    sample: torch.cuda.Event = field(default_factory=lambda: torch.cuda.Event(enable_timing=True))
    end: torch.cuda.Event = field(default_factory=lambda: torch.cuda.Event(enable_timing=True))
    d2h: torch.cuda.Event = field(default_factory=lambda: torch.cuda.Event(enable_timing=True))


class CudaExecutor(Executor):
    """Launches each step from the planner thread onto three CUDA streams (see the module docstring).

    ``enable_cuda_graphs`` captures ``capture_variants`` for every bucket of
    ``cuda_graph_batch_sizes`` (default ``cuda_graphs.default_batch_sizes``) and
    both staging buffers at construction, after the KV cache exists; other variants
    are captured on first use. ``max_blocks_per_seq`` must equal the width of
    the staging buffers' block tables (default: derived from the model's positions).
    """

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_num_seqs: int,
                 device: torch.device, *, max_blocks_per_seq: int | None = None, enable_cuda_graphs: bool = True,
                 cuda_graph_batch_sizes: tuple[int, ...] | None = None,
                 capture_variants: tuple[SamplingVariant, ...] = DEFAULT_CAPTURE_VARIANTS) -> None:
        device = torch.device(device)
        self._check_device(device)
        self._triton = triton_kernels(device)  # the Triton attention module, or None (torch reference)
        if self._triton is not None and os.environ.get(FUSED_ELEMENTWISE_ENV) == "1":
            from asyncbatch.model import fused_elementwise

            fused_elementwise.enable(model)
        self._torch_step = TorchStep(model, kv_caches, max_num_seqs, device, non_blocking_uploads=True,
                                     paged=self._triton is not None)
        self.model, self.kv_caches, self.token_buffer = model, kv_caches, self._torch_step.token_buffer
        self.device = device
        self.name = device.type
        self.is_cuda = device.type == "cuda"  # the engine pins its staging buffers for this executor
        self.forward_hook: Callable[[StepMeta], None] | None = None  # tests inject faults here (eager steps)
        block_size = kv_caches[0][0].shape[1]
        # The engine's block tables are max_model_len / block_size wide; the model's rotary table is max_model_len.
        self.max_blocks_per_seq = max_blocks_per_seq or blocks_for_tokens(model.rope_cos.shape[0], block_size)
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.compute_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self._out_host = [self._pinned(max_num_seqs) for _ in range(2)]
        self._finite_host = [self._pinned(max_num_seqs, dtype=torch.bool) for _ in range(2)]
        self._in_flight: dict[int, tuple] = {}  # eager steps' tensors, alive until their D2H event fired
        # Grammar steps whose forward is enqueued and whose sampling waits for ``masks_ready``.
        self._deferred: dict[int, tuple] = {}
        words = bitmask_words(model.config.vocab_size)
        self._mask_host = [self._pinned(max_num_seqs, words, dtype=torch.int32) for _ in range(2)]
        self._set_free: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS
        self.forward_only_steps = 0  # decode steps that replayed the HIDDEN graph and sampled eagerly
        self.graphs: GraphRunner | None = None
        self.graphs_off_reason = "disabled (enable_cuda_graphs=False)"
        if enable_cuda_graphs:
            self._build_graphs(max_num_seqs, cuda_graph_batch_sizes, capture_variants)
        # Host clock of a reference event, so CUDA event times map onto the timeline's clock
        # (``wait`` moves the reference forward every REANCHOR_MS).
        self._ref_event = torch.cuda.Event(enable_timing=True)
        self._ref_event.record()
        self._ref_event.synchronize()
        self._ref_host = time.perf_counter()

    def _build_graphs(self, max_num_seqs: int, sizes: tuple[int, ...] | None,
                      variants: tuple[SamplingVariant, ...]) -> None:
        # Without the Triton decode kernel a graph would gather all max_blocks_per_seq blocks of every row.
        if self._triton is None:
            self.graphs_off_reason = "off: the Triton attention kernels are unavailable"
            logger.warning("CUDA graphs %s", self.graphs_off_reason)
            return
        batch_sizes = normalize_batch_sizes(sizes, max_num_seqs)
        step = DecodeGraphStep(self.model, self.kv_caches, self.token_buffer, batch_sizes[-1],
                               self.max_blocks_per_seq)
        self._decode_step = step
        self.graphs = GraphRunner(step, batch_sizes, STAGING_BUFFERS, self.device, CudaGraphBackend(self.device))
        self.graphs_off_reason = ""
        with torch.inference_mode():
            self.graphs.capture_all(variants)
        torch.cuda.synchronize(self.device)

    def _check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaExecutor needs a CUDA device, got {device}")

    @staticmethod
    def _pinned(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, pin_memory=True)

    # -- launch ---------------------------------------------------------------------
    def _graph_plan(self, meta: StepMeta) -> GraphPlan | None:
        """The graph a decode-only step replays: one that samples, or (penalties, sampler extras) the forward
        alone (``HIDDEN``), whose sampling then runs eagerly; None for the eager path."""
        nd = meta.num_decode
        if self.graphs is None or nd == 0 or nd != meta.num_tokens:
            return None
        eager_sampling = meta.any_penalty or meta.extras is not None
        if eager_sampling and self._torch_step.spec is not None:  # verify steps have their own sampler
            return None
        bucket = self.graphs.bucket_for(nd)
        if bucket is None:
            return None
        if meta.staging.index >= STAGING_BUFFERS or meta.staging.decode_block_tables.shape[1] != self.max_blocks_per_seq:
            raise ValueError(f"staging buffer {meta.staging.index} with {meta.staging.decode_block_tables.shape[1]} blocks "
                             f"per row does not match the graphs' {STAGING_BUFFERS} sets of {self.max_blocks_per_seq}")
        variant = SamplingVariant.HIDDEN if eager_sampling else SamplingVariant.for_step(meta)
        return GraphPlan(meta.staging.index, nd, bucket, variant)

    def _capture_missing(self, plan: GraphPlan) -> None:
        """Capture a graph on first use, ordered after every earlier use of its input set."""
        with torch.cuda.stream(self.compute_stream), torch.inference_mode(), mark("capture"):
            free = self._set_free[plan.set_index]
            if free is not None:
                self.compute_stream.wait_event(free)
            self.graphs.capture(plan.set_index, plan.bucket, plan.variant, lazy=True)
            captured = torch.cuda.Event()
            captured.record()
        self._set_free[plan.set_index] = captured  # the H2D copy must not refill the set before warm-up ends

    def launch(self, meta: StepMeta) -> StepHandle:
        handle = StepHandle(meta.step_id, time.perf_counter())
        plan = self._graph_plan(meta)
        if plan is not None and not self.graphs.has(plan.set_index, plan.bucket, plan.variant):
            self._capture_missing(plan)
        ev = _StepEvents()
        step: DeviceStep | None = None
        if plan is not None:  # the host's padding and packing first: the h2d events then time the copy alone
            with mark("pack", meta.step_id):
                self.graphs.pack(plan.set_index, self._decode_step.host_arrays(meta.staging), plan.rows, plan.bucket)
        with torch.cuda.stream(self.h2d_stream), mark("h2d", meta.step_id):
            free = self._set_free[plan.set_index] if plan is not None else None
            if free is not None:
                self.h2d_stream.wait_event(free)
            ev.h2d_start.record()  # after the wait, so h2d_ms is the copies alone
            if plan is None:
                step = self._torch_step.copy_in(meta)
            elif plan.variant is SamplingVariant.HIDDEN:
                step = self._torch_step.copy_in(meta, forward=False)  # the sampler's inputs; the graph has the rest
            if plan is not None:
                self.graphs.upload(plan.set_index, plan.bucket)
            ev.h2d_end.record()
        meta.staging.fence.signal_with_cuda_event(ev.h2d_end)
        with torch.cuda.stream(self.compute_stream), torch.inference_mode():
            self.compute_stream.wait_event(ev.h2d_end)
            ev.start.record()
            if plan is not None and plan.variant is SamplingVariant.HIDDEN:
                logits = self._replay_forward(meta, plan)
            elif plan is None and meta.extras is not None and meta.extras.grammar is not None:
                logits = self._torch_step.forward(meta, step, self.forward_hook)
            else:
                logits = None
            if logits is not None and meta.extras is not None and meta.extras.grammar is not None:
                # Only the forward now; sampling is enqueued by ``masks_ready`` once the host filled the mask.
                ev.sample.record()
                self._deferred[meta.step_id] = (meta, step, logits, ev, time.perf_counter(), plan)
                handle._waiter = None
                return handle
            if logits is not None:  # a replayed forward whose sampling runs here, eagerly
                ev.sample.record()
                out = self._torch_step.sample(meta, step, logits, time.perf_counter())
            elif plan is None:
                out = self._torch_step.compute(meta, step, self.forward_hook, ev.sample)
            else:
                with mark("graph", meta.step_id, f" bucket={plan.bucket} {plan.variant.value}"):
                    outputs = self.graphs.replay(plan.set_index, plan.bucket, plan.variant)
                out = StepOutcome(outputs["token_ids"][:plan.rows], outputs["finite"][:plan.rows], 0.0)
                ev.sample.record()  # sampling is inside the graph: its time counts as forward
            ev.end.record()
        self._copy_out(meta, handle, ev, out, step, plan)
        return handle

    def _replay_forward(self, meta: StepMeta, plan: GraphPlan) -> torch.Tensor:
        """Replay the ``HIDDEN`` graph of ``plan`` and compute the real rows' logits ``[rows, vocab]`` from its
        hidden states (the penalties need no input tokens of a decode-only step: they count what is sampled)."""
        with mark("graph", meta.step_id, f" bucket={plan.bucket} {plan.variant.value}"):
            hidden = self.graphs.replay(plan.set_index, plan.bucket, plan.variant)["hidden"][:plan.rows]
        self.forward_only_steps += 1
        return self.model.compute_logits(hidden)

    def masks_ready(self, handle: StepHandle) -> None:
        """Enqueue a grammar step's mask upload, sampling and D2H copy behind its forward."""
        meta, step, logits, ev, t_forward, plan = self._deferred.pop(handle.step_id)
        grammar = meta.extras.grammar
        pinned = self._mask_host[meta.step_id % 2][:grammar.bitmask.shape[0], :grammar.bitmask.shape[1]]
        pinned.numpy()[:] = grammar.bitmask  # the pinned buffer of step N is reused by step N+2, after wait(N)
        with torch.cuda.stream(self.compute_stream), torch.inference_mode():
            grammar.bitmask = pinned.numpy()  # what TorchStep uploads: pinned, so the copy is asynchronous
            out = self._torch_step.sample(meta, step, logits, t_forward, wait_for_mask=False)
            ev.end.record()
        self._copy_out(meta, handle, ev, out, step, plan)

    def _copy_out(self, meta: StepMeta, handle: StepHandle, ev: _StepEvents, out: StepOutcome,
                  step: DeviceStep | None, plan: GraphPlan | None) -> None:
        r = meta.num_sampled
        host_out, fin = self._out_host[meta.step_id % 2], self._finite_host[meta.step_id % 2]
        with torch.cuda.stream(self.d2h_stream), mark("d2h", meta.step_id):
            self.d2h_stream.wait_event(ev.end)
            host_out[:r].copy_(out.token_ids, non_blocking=True)
            fin[:r].copy_(out.finite, non_blocking=True)
            ev.d2h.record()
        if step is not None:  # eager tensors (an eager step's, or a replayed forward's sampler inputs)
            self._in_flight[meta.step_id] = (step, out)
        if plan is not None:
            self._set_free[plan.set_index] = ev.d2h
        handle._waiter = (ev, r)

    def is_done(self, handle: StepHandle) -> bool:
        """The step's D2H copy has completed (``Event.query``: no synchronisation); False while a grammar step's
        sampling is not enqueued yet."""
        return handle._waiter is not None and handle._waiter[0].d2h.query()

    def wait(self, handle: StepHandle) -> StepResult:
        if handle._waiter is None:
            raise RuntimeError(f"step {handle.step_id} has a grammar mask that was never marked ready "
                               "(Executor.masks_ready)")
        ev, r = handle._waiter
        ev.d2h.synchronize()
        _, outcome = self._in_flight.pop(handle.step_id, (None, None))
        out = self._out_host[handle.step_id % 2][:r].numpy().copy()
        fin = self._finite_host[handle.step_id % 2][:r].numpy().copy()
        ref, base = self._ref_event, self._ref_host
        start_ms, end_ms = ref.elapsed_time(ev.start), ref.elapsed_time(ev.end)
        if end_ms > REANCHOR_MS:  # this step's end becomes the reference: it has completed
            self._ref_event, self._ref_host = ev.end, base + end_ms / 1e3
        logprobs = prompt = None
        if outcome is not None:  # computed before ``end``, so complete now
            logprobs = None if outcome.logprobs is None else outcome.logprobs.to_host()
            prompt = None if outcome.prompt_logprobs is None else outcome.prompt_logprobs.to_host()
        return StepResult(handle.step_id, out, fin,
                          device_start=base + start_ms / 1e3, device_end=base + end_ms / 1e3,
                          h2d_ms=ev.h2d_start.elapsed_time(ev.h2d_end),
                          forward_ms=ev.start.elapsed_time(ev.sample),
                          sample_ms=ev.sample.elapsed_time(ev.end),
                          d2h_ms=ev.end.elapsed_time(ev.d2h), logprobs=logprobs, prompt_logprobs=prompt)

    def describe(self) -> dict:
        info = {**super().describe(), **self._torch_step.memory_info()}
        info["attention"] = "triton" if self._triton is not None else "torch"
        if self._triton is not None:
            info["decode_kernel"] = self._triton.decode_kernel()
        info["fused_elementwise"] = self.model.fused_elementwise is not None
        info["cuda_graphs"] = self.graphs is not None
        if self.graphs is None:
            info["cuda_graphs_off_reason"] = self.graphs_off_reason
        else:
            info["cuda_graph_batch_sizes"] = list(self.graphs.batch_sizes)
            info["cuda_graph_stats"] = self.graphs.stats.as_dict()
            info["cuda_graph_forward_only_steps"] = self.forward_only_steps
        return info

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # a device error that killed the engine may be sticky
            torch.cuda.synchronize(self.device)
        self._in_flight.clear()
        self.graphs = None
