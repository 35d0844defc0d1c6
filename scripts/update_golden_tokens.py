"""Regenerate the committed greedy reference tokens of the default model (tests/golden/).

    python scripts/update_golden_tokens.py           # regenerate if the key (GGUF hash, transformers version) changed
    python scripts/update_golden_tokens.py --force   # regenerate anyway

transformers ``generate`` (float32, one prompt at a time) over the default-model
workload of ``tests/test_greedy_vs_transformers.py``. The test regenerates the
file itself whenever the key does not match; this is the same by hand.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from golden_tokens import GoldenTokens, request_key
from reference import LazyModel, reference_greedy
from test_greedy_vs_transformers import default_workload

from asyncbatch.model.loader import load_tokenizer, resolve_model_path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="regenerate even where the key matches")
    args = parser.parse_args()
    path = resolve_model_path(None)
    tokenizer = load_tokenizer(path)
    prompts, max_tokens = default_workload(tokenizer)
    eos = tokenizer.eos_token_id
    golden = GoldenTokens.load()
    keys = [request_key(p, n, eos) for p, n in zip(prompts, max_tokens)]
    if golden.covers(keys) and not args.force:
        print(f"{golden.path} is current for {golden.key}")
        return 0
    start = time.perf_counter()
    model = LazyModel(path, "float32")
    golden.save({key: reference_greedy(model, p, n, eos) for key, p, n in zip(keys, prompts, max_tokens)})
    print(f"wrote {len(keys)} requests to {golden.path} for {golden.key} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
