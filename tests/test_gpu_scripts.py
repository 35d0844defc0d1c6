"""What can be checked of the GPU path without a GPU, so a lent GPU's minutes go to measuring.

* The Triton kernels compile to sm_90 (H100/H200) cubins, with exactly the
  launches the engine picks, through Triton's own PTX/ptxas pipeline; the CPU
  interpreter that runs them elsewhere in the suite cannot catch a kernel that
  fails to lower for a real GPU.
* ``scripts/gpu_check.sh`` runs end to end on the CPU at toy sizes
  (``GPU_CHECK_SMOKE``): every stage, its logs, the benchmark report, the
  attention table (where every tile variant must agree with the engine's).
* The KV-sizing profile step (``executors.cuda_memory``) builds and runs its
  worst-case batch on a CPU model, with the CUDA memory counters stubbed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_model

from asyncbatch.executors import cuda_memory
from asyncbatch.model.loader import load_model

ROOT = Path(__file__).resolve().parents[1]


def _has_nvidia_backend() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin").is_dir()


@pytest.mark.slow
@pytest.mark.skipif(not _has_nvidia_backend(), reason="Triton with its NVIDIA backend (ptxas) is not installed")
@pytest.mark.parametrize("shape", ["SmolLM2-135M", "tests' tiny models"])
def test_kernels_compile_for_hopper(shape, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_resources.py"), "--arch", "90",
                           "--only", shape, "--out", str(tmp_path)], check=False, capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    launches = json.loads((tmp_path / "kernel_resources.json").read_text())["launches"]
    # grouped decode, split decode (one split, eight) and its merge, short and long prefill; bf16, fp16, fp32
    assert len(launches) == 18 and all(x["ok"] and x["model"] == shape for x in launches)
    assert {x["kernel"] for x in launches} == {"decode", "split", "merge", "prefill"}
    if launches[0]["registers"] is not None:  # cuobjdump found: the cubins are real
        assert all(0 < x["registers"] <= 255 for x in launches)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("gpu-scripts") / "llama", "LlamaForCausalLM")


@pytest.mark.slow
def test_gpu_check_script_runs_every_stage(tiny_path, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_SMOKE": str(tiny_path), "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], check=False, capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    assert "tests rc=0, attention rc=0, step profile rc=0, benchmark rc=0, structured rc=0" in summary
    assert done.stdout.rstrip().endswith(summary.rstrip().splitlines()[-1])  # the table is printed last
    files = sorted(f.name for f in out.rglob("*") if f.is_file())
    assert files == sorted(["env.txt", "tests.log", "attention.log", "bench.log", "report.json",
                            "attention_bench.json", "step_profile.md", "summary.txt"])  # the device tool returns 8
    assert "TRITON_INTERPRET=0" in (ROOT / "scripts" / "gpu_check.sh").read_text()

    # The structured-outputs stage (xgrammar from the structured extra here; carried wheels on the GPU machine) ran
    # the sim benchmark on the tiny model's tokenizer: its runs in bench.log, its table in the summary.
    structured = (out / "bench.log").read_text().split("== structured outputs benchmark", 1)[1]
    runs = [json.loads(line) for line in structured.splitlines() if line.startswith("{")]
    assert sorted(r["config"] for r in runs) == ["naive", "none", "overlap"]
    assert all(r["device_busy_fraction"] > 0 for r in runs) and any(r["grammar_rows"] for r in runs)
    assert "Goal at 1 ms (overlap busy >= 97% of none)" in summary

    report = json.loads((out / "report.json").read_text())
    assert set(report["results"]) == {"overlap+graphs", "sync+graphs", "overlap+eager", "sync+eager",
                                      "overlap+graphs+grouped", "overlap+graphs+extras", "overlap+graphs+fused"}
    assert all("error" not in r for r in report["results"].values())
    assert all(ratio["identical_requests"] == 1.0 for ratio in report["ratios"].values())

    step_profile = (out / "step_profile.md").read_text()
    assert "grouped decode kernel, 4 rows x 8 cached" in step_profile and "matrix products" in step_profile
    # The fused variant ran its kernels (the interpreter's, on the CPU) through the same model.
    assert "grouped decode kernel + fused elementwise, 4 rows x 8 cached" in step_profile

    attention = json.loads((out / "attention_bench.json").read_text())
    kernels = [t["kernel"] for t in attention["timings"]]
    # The grouped kernel's 6 tiles x warps; the split kernel's choice (one split in the interpreter) and its 4
    # distinct neighbours (half of one split is one split: S2, N16, N64, 8 warps); the torch reference. The
    # engine's prefill launch and its warps flipped.
    assert kernels.count("decode") == 12 and kernels.count("prefill") == 2
    assert all(t["ms"] > 0 and t["max_abs_diff"] < 1e-5 for t in attention["timings"])


def test_profile_step_memory_runs_its_worst_case_step(tiny_path, monkeypatch):
    """The profile step on CPU: its batch (every token one prefill row, every sampled row filtered) must be
    one the model and sampler accept; the memory arithmetic uses stubbed counters."""
    model = load_model(tiny_path, torch.float32, torch.device("cpu"), max_positions=256)
    allocated = iter([1000, 1000 + 7_000_000])  # before the step; peak during it
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(allocated))
    calls = []
    real_sample = cuda_memory.sample

    def spy(logits, sampling, **kwargs):
        calls.append((tuple(logits.shape), kwargs))
        return real_sample(logits, sampling, **kwargs)

    monkeypatch.setattr(cuda_memory, "sample", spy)
    memory = cuda_memory.profile_step_memory(model, max_num_seqs=8, max_num_batched_tokens=100, block_size=4,
                                             graphs=True)
    assert calls == [((8, model.output_weight.shape[0]), {"all_greedy": False, "any_top_k_top_p_min_p": True})]
    assert memory.step_peak_bytes == 7_000_000
    assert memory.reserve_bytes == 2 * 7_000_000 + cuda_memory.MARGIN_BYTES
    no_graphs = cuda_memory.StepMemory(7_000_000, graphs=False)
    assert no_graphs.reserve_bytes == 7_000_000 + cuda_memory.MARGIN_BYTES
