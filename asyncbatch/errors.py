"""Exceptions a caller of the engine can catch (bad input raises ``ValueError``/``TypeError`` instead)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine stopped (a worker failed, the core process died, or it was closed); the cause is chained."""


class RequestFailedError(RuntimeError):
    """This request failed (for example its logits were NaN); other requests went on."""


class ConstraintConflictError(RequestFailedError):
    """This request's own constraints (structured output, ``allowed_token_ids``, ``bad_words``) left no token to
    sample at some position: the caller's error, not the engine's (the server answers 400)."""
