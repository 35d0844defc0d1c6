"""Committed greedy tokens of transformers ``generate`` on the default model, so CI need not regenerate them.

The reference generation (float32, one prompt at a time) is most of the default
model's greedy test on a 2-core CPU. Its tokens are a function of the model file
and of transformers' implementation, so the committed file carries that key:

    {"key": {"model_sha256": ..., "transformers": "5.25.0"},
     "requests": [{"prompt_ids": [...], "max_tokens": n, "eos_token_id": e, "tokens": [...]}, ...]}

Where the key does not match (another transformers, another GGUF), or a request
is missing, the caller generates the reference live and ``save`` rewrites the
file; ``scripts/update_golden_tokens.py`` does the same by hand. The set-up
installs the transformers of ``scripts/constraints.txt``, so that a release
made after the file cannot fail CI (``test_golden_tokens.py`` checks the
committed key against the installed version): move the pin and the file together. A divergence from a
golden token is still judged by the near-tie rule, whose top-2 gap comes from a
live float32 forward (``reference.compare_greedy``), so the golden file only
saves the generation, never the judgement.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import transformers

from asyncbatch.model.default_model import default_gguf_path

GOLDEN_DIR = Path(__file__).parent / "golden"
DEFAULT_MODEL_GREEDY = GOLDEN_DIR / "default_model_greedy.json"

_HASH_CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@functools.cache
def _key() -> tuple[tuple[str, str], ...]:
    return (("model_sha256", file_sha256(default_gguf_path())), ("transformers", transformers.__version__))


def current_key() -> dict[str, str]:
    """What the default model's reference tokens depend on: the GGUF's bytes and the transformers version
    (hashed once per process: ~100 MB)."""
    return dict(_key())


def request_key(prompt_ids: list[int], max_tokens: int, eos_token_id: int | None) -> tuple:
    return tuple(prompt_ids), max_tokens, eos_token_id


@dataclass
class GoldenTokens:
    """Reference tokens by ``request_key``; ``matches`` says whether they were made under ``current_key()``."""

    path: Path
    key: dict[str, str]
    tokens: dict[tuple, list[int]]
    matches: bool

    @classmethod
    def load(cls, path: Path = DEFAULT_MODEL_GREEDY) -> GoldenTokens:
        key = current_key()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls(path, key, {}, False)
        if data.get("key") != key:
            return cls(path, key, {}, False)
        tokens = {request_key(r["prompt_ids"], r["max_tokens"], r["eos_token_id"]): r["tokens"]
                  for r in data["requests"]}
        return cls(path, key, tokens, True)

    def covers(self, keys: list[tuple]) -> bool:
        return self.matches and all(k in self.tokens for k in keys)

    def save(self, tokens: dict[tuple, list[int]]) -> None:
        """Rewrite the file with ``tokens`` under the current key."""
        requests = [json.dumps({"prompt_ids": list(prompt), "max_tokens": n, "eos_token_id": eos,
                                "tokens": list(out)}) for (prompt, n, eos), out in tokens.items()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One request a line, so a regenerated file diffs by request.
        self.path.write_text('{"key": ' + json.dumps(self.key) + ',\n "requests": [\n  '
                             + ",\n  ".join(requests) + "\n]}\n")
        self.tokens, self.matches = dict(tokens), True
