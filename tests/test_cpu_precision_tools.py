"""The tools around the CPU precisions: the quality metric, the llama.cpp baseline, and the scripts.

llama.cpp needs the optional ``llamacpp`` extra (llama-cpp-python, compiled from
source); without it its run test skips with the reason, and the benchmark
scripts skip the system with a message instead of failing.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from harness import system_llamacpp
from harness.quality import QUALITY_TEXT, agreement, teacher_forced
from harness.runner import build_systems
from harness.system_base import BenchSettings
from harness.systems import LLAMACPP, parse_systems
from in_process import Completed, run_program
from tiny_models import save_tiny_model

from asyncbatch.bench.workloads import WorkItem
from asyncbatch.model import lean_kernels, lean_step
from asyncbatch.model.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("prec") / "tiny", "LlamaForCausalLM")


def test_the_quality_text_ships_with_the_package():
    text = QUALITY_TEXT.read_text()
    assert len(text.split()) > 1500


def test_teacher_forced_agrees_with_itself_and_does_not_depend_on_the_chunk(tiny_dir):
    model = load_model(tiny_dir, torch.float32, "cpu", 128)
    ids = [3 + (i * 37) % 250 for i in range(90)]
    a, b = teacher_forced(model, ids, chunk=8), teacher_forced(model, ids, chunk=32)
    assert a.argmax.shape == (89,) and agreement(a, a) == 1.0
    assert agreement(a, b, min_margin=1e-3) == 1.0
    assert 1.0 < a.perplexity and abs(a.perplexity - b.perplexity) < 1e-3 * a.perplexity


def test_llamacpp_is_an_optional_system(monkeypatch, tiny_dir):
    assert parse_systems("overlap,llamacpp") == ["asyncbatch-overlap", LLAMACPP]
    assert LLAMACPP not in parse_systems("all")
    with pytest.raises(system_llamacpp.LlamaCppUnavailable, match="gguf"):
        system_llamacpp.gguf_path(str(tiny_dir))
    monkeypatch.setattr(system_llamacpp, "import_llama_cpp", _missing)
    messages: list[str] = []
    assert build_systems("llamacpp", BenchSettings(), [], log=messages.append) == []
    assert any("skipping llama.cpp" in m and "pip install" in m for m in messages)


def _missing():
    raise system_llamacpp.LlamaCppUnavailable(f"llama-cpp-python is not installed; {system_llamacpp.INSTALL_HINT}")


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (optional extra 'llamacpp', "
                                              "compiled from source; CI does not build it)")
def test_llamacpp_runs_the_requests_greedily():
    system = system_llamacpp.LlamaCppSystem(BenchSettings(max_num_seqs=3, max_num_batched_tokens=64))
    try:
        items = [WorkItem([1, 504, 3060 + i, 314, 253], 5 + i) for i in range(5)]  # more requests than slots
        run = system.run_offline(items)
        assert [r.output_len for r in run.requests] == [5 + i for i in range(5)]
        again = system.run_offline(items[:1])  # a reused context starts empty
        assert again.requests[0].token_ids == run.requests[0].token_ids
    finally:
        system.close()


def _run(script: str, *args: str) -> Completed:
    proc = run_program([sys.executable, str(ROOT / "scripts" / script), *args])  # tests/in_process.py: why
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_profile_script_attributes_the_step(tiny_dir, tmp_path):
    more = lean_step.LEAN_MAX_ROWS + 1  # a step the lean CPU step leaves to the torch ops
    _run("profile_cpu_step.py", "--model", str(tiny_dir), "--rows", f"1,{more}", "--steps", "2", "--context", "16",
         "--quantization", "int8", "--out", str(tmp_path))
    doc = json.loads((tmp_path / "report.json").read_text())
    parts = doc["results"][1]["parts"]
    for name in ("linear q/k/v", "linear gate/up", "lm head", "sampling"):
        assert parts[name]["op_ms"] > 0, name
    # The torch ops' step attends with the lean kernel where it builds (model/lean_attention.py): no page gather.
    attention = parts["attention: SDPA + mask"]
    assert attention["op_ms"] + attention["python_ms"] > 0
    assert ("attention: gather blocks" in parts) == (lean_kernels.library() is None)
    assert f"## {more} rows" in (tmp_path / "report.md").read_text()
    # One row: the lean CPU step where it builds (no layer module runs), its products and kernels still labelled.
    one = doc["results"][0]["parts"]
    for name in ("linear q/k/v", "linear o", "linear down", "lm head"):
        assert one[name]["op_ms"] > 0, name
    assert one["attention: SDPA + mask"]["op_ms"] + one["attention: SDPA + mask"]["python_ms"] > 0


def test_precision_and_quality_scripts_on_a_tiny_model(tiny_dir, tmp_path):
    _run("bench_cpu_precision.py", "--model", str(tiny_dir), "--rows", "1,2", "--context", "16",
         "--step-repeats", "1", "--precisions", "float32,int8,w8a8", "--no-throughput", "--out", str(tmp_path))
    doc = json.loads((tmp_path / "precision.json").read_text())
    assert {s["precision"] for s in doc["steps"]} == {"float32", "int8", "w8a8"}
    assert all(s["floor_ms"] > 0 and s["step_ms_median"] > 0 for s in doc["steps"])
    assert (tmp_path / "precision.png").read_bytes()[:4] == b"\x89PNG"
    proc = _run("eval_quality.py", "--model", str(tiny_dir), "--precisions", "int8", "--max-tokens", "60",
                "--out", str(tmp_path))
    rows = json.loads((tmp_path / "quality.json").read_text())["results"]
    assert [r["precision"] for r in rows] == ["float32", "int8"] and rows[0]["top1_agreement"] == 1.0
    assert "| int8 |" in proc.stdout
