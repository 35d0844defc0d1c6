"""SpeculativeState.propose at 1 / 8 / 64 rows of ~600 known tokens in a max_model_len 8192 history, us a call."""
import time, torch
from asyncbatch.speculative.config import SpeculativeConfig
from asyncbatch.speculative.device_state import SpeculativeState
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
for rows in (1, 8, 64):
    st = SpeculativeState(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=None), 256, 8192, torch.device("cpu"))
    st.history[:, :600] = torch.randint(0, 50, (257, 600), generator=g)
    st.length[:] = 599
    r = torch.arange(rows)
    for _ in range(20): st.propose(r)
    n = 200 if rows < 64 else 50
    t = time.perf_counter()
    for _ in range(n): st.propose(r)
    print(f"{rows} rows: {(time.perf_counter() - t) / n * 1e6:.0f} us")
