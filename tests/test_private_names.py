"""No module uses another package's private (underscored) names.

A package here is a folder of ``asyncbatch`` (``engine``, ``serve``, ``cluster``, ...), the package's own
top-level modules (``llm``, ``config``, ...) as one more, and ``cuda_graphs``. Inside a package, modules share
their underscored names freely; across packages only public names are used, so a package can change its
insides without breaking another (``serve`` talks to ``LLM`` through ``EngineClient``, not ``LLM._client``).

What counts as a use, statically:

* ``from a.b import _name`` of another package's module;
* ``Name._name`` where ``Name`` was imported from another package (``LLM._prepare_ids``);
* ``obj._name`` (and ``getattr(obj, "_name")``) where ``obj`` is not ``self``/``cls`` and ``_name`` is
  defined (a function, class, method, module or class attribute, or an ``self._name = ...`` attribute) in
  some other package and nowhere in the module's own package.

A name defined in both packages cannot be told apart without types; such uses pass (a false negative,
never a false alarm). Dunder names are public by convention and ignored. As with ``# layering:``, a use
that cannot be avoided yet carries its reason on its line: ``# private-name: <why>``.
"""

from __future__ import annotations

import ast

from test_layering import ROOT, all_modules

_ATTR_CALLS = ("getattr", "setattr", "hasattr", "delattr")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_of(module: str) -> str:
    """``asyncbatch.serve.app`` -> ``asyncbatch.serve``; ``asyncbatch.llm`` -> ``asyncbatch``."""
    parts = module.split(".")
    if parts[0] != "asyncbatch":
        return parts[0]
    return "asyncbatch" if len(parts) <= 2 and not _is_folder(module) else ".".join(parts[:2])


def _is_folder(module: str) -> bool:
    return (ROOT / module.replace(".", "/")).is_dir()


def defined_private_names(tree: ast.AST) -> set[str]:
    """Underscored names a module defines: functions, classes, methods, assigned names and attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
                    elif isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
    return {n for n in names if is_private(n)}


def imported_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the module it came from, for ``from m import Name`` and ``import m as name``."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update((a.asname or a.name, node.module) for a in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname, a.name) for a in node.names if a.asname)
    return names


def private_uses(tree: ast.AST) -> list[tuple[int, str, str | None]]:
    """(line, private name, the module its owner was imported from, if known) of every use of an
    underscored name on something other than ``self``/``cls``."""
    imported = imported_names(tree)
    uses: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            uses.extend((node.lineno, a.name, node.module) for a in node.names if is_private(a.name))
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and not _is_self(node.value):
            owner = imported.get(node.value.id) if isinstance(node.value, ast.Name) else None
            uses.append((node.lineno, node.attr, owner))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_CALLS
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and is_private(node.args[1].value)
              and not _is_self(node.args[0])):
            uses.append((node.lineno, node.args[1].value, None))
    return uses


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def violations(sources: dict[str, str]) -> list[str]:
    """``module:line uses package.name`` for each use of another package's private name in ``sources``
    (module name -> source text)."""
    trees = {name: ast.parse(src) for name, src in sources.items()}
    defined: dict[str, set[str]] = {}
    for name, tree in trees.items():
        defined.setdefault(package_of(name), set()).update(defined_private_names(tree))
    bad = []
    for name, tree in trees.items():
        own = package_of(name)
        lines = sources[name].splitlines()
        for lineno, attr, source in private_uses(tree):
            if "# private-name:" in lines[lineno - 1]:
                continue
            if source is not None and _project_module(source, sources):
                if package_of(source) != own:
                    bad.append(f"{name}:{lineno} uses {source}.{attr}")
                continue
            if attr in defined[own]:
                continue
            owners = sorted(p for p, names in defined.items() if p != own and attr in names)
            if owners:
                bad.append(f"{name}:{lineno} uses {attr} of {', '.join(owners)}")
    return sorted(bad)


def _project_module(module: str, sources: dict[str, str]) -> bool:
    return module in sources or any(m.startswith(module + ".") for m in sources)


def test_no_module_uses_another_packages_private_names():
    sources = {name: path.read_text() for name, path in all_modules().items()}
    bad = violations(sources)
    assert not bad, "private names used across packages:\n" + "\n".join(bad)


def test_the_checker_sees_a_private_use():
    sources = {
        "asyncbatch.llm": "class LLM:\n    def __init__(self):\n        self._client = 1\n"
                          "    def _check(self): ...\n_helper = 2\n",
        "asyncbatch.serve.app": "from asyncbatch.llm import _helper\n"
                                "def f(llm):\n    llm._check()\n    return getattr(llm, '_client')\n",
        "asyncbatch.serve.ok": "class A:\n    def __init__(self):\n        self._mine = 0\n"
                               "def g(a, llm):\n    return a._mine, llm.__class__, llm.client\n"
                               "def h(llm):\n    return llm._client  # private-name: the reason\n",
        "asyncbatch.cluster.borrow": "from asyncbatch.llm import LLM\n"
                                     "class F:\n    _check = LLM._check\n",
    }
    assert violations(sources) == ["asyncbatch.cluster.borrow:3 uses asyncbatch.llm._check",
                                   "asyncbatch.serve.app:1 uses asyncbatch.llm._helper",
                                   "asyncbatch.serve.app:3 uses _check of asyncbatch, asyncbatch.cluster",
                                   "asyncbatch.serve.app:4 uses _client of asyncbatch"]


def test_packages_are_folders_and_the_top_level():
    assert package_of("asyncbatch.serve.app") == "asyncbatch.serve"
    assert package_of("asyncbatch.llm") == "asyncbatch"
    assert package_of("asyncbatch") == "asyncbatch"
    assert package_of("asyncbatch.engine") == "asyncbatch.engine"
    assert package_of("cuda_graphs.capture") == "cuda_graphs"

