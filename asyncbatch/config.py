"""Engine configuration: one dataclass per concern, validated once, unknown keys refused.

``EngineConfig`` is what the engine needs before it starts; ``SimConfig`` the cost and output-length model
of the simulated device it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from asyncbatch.sampling_params import MAX_SEED
from asyncbatch.speculative.config import SpeculativeConfig

OUTPUT_LENGTH_DISTRIBUTIONS = ("uniform", "geometric", "fixed")


@dataclass(slots=True)
class SimConfig:
    """Cost model and output-length model of the simulated device.

    One step costs ``step_fixed_ms + per_token_us * scheduled_tokens +
    per_context_token_ns * context_tokens`` of wall time, spent sleeping so the
    GIL is free, as a real device would leave it. Pseudo-tokens are a hash of
    (seed, request key, position, previous token), so they are deterministic and
    depend on the token fed back from the previous step; the end-of-sequence
    token is emitted once a request reaches its drawn output length.

    Defaults approximate SmolLM2-135M decode on one H200; every figure produced
    on this device is labelled simulated.
    """

    step_fixed_ms: float = 2.0
    per_token_us: float = 4.0
    per_context_token_ns: float = 5.0
    output_len_distribution: str = "uniform"
    output_len_min: int = 16
    output_len_max: int = 256
    seed: int = 0
    # Speculative engines: the chance that each draft is accepted (the run stops at the first rejection).
    spec_acceptance: float = 0.7
    # ``method="draft_model"``: a draft forward's cost as a share of the target's over the same tokens
    # (about the draft's size over the target's; ``draft_seconds``).
    draft_cost_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.spec_acceptance <= 1.0:
            raise ValueError(f"SimConfig.spec_acceptance must be in [0, 1], got {self.spec_acceptance!r}")
        if isinstance(self.draft_cost_ratio, bool) or not isinstance(self.draft_cost_ratio, (int, float)) \
                or not 0.0 <= self.draft_cost_ratio <= 10.0:
            raise ValueError(f"SimConfig.draft_cost_ratio must be in [0, 10], got {self.draft_cost_ratio!r}")
        for name in ("step_fixed_ms", "per_token_us", "per_context_token_ns"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"SimConfig.{name} must be a number >= 0, got {value!r}")
        if self.output_len_distribution not in OUTPUT_LENGTH_DISTRIBUTIONS:
            raise ValueError(
                f"SimConfig.output_len_distribution must be one of {OUTPUT_LENGTH_DISTRIBUTIONS}, "
                f"got {self.output_len_distribution!r}"
            )
        if not 1 <= self.output_len_min <= self.output_len_max:
            raise ValueError(
                f"SimConfig needs 1 <= output_len_min <= output_len_max, got "
                f"{self.output_len_min}, {self.output_len_max}"
            )

    def step_seconds(self, scheduled_tokens: int, context_tokens: int) -> float:
        return (
            self.step_fixed_ms * 1e-3
            + self.per_token_us * 1e-6 * scheduled_tokens
            + self.per_context_token_ns * 1e-9 * context_tokens
        )

    def draft_seconds(self, scheduled_tokens: int, context_tokens: int, num_decode: int, depth: int) -> float:
        """A draft_model step's draft work: one forward over the step's tokens (the draft's KV follows the
        target's) and, in a step verifying ``depth`` drafts a row, ``depth`` single-token forwards of the
        ``num_decode`` decode rows (the proposals); each at ``draft_cost_ratio`` of the target's cost."""
        propose = depth * self.step_seconds(num_decode, context_tokens) if num_decode else 0.0
        return self.draft_cost_ratio * (self.step_seconds(scheduled_tokens, context_tokens) + propose)


DEVICES = ("auto", "cpu", "cuda", "sim")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's names
GRAMMAR_BACKENDS = ("xgrammar", "llguidance")  # structured outputs; "auto" takes the first one installed
# Weight precisions of the cpu device (``asyncbatch.model.quantization``); None keeps the dtype's weights.
QUANTIZATIONS = ("int8", "int4", "w8a8")


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to know before it starts.

    ``max_num_seqs`` bounds the requests scheduled together (and sizes the device
    token buffer, one row per request). ``max_num_batched_tokens`` bounds the
    tokens of one step; chunked prefill splits longer prompts. ``num_kv_blocks``
    overrides the memory-budget sizing of the KV cache (tests use it to force
    preemption). ``enable_prefix_caching``: full KV blocks are shared between
    requests with the same prefix (``docs/prefix-caching.md``); on by default,
    as in vLLM.
    """

    model: str | None = None
    # A tokenizer directory (or hub-style name already on disk) other than the model's own folder.
    tokenizer: str | None = None
    # Token ids in, token ids out: no tokenizer is loaded, text prompts, stop strings and chat are refused.
    skip_tokenizer_init: bool = False
    # A Jinja chat template (the text itself, or a path to a file holding it) replacing the tokenizer's.
    chat_template: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    # cpu only: "int8" / "int4" weight-only or "w8a8" (int8 weights and per-row int8 activations) for the
    # decoder's projections and the LM head; None keeps every weight in ``dtype``.
    quantization: str | None = None
    # cpu only: run pure decode steps through ``torch.compile`` (inductor's C++ backend), compiled when the
    # engine starts (minutes on a small CPU); steps with a prefill chunk stay eager. False: every step eager,
    # like vLLM's ``enforce_eager=True``. docs/cpu-precision.md.
    compile_decode: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    seed: int = 0
    overlap: bool = True
    # The engine core (scheduler, planner, executor) in a child process, so detokenization, stop strings
    # and the caller's own Python never share a GIL with the launch path. False: a thread of this process.
    engine_process: bool = True
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None
    enable_cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    cache_dir: str | None = None
    num_threads: int | None = None
    debug_check_integrity: bool = False
    enable_prefix_caching: bool = True
    # vLLM's scheduling policy: "fcfs" admits in arrival order; "priority" by ``SamplingParams.priority`` (lower
    # first, arrival order among equals), and preempts the lowest priority first when KV blocks run out.
    scheduling_policy: str = "fcfs"
    # Sampling defaults for what a request leaves unset, vLLM's: "auto" takes the model folder's
    # generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), "vllm" the
    # neutral defaults, a folder path that folder's file (``frontend/generation_defaults.py``);
    # ``override_generation_config`` (a dict of those fields) is laid over it.
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # Structured outputs: the grammar library ("auto": the measured default, docs/structured-output.md).
    structured_outputs_backend: str = "auto"
    # Build the grammar compiler (the grammar library's view of the vocabulary: ~0.5 s of CPU for a 49k
    # vocabulary in the frontend, and as much again in the core, which also loads the tokenizer) in the
    # background when the engine starts, so the first structured request does not wait ~1 s for it.
    # ``asyncbatch serve`` turns it on; off here so that engines which never see a grammar never pay for it.
    structured_outputs_warmup: bool = False
    # True: a step's grammar masks are filled while its forward runs, and only its sampling waits for them.
    # False: the naive way, for the side-by-side benchmark: a step with grammar rows is launched only once
    # every earlier step was applied and its masks were filled (the device idles meanwhile).
    grammar_mask_overlap: bool = True
    # Before serving, the planner thread rehearses a few admission rounds on throwaway planner objects, so the
    # first burst of arrivals is admitted at the cost of later ones (~10-35 ms of the start;
    # ``engine/planner_warmup.py``). False: the first steps that admit anything pay that themselves.
    planner_warmup: bool = True
    # In-process mode only (engine_process=False): the caller's thread switch interval while the engine
    # runs. The device thread waits for the GIL up to this long after each step, and CPython's 5 ms
    # default is longer than a decode step. Process-wide; None leaves it alone. The core process leaves
    # the interpreter's default: there no caller thread holds the GIL, and shortening it changed nothing
    # (sim, 256 running, 1 ms steps: busy 94.8 % with 0.2 ms, 95.6 % with the default; in-process the
    # same run gave 76.5 % vs 47.5 %).
    switch_interval_s: float | None = 2e-4
    # Speculative decoding (``docs/speculative.md``): a ``SpeculativeConfig`` or a dict of its fields (vLLM's
    # ``speculative_config``); None: one token per row and step. cpu and sim devices, for now.
    speculative_config: SpeculativeConfig | dict | None = None
    sim: SimConfig = field(default_factory=SimConfig)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization is not None and self.device in ("cuda", "sim"):
            raise ValueError(f"quantization={self.quantization!r} runs on the cpu device only, got "
                             f"device={self.device!r}")
        if not isinstance(self.compile_decode, bool):
            raise TypeError(f"compile_decode must be a bool, got {type(self.compile_decode).__name__}")
        if self.compile_decode and self.device in ("cuda", "sim"):
            raise ValueError(f"compile_decode=True runs on the cpu device only, got device={self.device!r}")
        if self.compile_decode and self.quantization not in (None, "w8a8"):
            raise ValueError(f"compile_decode=True supports quantization None or 'w8a8', got {self.quantization!r}")
        _positive("seed", self.seed, upper=MAX_SEED, lower=0)  # as SamplingParams.seed: requests' seeds derive from it
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
        if self.skip_tokenizer_init and (self.tokenizer is not None or self.chat_template is not None):
            raise ValueError("skip_tokenizer_init=True loads no tokenizer: tokenizer and chat_template must be None")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.structured_outputs_backend not in GRAMMAR_BACKENDS + ("auto",):
            raise ValueError(f"structured_outputs_backend must be one of {('auto', *GRAMMAR_BACKENDS)}, got "
                             f"{self.structured_outputs_backend!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise TypeError("generation_config must be 'auto', 'vllm' or a folder path (a non-empty string), got "
                            f"{self.generation_config!r}")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise TypeError("override_generation_config must be a dict of generation_config fields, got "
                            f"{type(self.override_generation_config).__name__}")
        if not isinstance(self.planner_warmup, bool):
            raise TypeError(f"planner_warmup must be a bool, got {type(self.planner_warmup).__name__}")
        if not isinstance(self.structured_outputs_warmup, bool):
            raise TypeError(f"structured_outputs_warmup must be a bool, got "
                            f"{type(self.structured_outputs_warmup).__name__}")
        if not isinstance(self.grammar_mask_overlap, bool):
            raise TypeError(f"grammar_mask_overlap must be a bool, got {type(self.grammar_mask_overlap).__name__}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {type(self.enable_prefix_caching).__name__}")
        if not isinstance(self.sim, SimConfig):
            raise TypeError(f"sim must be a SimConfig, got {type(self.sim).__name__}")
        self.speculative_config = SpeculativeConfig.coerce(self.speculative_config)
        if self.speculative_config is not None:
            if self.device == "cuda":
                raise ValueError("speculative_config runs on the cpu and sim devices only (for now), got "
                                 f"device={self.device!r}")
            if self.speculative_config.num_speculative_tokens >= self.block_size:
                raise ValueError(f"speculative_config.num_speculative_tokens must be < block_size ({self.block_size}), "
                                 f"got {self.speculative_config.num_speculative_tokens}")
        if self.cuda_graph_batch_sizes is not None:
            sizes = tuple(int(s) for s in self.cuda_graph_batch_sizes)
            if not sizes or any(s < 1 for s in sizes):
                raise ValueError("cuda_graph_batch_sizes must be a non-empty list of positive ints")
            self.cuda_graph_batch_sizes = tuple(sorted(set(sizes)))

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from keyword arguments; an unknown key is a ``TypeError`` naming it. Three of vLLM's arguments
        that scripts written for it pass are taken in their meaning here (``_vllm_arguments``)."""
        kwargs = _vllm_arguments(kwargs)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]


