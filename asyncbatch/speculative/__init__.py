"""Speculative decoding (issue 24): proposers of draft tokens that the target model verifies in one step.

``ngram``: prompt lookup, the n-gram proposer, as tensor operations on the device's token history;
``verify``: acceptance of deterministic drafts by the target's own seeded sampler (tokens identical to
non-speculative decoding).
Not wired into the engine yet: the verification step and the planner's one-step-late reconciliation
(``docs/speculative.md``, to come) are the rest of the issue.
"""
