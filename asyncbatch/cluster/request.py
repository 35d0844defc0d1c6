"""What the ingress sends to a replica for one choice: the prompt's token ids (already validated), its sampling
parameters and id, and a text form of the prompt for routers that match text (Ray's ``PrefixCacheAffinityRouter``
reads an argument's ``prompt`` attribute)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncbatch.sampling_params import SamplingParams

# Ray's prefix router builds a character tree of ``prompt``. Token-id prompts (no tokenizer, or the sim
# study) become one character per token: code point 0x100 + id, skipping the surrogate range, so equal
# token prefixes are equal string prefixes and the tree stays one node per token.
_BASE = 0x100
_SURROGATES = (0xD800, 0xE000)


def ids_as_text(token_ids: list[int]) -> str:
    out = []
    for t in token_ids:
        c = _BASE + t
        if c >= _SURROGATES[0]:
            c += _SURROGATES[1] - _SURROGATES[0]
        out.append(chr(min(c, 0x10FFFF)))
    return "".join(out)


@dataclass(slots=True)
class ReplicaRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    prompt_text: str | None = None  # the user's text, when the prompt was text

    @property
    def prompt(self) -> str:
        """The prompt as text for text-matching routers (the token ids' character form if it came as ids)."""
        return self.prompt_text if self.prompt_text is not None else ids_as_text(self.prompt_token_ids)
