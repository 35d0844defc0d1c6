"""Serving: ``AsyncLLM`` (the asyncio API) and the OpenAI-compatible HTTP server (``asyncbatch serve``).

``AsyncLLM`` needs nothing beyond the engine; the server modules need the ``serve`` extra (FastAPI,
uvicorn, prometheus_client) and are imported only by ``asyncbatch serve`` and their users.
"""

from asyncbatch.serve.async_llm import AsyncLLM, AsyncRequest

__all__ = ["AsyncLLM", "AsyncRequest"]
