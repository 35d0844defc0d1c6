"""OpenAI's log-probability objects from the engine's columnar ``Logprobs`` and the tokenizer.

Chat (``logprobs: true, top_logprobs: k``), per choice, or per chunk for that chunk's tokens::

    {"content": [{"token": " Paris", "logprob": -0.12, "bytes": [32, 80, 97, 114, 105, 115],
                  "top_logprobs": [{"token": " Paris", "logprob": -0.12, "bytes": [...]}, ...k]}]}

Completions (``logprobs: k``)::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob, ...}], "text_offset": [...]}

where each ``top_logprobs`` entry holds the ``k`` most likely tokens plus the sampled one (up to ``k + 1``
entries, as OpenAI documents; where two ids decode to the same string, the likelier one's value is kept),
and ``echo`` puts the prompt's tokens first: the first prompt token has no context to be scored in, so its
``token_logprobs`` and ``top_logprobs`` entries are ``null``.

A token's string is its id decoded alone (vLLM's choice), special tokens included; ``bytes`` are the
token's own bytes where the tokenizer can tell them (byte-level BPE pieces and ``<0xNN>`` byte-fallback
pieces, so a character split across tokens still reassembles), else the UTF-8 of its string.
``text_offset`` counts the characters of those strings. Log-probabilities of ``-inf`` (a token the model
gives no mass) and NaN are written as -9999.0: JSON has no infinities and OpenAI clients reject them
(vLLM does the same). Without a tokenizer (``skip_tokenizer_init``) tokens are named ``token_id:<id>``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import lru_cache

from asyncbatch.outputs import Logprobs

FLOOR = -9999.0
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def finite(value: float) -> float:
    """The log-probability as JSON can carry it (-inf and NaN become ``FLOOR``)."""
    return value if math.isfinite(value) else FLOOR


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of ``bytes_to_unicode``)."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = visible[:]
    extra = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars)}


class TokenTexts:
    """Token id -> (string, bytes), decoded once per id and kept (a server sees the same ids again and again)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._decode(token_id)
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _decode(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # part of a character: the piece's own bytes, if the tokenizer shows them
            raw = self._piece_bytes(token_id)
            if raw is not None:
                return text, raw
        return text, list(text.encode("utf-8"))

    def _piece_bytes(self, token_id: int) -> list[int] | None:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or not piece:
            return None
        byte = _BYTE_PIECE.match(piece)
        if byte:
            return [int(byte.group(1), 16)]
        decoder = _byte_decoder()
        if all(c in decoder for c in piece):
            return [decoder[c] for c in piece]
        return None


# -- chat ----------------------------------------------------------------------------------------------------
def chat_logprobs(lp: Logprobs | None, texts: TokenTexts, top: int) -> dict | None:
    """``choices[].logprobs`` of a chat completion (or of one chunk): ``{"content": [...]}``."""
    if lp is None:
        return None
    content = []
    for token, value, top_ids, top_values in zip(lp.token_ids, lp.logprobs, lp.top_token_ids, lp.top_logprobs):
        text, raw = texts.get(token)
        alternatives = []
        for alt, alt_value in zip(top_ids[:top], top_values[:top]):
            alt_text, alt_raw = texts.get(alt)
            alternatives.append({"token": alt_text, "logprob": finite(alt_value), "bytes": alt_raw})
        content.append({"token": text, "logprob": finite(value), "bytes": raw, "top_logprobs": alternatives})
    return {"content": content}


# -- completions ---------------------------------------------------------------------------------------------
class CompletionLogprobs:
    """Builds the legacy completions object, the text offsets running on across calls (one per chunk)."""

    def __init__(self, texts: TokenTexts, top: int, offset: int = 0) -> None:
        self.texts = texts
        self.top = top
        self.offset = offset

    def build(self, lp: Logprobs | None, prompt: tuple[Sequence[int], Logprobs | None] | None = None) -> dict:
        """The object for ``lp``'s tokens; ``prompt`` (ids, their logprobs from the second on) goes first
        (``echo``)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt is not None:
            ids, prompt_lp = prompt
            if ids:
                self._add(out, ids[0], None, None, None)
                if prompt_lp is not None:
                    self._add_run(out, prompt_lp)
        if lp is not None:
            self._add_run(out, lp)
        return out

    def _add_run(self, out: dict, lp: Logprobs) -> None:
        for token, value, top_ids, top_values in zip(lp.token_ids, lp.logprobs, lp.top_token_ids,
                                                     lp.top_logprobs):
            self._add(out, token, value, top_ids, top_values)

    def _add(self, out: dict, token: int, value: float | None, top_ids, top_values) -> None:
        text = self.texts.text(token)
        out["tokens"].append(text)
        out["text_offset"].append(self.offset)
        self.offset += len(text)
        if value is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            return
        entry: dict[str, float] = {}
        for alt, alt_value in zip(top_ids[:self.top], top_values[:self.top]):
            entry.setdefault(self.texts.text(alt), finite(alt_value))  # two ids, one string: the likelier one
        entry.setdefault(text, finite(value))
        out["token_logprobs"].append(finite(value))
        out["top_logprobs"].append(entry)


# -- vLLM's prompt_logprobs ----------------------------------------------------------------------------------
def vllm_prompt_logprobs(prompt_ids: Sequence[int], lp: Logprobs | None, texts: TokenTexts,
                         top: int) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token ``None`` (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` holding the token itself and the ``top`` most likely."""
    if lp is None or not prompt_ids:
        return None
    out: list[dict | None] = [None]
    for token, value, rank, top_ids, top_values in zip(lp.token_ids, lp.logprobs, lp.ranks, lp.top_token_ids,
                                                       lp.top_logprobs):
        entry = {str(alt): {"logprob": finite(alt_value), "rank": r, "decoded_token": texts.text(alt)}
                 for r, (alt, alt_value) in enumerate(zip(top_ids[:top], top_values[:top]), start=1)}
        entry[str(token)] = {"logprob": finite(value), "rank": rank, "decoded_token": texts.text(token)}
        out.append(entry)
    return out


_shared: dict[int, TokenTexts] = {}


def token_texts(tokenizer) -> TokenTexts:
    """The server's one ``TokenTexts`` for ``tokenizer`` (its cache lives as long as the server)."""
    texts = _shared.get(id(tokenizer))
    if texts is None or texts.tokenizer is not tokenizer:
        texts = _shared[id(tokenizer)] = TokenTexts(tokenizer)
    return texts
