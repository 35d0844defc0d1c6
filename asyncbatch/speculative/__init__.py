"""Speculative decoding (issue 24, ``docs/speculative.md``): proposers of draft tokens that the target model
verifies in one step.

``config``: ``SpeculativeConfig`` (vLLM's names); ``device_state``: what the device holds per token row (its
length, outputs, token history, drafts) and the verify step's work on it; ``ngram``: prompt lookup as tensor
operations on the token history; ``draft_model``: a smaller model's greedy drafts over its own KV cache in
the target's blocks; ``draft_check``: whether a draft model can draft for the target (at engine start);
``verify``: acceptance of deterministic drafts by the target's own seeded sampler (tokens identical to
non-speculative decoding).
"""