def _vllm_arguments(kwargs: dict[str, object]) -> dict[str, object]:
    """vLLM's ``enforce_eager=True`` is ``compile_decode=False`` and ``enable_cuda_graphs=False`` (every step
    eager); ``tensor_parallel_size`` must be 1 (one device); ``trust_remote_code`` changes nothing (no model code
    is ever loaded from a checkpoint: only the architectures in ``asyncbatch.model`` run)."""
    kwargs = dict(kwargs)
    eager = kwargs.pop("enforce_eager", None)
    if eager is not None:
        if not isinstance(eager, bool):
            raise TypeError(f"enforce_eager must be a bool, got {type(eager).__name__}")
        if eager:
            if kwargs.get("compile_decode") or kwargs.get("enable_cuda_graphs"):
                raise ValueError("enforce_eager=True runs every step eagerly: it cannot be combined with "
                                 "compile_decode=True or enable_cuda_graphs=True")
            kwargs["compile_decode"] = False
            kwargs["enable_cuda_graphs"] = False
    tp = kwargs.pop("tensor_parallel_size", None)
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp != 1):
        raise ValueError(f"tensor_parallel_size must be 1 (this engine runs on one device), got {tp!r}")
    trust = kwargs.pop("trust_remote_code", None)
    if trust is not None and not isinstance(trust, bool):
        raise TypeError(f"trust_remote_code must be a bool, got {type(trust).__name__}")
    return kwargs


def _positive(name: str, value: object, upper: int, lower: int = 1) -> None:
    """An int (not a bool) in [``lower``, ``upper``]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lower <= value <= upper:
        raise ValueError(f"{name} must be in [{lower}, {upper}], got {value}")
