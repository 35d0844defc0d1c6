"""Serving: ``AsyncLLM`` (the asyncio API) and the OpenAI-compatible HTTP server (``asyncbatch serve``).

``AsyncLLM`` needs nothing beyond the engine; the server modules need the ``serve`` extra (FastAPI,
uvicorn, prometheus_client) and are imported only by ``asyncbatch serve`` and their users. ``AsyncLLM`` is
imported on first use (PEP 562), as ``asyncbatch.LLM`` is: a process that uses only the plain modules here
(the cluster's ingress and launcher: settings, protocol, app) does not import the engine for them.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncbatch.serve.async_llm import AsyncLLM, AsyncRequest

__all__ = ["AsyncLLM", "AsyncRequest"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from asyncbatch.serve import async_llm

        return getattr(async_llm, name)
    raise AttributeError(f"module 'asyncbatch.serve' has no attribute {name!r}")
