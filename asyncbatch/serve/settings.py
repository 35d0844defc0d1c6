"""What a server run is configured with beyond the engine's own arguments."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ServeSettings:
    """``served_model_names``: the names ``model`` may take in requests (the first is reported); ``api_key``:
    required as a Bearer token on ``/v1`` when set; ``max_waiting``: requests not yet scheduled beyond which
    new ones get 503 with ``Retry-After`` (None: unbounded); ``max_body_bytes``: larger bodies get 413;
    ``shutdown_timeout_s``: after SIGTERM, how long in-flight requests may run before they are aborted;
    ``trust_request_chat_template``: a chat request may bring its own Jinja ``chat_template`` (vLLM's flag of the
    same name; off: such a request is a 400, since a template runs as code in the server's sandboxed Jinja)."""

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_waiting: int | None = None
    max_body_bytes: int = 4 << 20
    shutdown_timeout_s: float = 30.0
    retry_after_s: int = 1
    log_requests: bool = True
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_name must be one or more non-empty names")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout_s}")
