"""Engine configuration: one dataclass, validated once, unknown keys refused."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from asyncbatch.sim_config import SimConfig

DEVICES = ("auto", "cpu", "cuda", "sim")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to know before it starts.

    ``max_num_seqs`` bounds the requests scheduled together (and sizes the device
    token buffer, one row per request slot). ``max_num_batched_tokens`` bounds the
    tokens of one step; chunked prefill splits longer prompts. ``num_kv_blocks``
    overrides the memory-budget sizing of the KV cache (tests use it to force
    preemption).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    seed: int = 0
    overlap: bool = True
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None
    enable_cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    cache_dir: str | None = None
    num_threads: int | None = None
    debug_check_integrity: bool = False
    # The interpreter's thread switch interval while the engine runs. The device
    # thread waits for the GIL up to this long after each step; CPython's 5 ms
    # default is longer than a decode step. Process-wide; None leaves it alone.
    switch_interval_s: float | None = 2e-4
    sim: SimConfig = field(default_factory=SimConfig)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _positive("max_num_seqs", self.max_num_seqs, upper=65536)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, upper=1 << 20)
        _positive("block_size", self.block_size, upper=1024)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode in one step"
            )
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len, upper=1 << 24)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks, upper=1 << 26)
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError(f"gpu_memory_utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}")
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads, upper=1024)
        if self.switch_interval_s is not None and not 1e-6 <= self.switch_interval_s <= 0.1:
            raise ValueError(f"switch_interval_s must be in [1e-6, 0.1] or None, got {self.switch_interval_s}")
        if not isinstance(self.sim, SimConfig):
            raise TypeError(f"sim must be a SimConfig, got {type(self.sim).__name__}")
        if self.cuda_graph_batch_sizes is not None:
            sizes = tuple(int(s) for s in self.cuda_graph_batch_sizes)
            if not sizes or any(s < 1 for s in sizes):
                raise ValueError("cuda_graph_batch_sizes must be a non-empty list of positive ints")
            self.cuda_graph_batch_sizes = tuple(sorted(set(sizes)))

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from keyword arguments; an unknown key is a ``TypeError`` naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]


def _positive(name: str, value: object, upper: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 1 <= value <= upper:
        raise ValueError(f"{name} must be in [1, {upper}], got {value}")
