"""Micro-benchmarks (pytest-benchmark); not part of the default test run.

Run them with:

    pytest tests/benchmarks --benchmark-columns=min,median,mean,stddev,rounds

``addopts`` in pyproject.toml ignores this directory, so plain ``pytest`` never
runs these; naming the directory on the command line collects it anyway. Add ``--benchmark-json=out.json`` to
keep the numbers, or ``--benchmark-compare`` to compare with a saved run.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The tests directory holds tiny_models.py; pytest puts it on sys.path only for tests at its top level.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
