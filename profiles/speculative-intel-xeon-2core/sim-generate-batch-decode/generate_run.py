import sys, numpy as np
from asyncbatch.config import SimConfig
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.profiling.gap_report import gap_report
spec, ids = sys.argv[1] == "spec", sys.argv[2] == "ids"
sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
kw = {"speculative_config": {"method": "ngram", "disable_by_batch_size": None}} if spec else {}
with LLM("smollm2-135m", device="sim", sim=sim, max_num_seqs=256, seed=0, skip_tokenizer_init=ids, **kw) as llm:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.wait_settled(5.0); llm.reset_stats()
    llm.generate(prompts, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.wait_settled(5.0)
    rep = gap_report(llm)
    st = llm.stats(); print(f"{sys.argv[1]} {sys.argv[2]} gen_detok {st.get('generate_detok_texts')} {st.get('generate_detok_ms', 0):.1f}ms busy {rep.busy_fraction*100:.1f} idle_ms {rep.idle_ms:.1f}")
