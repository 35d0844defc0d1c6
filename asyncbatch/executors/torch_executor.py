"""Real execution of a step with torch: ``cpu`` (in a device thread) and ``cuda`` (streams).

On ``cuda`` the planner thread launches the step itself: copies go on the H2D
stream, the compute stream waits on them, sampled ids come back on the D2H
stream into pinned memory, and an event marks completion. Nothing on this
path waits for the device except the caller's later ``wait``:

    planner   [launch N: H2D, forward, sample, D2H]     [launch N+1 ...]   [wait N]
    H2D stream   [copy N]                                  [copy N+1]
    compute          [ forward N | sample N ]                 [ forward N+1 ...
    D2H stream                              [ids N]

On ``cpu`` the same ``_run`` executes inside a ``DeviceThread``; torch
releases the GIL inside its kernels, so the planner runs meanwhile.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from asyncbatch.executors.base import Executor, StepHandle, StepResult
from asyncbatch.executors.device_thread import DeviceThread
from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.llama import CausalLM
from asyncbatch.penalties import PenaltyState
from asyncbatch.sampler import SamplingTensors, sample
from asyncbatch.step_metadata import StepMeta
from asyncbatch.timeline_marks import mark


class TorchExecutor(Executor):
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_num_seqs: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.name = device.type
        vocab = model.config.vocab_size
        self.token_buffer = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)  # [max_num_seqs]
        self.penalties = PenaltyState(max_num_seqs, vocab, device)
        self.forward_hook = None  # tests inject faults here
        if self.is_cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            self.compute_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
            self._out_host = [torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._finite_host = [torch.zeros(max_num_seqs, dtype=torch.bool, pin_memory=True) for _ in range(2)]
            self._in_flight: dict[int, tuple] = {}  # keeps a step's tensors alive until its event fires
            # Host clock of a reference event, so CUDA event times map onto the timeline's clock.
            self._ref_event = torch.cuda.Event(enable_timing=True)
            self._ref_event.record()
            self._ref_event.synchronize()
            self._ref_host = time.perf_counter()
            self._thread = None
        else:
            self._thread = DeviceThread("asyncbatch-device", self._run_threaded)

    # -- host → device -------------------------------------------------------
    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.is_cuda:
            return tensor.to(self.device, non_blocking=True)
        return tensor.clone()

    def _copy_in(self, meta: StepMeta) -> tuple[ForwardBatch, SamplingTensors, torch.Tensor, torch.Tensor]:
        s, t, nd, r = meta.slot, meta.num_tokens, meta.num_decode, meta.num_sampled
        up = self._to_device
        input_ids = up(s.input_ids[:t])
        positions = up(s.positions[:t])
        slot_mapping = up(s.slot_mapping[:t])
        decode_slots = up(s.decode_token_slots[:nd])
        decode_tables = up(s.decode_block_tables[:nd, :max(meta.decode_max_blocks, 1)])
        decode_lens = up(s.decode_context_lens[:nd])
        npre = len(meta.prefill_rows)
        prefill_tables = up(s.prefill_block_tables[:npre, :max((p.block_count for p in meta.prefill_rows), default=1)])
        sampling = SamplingTensors(
            temperature=up(s.sample_temperature[:r]), top_k=up(s.sample_top_k[:r]), top_p=up(s.sample_top_p[:r]),
            min_p=up(s.sample_min_p[:r]), seed=up(s.sample_seed[:r]), step=up(s.sample_step[:r]))
        extras = {
            "logits_indices": up(s.logits_indices[:r]),
            "sample_slots": up(s.sample_token_slots[:r]),
        }
        if meta.any_penalty:
            extras.update(presence=up(s.sample_presence[:r]), frequency=up(s.sample_frequency[:r]),
                          repetition=up(s.sample_repetition[:r]), token_is_output=up(s.token_is_output[:t]),
                          token_row_slot=up(s.token_row_slot[:t]))
        rows = [PrefillRow(p.token_start, p.q_len, p.ctx_len, prefill_tables[i, :p.block_count])
                for i, p in enumerate(meta.prefill_rows)]
        batch = ForwardBatch(input_ids, positions, slot_mapping, nd, decode_tables, decode_lens, rows,
                             extras["logits_indices"])
        return batch, sampling, decode_slots, extras

    # -- the step ------------------------------------------------------------
    def _compute(self, meta: StepMeta, batch: ForwardBatch, sampling: SamplingTensors, decode_slots: torch.Tensor,
                 extras: dict, sample_event: torch.cuda.Event | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, float]:
        nd = meta.num_decode
        if nd:
            # The token sampled last step feeds this one without visiting the host.
            batch.input_ids[:nd] = self.token_buffer[decode_slots]
        with mark("forward", meta.step_id):
            if self.forward_hook is not None:
                self.forward_hook(meta)
            logits = self.model(batch, self.kv_caches)  # [R, vocab]
        t_sample = time.perf_counter()
        if sample_event is not None:
            sample_event.record()
        with mark("sample", meta.step_id):
            if meta.any_penalty:
                self._update_penalty_context(meta, batch, extras)
                logits = self.penalties.apply(logits, extras["sample_slots"], extras["presence"],
                                              extras["frequency"], extras["repetition"])
            result = sample(logits, sampling, all_greedy=meta.all_greedy, any_top_k_top_p_min_p=meta.any_filter)
            if meta.any_penalty:
                self.penalties.record(extras["sample_slots"], result.token_ids)
            self.token_buffer[extras["sample_slots"]] = result.token_ids
        return result.token_ids, result.finite, t_sample

    def _update_penalty_context(self, meta: StepMeta, batch: ForwardBatch, extras: dict) -> None:
        if meta.first_chunk_slots:
            self.penalties.reset_rows(torch.tensor(meta.first_chunk_slots, dtype=torch.int64, device=self.device))
        nd = meta.num_decode
        if meta.num_tokens > nd:
            self.penalties.add_context(extras["token_row_slot"][nd:], batch.input_ids[nd:],
                                       extras["token_is_output"][nd:])

    def _run_threaded(self, meta: StepMeta, handle: StepHandle) -> StepResult:
        torch.set_grad_enabled(False)
        t0 = time.perf_counter()
        with mark("h2d", meta.step_id):
            batch, sampling, decode_slots, extras = self._copy_in(meta)
        meta.slot.fence.signal()
        t1 = time.perf_counter()
        with torch.inference_mode():
            tokens, finite, t_sample = self._compute(meta, batch, sampling, decode_slots, extras)
        t2 = time.perf_counter()
        out_tokens, out_finite = tokens.numpy().copy(), finite.numpy().copy()
        t3 = time.perf_counter()
        return StepResult(meta.step_id, out_tokens, out_finite, device_start=t0, device_end=t2,
                          h2d_ms=(t1 - t0) * 1e3, forward_ms=(t_sample - t1) * 1e3,
                          sample_ms=(t2 - t_sample) * 1e3, d2h_ms=(t3 - t2) * 1e3)

    def launch(self, meta: StepMeta) -> StepHandle:
        handle = StepHandle(meta.step_id, time.perf_counter())
        if self._thread is not None:
            self._thread.submit(meta, handle)
        else:
            self._launch_cuda(meta, handle)
        return handle

    def wait(self, handle: StepHandle) -> StepResult:
        if self._thread is not None:
            return handle.result()
        return self._finish_cuda(handle)

    # -- cuda ----------------------------------------------------------------
    def _launch_cuda(self, meta: StepMeta, handle: StepHandle) -> None:
        events = {k: torch.cuda.Event(enable_timing=True) for k in ("h2d0", "h2d1", "start", "sample", "end", "d2h")}
        with torch.cuda.stream(self.h2d_stream), mark("h2d", meta.step_id):
            events["h2d0"].record()
            batch, sampling, decode_slots, extras = self._copy_in(meta)
            events["h2d1"].record()
        meta.slot.fence.signal_with_cuda_event(events["h2d1"])
        with torch.cuda.stream(self.compute_stream), torch.inference_mode():
            self.compute_stream.wait_event(events["h2d1"])
            events["start"].record()
            tokens, finite, _ = self._compute(meta, batch, sampling, decode_slots, extras, events["sample"])
            events["end"].record()
        out = self._out_host[meta.step_id % 2]
        fin = self._finite_host[meta.step_id % 2]
        r = meta.num_sampled
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(events["end"])
            out[:r].copy_(tokens, non_blocking=True)
            fin[:r].copy_(finite, non_blocking=True)
            events["d2h"].record()
        # Tensors of this step must outlive their use on the streams.
        self._in_flight[meta.step_id] = (batch, sampling, decode_slots, extras, tokens, finite)
        handle._waiter = (events, r)

    def _finish_cuda(self, handle: StepHandle) -> StepResult:
        events, r = handle._waiter
        events["d2h"].synchronize()
        self._in_flight.pop(handle.step_id, None)
        out = self._out_host[handle.step_id % 2][:r].numpy().copy()
        fin = self._finite_host[handle.step_id % 2][:r].numpy().copy()
        ref, base = self._ref_event, self._ref_host
        return StepResult(handle.step_id, out, fin,
                          device_start=base + ref.elapsed_time(events["start"]) / 1e3,
                          device_end=base + ref.elapsed_time(events["end"]) / 1e3,
                          h2d_ms=events["h2d0"].elapsed_time(events["h2d1"]),
                          forward_ms=events["start"].elapsed_time(events["sample"]),
                          sample_ms=events["sample"].elapsed_time(events["end"]),
                          d2h_ms=events["end"].elapsed_time(events["d2h"]))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.stop()
