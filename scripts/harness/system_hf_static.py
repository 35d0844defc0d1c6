"""Padded static batching with transformers ``generate``: the pre-continuous-batching baseline.

Requests are served in arrival order in fixed batches of ``static_batch_size``:
prompts left-padded to the batch's longest, and the batch decodes for the
largest ``max_tokens`` in it. A request's own first ``max_tokens`` tokens are its
output; the rest, and the padding, are computed and wasted (they count in
``computed_tokens``, not in output throughput). Online, the server takes up to
a batch of the requests that have arrived whenever it is free.

A streamer timestamps every decoding step, so a request's token ``k`` is
available at step ``k`` as a streaming caller would see it, and its finish time
is its own last token, not the batch's.
"""

from __future__ import annotations

import queue
import threading
import time

import torch
from transformers.generation.streamers import BaseStreamer

from asyncbatch.bench.workloads import WorkItem
from harness.hf_common import cut_at_eos, generation_config, load_hf_model
from harness.memory import MemorySampler
from harness.records import RequestRecord, RunResult
from harness.system_base import BenchSettings, BenchSystem, ThreadErrors, timed_replay


class _StepClock(BaseStreamer):
    """Records when each decoding step's tokens reach the host (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFStaticSystem(BenchSystem):
    name = "transformers-static"

    def __init__(self, settings: BenchSettings) -> None:
        self.settings = settings
        self.batch_size = settings.static_batch_size
        self.description = f"transformers generate, padded static batches of {self.batch_size}"
        self.hf = load_hf_model(settings)
        self.load_mib = self.hf.load_mib

    def config(self) -> dict:
        return {"batch_size": self.batch_size, "padding": "left",
                "attn_implementation": self.hf.model.config._attn_implementation,
                "dtype": str(self.hf.dtype), "device": str(self.hf.device)}

    def _generate(self, batch: list[WorkItem], records: list[RequestRecord]) -> int:
        """Run one padded batch, fill ``records`` (same order); returns the token positions computed."""
        width = max(len(it.prompt_token_ids) for it in batch)
        pad = self.hf.pad_token_id
        ids = torch.full((len(batch), width), pad, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for row, it in enumerate(batch):
            n = len(it.prompt_token_ids)
            ids[row, width - n:] = torch.tensor(it.prompt_token_ids)
            mask[row, width - n:] = 1
        max_new = max(it.max_tokens for it in batch)
        clock = _StepClock()
        gc = generation_config(self.settings, self.hf, max_new)
        out = self.hf.model.generate(input_ids=ids.to(self.hf.device), attention_mask=mask.to(self.hf.device),
                                     generation_config=gc, streamer=clock)
        new = out[:, width:].tolist()
        eos = None if self.settings.ignore_eos else self.hf.eos_token_id
        for row, (it, rec) in enumerate(zip(batch, records)):
            tokens = cut_at_eos(new[row][:it.max_tokens], eos)
            times = clock.times[:len(tokens)]
            rec.token_ids, rec.output_len, rec.chunk_times = tokens, len(tokens), times
            rec.first_token = times[0] if times else None
            rec.finish = times[-1] if times else None
        return len(batch) * (width + len(clock.times))

    def run_offline(self, items: list[WorkItem]) -> RunResult:
        computed = 0
        with MemorySampler() as mem, torch.inference_mode():
            start, cpu0 = time.perf_counter(), time.process_time()
            records = [RequestRecord(len(it.prompt_token_ids), 0, start, None, None) for it in items]
            for b in range(0, len(items), self.batch_size):
                computed += self._generate(items[b:b + self.batch_size], records[b:b + self.batch_size])
            end, cpu_s = time.perf_counter(), time.process_time() - cpu0
        for rec in records:
            rec.chunk_times = None  # offline runs report TTFT/TPOT only, like the other systems
        return RunResult(self.name, records, start, end, computed, None, mem.result(self.load_mib), cpu_s=cpu_s)

    def run_online(self, items: list[WorkItem], offsets: list[float]) -> RunResult:
        records = [RequestRecord(len(it.prompt_token_ids), 0, 0.0, None, None, []) for it in items]
        arrived: queue.SimpleQueue[int] = queue.SimpleQueue()
        computed = [0]
        errors = ThreadErrors()

        def serve() -> None:
            try:
                with torch.inference_mode():
                    done = 0
                    while done < len(items):
                        batch = [arrived.get()]  # block until something has arrived
                        while len(batch) < self.batch_size:
                            try:
                                batch.append(arrived.get_nowait())
                            except queue.Empty:
                                break
                        computed[0] += self._generate([items[i] for i in batch], [records[i] for i in batch])
                        done += len(batch)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.add(exc)

        def submit(i: int) -> None:
            records[i].arrival = time.perf_counter()
            arrived.put(i)

        with MemorySampler() as mem:
            server = threading.Thread(target=serve, name="bench-static-server", daemon=True)
            server.start()
            start, end, cpu_s = timed_replay(offsets, submit, server.join)
        errors.raise_first()
        return RunResult(self.name, records, start, end, computed[0], None, mem.result(self.load_mib), cpu_s=cpu_s)
