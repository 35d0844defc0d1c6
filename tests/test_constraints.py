"""``scripts/constraints.txt`` pins every package the set-up's extras need, so a release cannot change CI.

The set-up (``scripts/setup_env.sh``) installs the package with the dev, serve, cluster and structured extras
under ``-c scripts/constraints.txt``. A package the extras need without a pin there floats to its newest release
at the next fresh install, which is how a transformers release once broke CI between two sessions. This walks
the installed requirement closure of those extras (markers evaluated, a dependency's own extras followed) and
asks for a pin of each, except the packages the file's ``# not pinned:`` line names (torch and what torch
requires, left to the machine's torch build). Packages not installed here are not walked (a developer without
an extra); CI installs every one.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

CONSTRAINTS = Path(__file__).resolve().parents[1] / "scripts" / "constraints.txt"
EXTRAS = ("dev", "serve", "cluster", "structured")  # scripts/test.sh's, which CI runs


def pins_and_exemptions() -> tuple[dict[str, str], set[str]]:
    pins, exempt = {}, set()
    for line in CONSTRAINTS.read_text().splitlines():
        if line.startswith("# not pinned:"):
            exempt = {canonicalize_name(n) for n in line.split(":", 1)[1].split()}
        elif line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins, exempt


def installed_closure(root: str, extras: tuple[str, ...]) -> set[str]:
    """Canonical names of the installed distributions ``root[extras]`` needs, ``root`` excluded."""
    names: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()

    def walk(name: str, wanted: frozenset[str]) -> None:
        key = (canonicalize_name(name), wanted)
        if key in seen:
            return
        seen.add(key)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            return
        names.add(key[0])
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (*wanted, "")):
                walk(req.name, frozenset(req.extras))

    walk(root, frozenset(extras))
    return names - {canonicalize_name(root)}


def test_every_package_the_extras_need_is_pinned() -> None:
    pins, exempt = pins_and_exemptions()
    assert "torch" in exempt and "transformers" in pins  # the file's two kinds of line are read
    needed = installed_closure("asyncbatch", EXTRAS)
    assert {"numpy", "transformers", "pytest"} <= needed  # the walk reached the base and the dev extra
    unpinned = sorted(needed - exempt - set(pins))
    assert not unpinned, f"add these to scripts/constraints.txt (or its '# not pinned:' line): {unpinned}"
    assert not exempt & set(pins), "a package is both pinned and named as not pinned"
