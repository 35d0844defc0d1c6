"""The package's import graph: no circles, and no module importing one above it in the layering.

Layers, lowest first (a module may import its own layer and those below):

    0  public data      errors, config, sampling_params, structured_outputs, outputs; cuda_graphs
    1  profiling        timeline, marks, gap report, traces, plots, host info
    2  model, sampling  the network over the paged cache; on-device sampling
    3  engine data      requests, KV blocks, scheduler, staging buffers, step metadata, messages;
                        the step contract (what the executors read of it)
    4  executors        cpu / cuda / sim devices
    5  engine core      the planner loop, the core process, the builder
    6  frontend         prompts in, text out: handles, output processing, detokenizer, stop strings
    7  public API       LLM, the package itself
    8  tools            cli, bench, serve (the asyncio API and the HTTP server), cluster (Ray Serve replicas)

An import of a higher layer is allowed only with its reason on the same line: ``# layering: <why>``.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("asyncbatch", "cuda_graphs")

LAYERS = {  # longest matching prefix wins
    "asyncbatch": 7, "asyncbatch.errors": 0, "asyncbatch.config": 0, "asyncbatch.sampling_params": 0,
    "asyncbatch.outputs": 0, "asyncbatch.structured_outputs": 0, "cuda_graphs": 0,
    "asyncbatch.profiling": 1,
    "asyncbatch.model": 2, "asyncbatch.sampling": 2, "asyncbatch.speculative": 2, "asyncbatch.speculative.config": 0,
    "asyncbatch.engine": 3, "asyncbatch.engine.step_contract": 3,
    "asyncbatch.executors": 4,
    "asyncbatch.engine.core": 5, "asyncbatch.engine.builder": 5, "asyncbatch.engine.core_process": 5,
    "asyncbatch.engine.core_preload": 5, "asyncbatch.engine.control": 5, "asyncbatch.engine.core_control": 5,
    "asyncbatch.engine.client": 5, "asyncbatch.engine.planner_loop": 5, "asyncbatch.engine.fork_server": 5,
    "asyncbatch.frontend": 6,
    "asyncbatch.llm": 7,
    "asyncbatch.cli": 8, "asyncbatch.bench": 8, "asyncbatch.serve": 8, "asyncbatch.cluster": 8, "asyncbatch.__main__": 8,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(imported module, line number, source line) for every import of the project's own modules."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import mod`` imports the submodule; ``from mod import Name`` the module.
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                       for a in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                found.append((target, node.lineno, lines[node.lineno - 1]))
    return found


def layer_of(module: str) -> int:
    best = max((prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")), key=len)
    return LAYERS[best]


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: {t for t, _, _ in imports_of(path, modules) if t != name} for name, path in modules.items()}


def strongly_connected(g: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; components of more than one module are import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(component)

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circle():
    g = graph()
    circles = [sorted(c) for c in strongly_connected(g) if len(c) > 1]
    assert not circles, f"import circles: {circles}"


def test_the_finder_sees_a_circle():
    assert [sorted(c) for c in strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
            if len(c) > 1] == [["a", "b", "c"]]


def test_no_module_imports_a_higher_layer_without_a_stated_reason():
    modules = all_modules()
    bad = set()
    for name, path in modules.items():
        for target, lineno, line in set(imports_of(path, modules)):
            if target == name or name.startswith(target + "."):
                continue  # a module importing its own package
            if layer_of(target) > layer_of(name) and "# layering:" not in line:
                bad.add(f"{path.relative_to(ROOT)}:{lineno} ({layer_of(name)}) imports {target} "
                           f"({layer_of(target)})")
    assert not bad, "imports of a higher layer without '# layering: <why>':\n" + "\n".join(sorted(bad))


def test_the_executors_import_only_the_step_contract_of_the_engine():
    """What crosses from the engine to the executors lives in ``engine.step_contract``; nothing else of the
    engine is an executor's business (the engine core imports the executors, not the other way round)."""
    modules = all_modules()
    bad = sorted(f"{path.relative_to(ROOT)}:{lineno} imports {target}"
                 for name, path in modules.items() if name.startswith("asyncbatch.executors")
                 for target, lineno, _ in imports_of(path, modules)
                 if target.startswith("asyncbatch.engine") and target != "asyncbatch.engine.step_contract")
    assert not bad, "executors importing the engine past its step contract:\n" + "\n".join(bad)


def test_every_module_is_placed_deliberately():
    """Only the package itself may fall to the catch-all ``asyncbatch`` entry: a new folder gets a layer."""
    unplaced = [m for m in all_modules() if m != "asyncbatch" and layer_of(m) == LAYERS["asyncbatch"]
                and not any(m == p or m.startswith(p + ".") for p in LAYERS if p != "asyncbatch" and LAYERS[p] == 7)]
    assert not unplaced, f"modules without a layer of their own: {unplaced}"


@pytest.mark.skipif(importlib.util.find_spec("ray") is None or importlib.util.find_spec("fastapi") is None,
                    reason="the cluster and serve extras are not installed")
def test_the_cluster_launcher_imports_no_engine():
    """``asyncbatch serve --replicas N``'s own process starts Ray and deploys the replicas; the replicas and
    the ingress import the engine (torch, transformers: ~6 s of CPU per process on a 2-core machine), the
    launching process needs neither, and every cluster start waits for its imports. So ``asyncbatch``,
    ``asyncbatch.serve``, the CLI and the cluster's Ray side import them on first use only."""
    code = ("import sys, asyncbatch, asyncbatch.serve, asyncbatch.cli.main, asyncbatch.cluster.launch, "
            "asyncbatch.cluster.lifecycle; print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"
    done = subprocess.run([sys.executable, "-c", "import asyncbatch; print(asyncbatch.LLM.__module__)"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    assert done.stdout == "asyncbatch.llm\n"  # still there, imported when asked for
