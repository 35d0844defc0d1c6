"""compile_decode's one-row step against the eager one, with a small and an engine-sized KV cache.

    python profiles/cpu-kernel-threads-intel-xeon-2core/micro/compiled_cache_size.py 4      # 33 blocks
    python profiles/cpu-kernel-threads-intel-xeon-2core/micro/compiled_cache_size.py 256    # 2,049 blocks

SmolLM2-135M, float32, context 128; both steps run on a device thread with 2 kernel threads (as in the
engine), the builder's thread with 1. Before ``asyncbatch/model/kv_write_op.py`` the compiled step's time
grew with the cache (every step copied the caches it wrote: the graph functionalised the in-place K/V
writes); the eager one's does not. ``compiled_cache_size.txt``: the figures before and after.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
torch.set_num_threads(1)
from harness.decode_step import DecodeStepBench, decode_batch

from asyncbatch.executors.device_thread import DeviceThread
from asyncbatch.model.compiled_decode import CompiledDecode

rows = int(sys.argv[1])
bench = DecodeStepBench(None, "float32", None, max_rows=rows, context=128, threads=1)
device = DeviceThread("device", None, on_start=lambda: torch.set_num_threads(2))
compiled = CompiledDecode(bench.model, bench.kv_caches)
print("compile s", round(device.call(compiled.warm_up), 1), flush=True)
batch = decode_batch(1, 128, vocab=bench.vocab)


def timed() -> dict:
    out = {}
    with torch.inference_mode():
        for name, step in (("eager", lambda: bench.model(batch, bench.kv_caches)), ("compiled", lambda: compiled(batch))):
            step()
            step()
            t0 = time.perf_counter()
            for _ in range(5):
                step()
            out[name] = round((time.perf_counter() - t0) / 5 * 1000, 1)
    return out


print(f"KV cache for {rows} rows ({bench.kv_caches[0][0].shape[0]} blocks): ms per one-row step", device.call(timed))
device.stop()
