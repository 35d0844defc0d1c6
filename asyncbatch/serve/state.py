"""What every route of one server shares: the engine, the settings, the metrics, and admission."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from asyncbatch.outputs import RequestOutput
from asyncbatch.serve.engine_protocol import AsyncEngineClient
from asyncbatch.serve.metrics import ServeMetrics
from asyncbatch.serve.openai_errors import OpenAIError
from asyncbatch.serve.settings import ServeSettings

log = logging.getLogger("asyncbatch.serve")


@dataclass
class ServerState:
    engine: AsyncEngineClient
    settings: ServeSettings
    metrics: ServeMetrics
    draining: bool = False  # SIGTERM received: new requests are refused, in-flight ones finish

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def check_model(self, requested: str | None) -> str:
        """The name to answer with; an unknown model is a 404 like OpenAI's ``model_not_found``."""
        if requested is None or requested in self.settings.served_model_names:
            return self.model_name
        raise OpenAIError(404, f"the model {requested!r} does not exist; this server serves "
                          f"{list(self.settings.served_model_names)}", param="model", code="model_not_found")

    def admit(self, count: int) -> None:
        """Refuse ``count`` new requests while draining, or when they would overfill the waiting queue."""
        if self.draining:
            raise OpenAIError(503, "the server is shutting down", code="shutting_down",
                              headers={"Retry-After": str(self.settings.retry_after_s)})
        limit = self.settings.max_waiting
        if limit is None:
            return
        _unfinished, waiting = self.engine.num_requests()
        if waiting + count > limit:
            raise OpenAIError(503, f"the server is overloaded: {waiting} requests are waiting (max_waiting "
                              f"{limit}); retry later", code="overloaded",
                              headers={"Retry-After": str(self.settings.retry_after_s)})

    def finished(self, output: RequestOutput) -> None:
        """A choice ended: metrics, and one log line (id, tokens, TTFT, latency, finish reason)."""
        self.metrics.observe(output)
        if self.settings.log_requests and log.isEnabledFor(logging.INFO):
            m = output.metrics
            ttft = f"{m.ttft * 1e3:.1f}" if m is not None and m.ttft is not None else "-"
            latency = f"{m.latency * 1e3:.1f}" if m is not None and m.latency is not None else "-"
            log.info("request %s prompt_tokens=%d completion_tokens=%d ttft_ms=%s latency_ms=%s finish=%s",
                     output.request_id, len(output.prompt_token_ids), len(output.token_ids), ttft, latency,
                     output.finish_reason)
