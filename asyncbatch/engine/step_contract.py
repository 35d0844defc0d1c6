"""What crosses from the engine to the executors: the step's metadata, its staging buffer, the block constants.

The planner writes one step into a ``StagingBuffer`` (``step_metadata``) and
hands the executor a ``StepMeta`` that points at it; the executor reads both and
nothing else of the engine. This module is the whole of that boundary: the
engine's modules import these names from here (``host_staging``,
``step_metadata`` and ``block_manager`` re-export them for their own callers),
and the executors import nothing else of ``asyncbatch.engine``
(``tests/test_layering.py`` checks it).

Invariants the two sides share:

* A staging buffer is written only after its ``fence`` fired, i.e. after the
  copy out of it (launched for the step that last used it) has completed; the
  executor signals the fence once the buffer's contents are copied out.
* Sizes: T tokens (``max_num_batched_tokens``), S rows (``max_num_seqs``),
  B blocks per row. A ``StepMeta`` says how much of each array is live
  (``num_tokens``, ``num_decode``, ``num_sampled``, ``prefill_rows``); entries
  past that are stale and never read.
* Block ``DUMMY_BLOCK`` is never given to a request: padding rows of a
  captured CUDA graph write their keys and values there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

DUMMY_BLOCK = 0  # the KV block padding rows write to; never allocated


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: the one ceiling division of the project."""
    return -(-num_tokens // block_size)


class Fence:
    """Signalled once the last copy out of a staging buffer has finished."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._event.set()
        self._cuda_event: torch.cuda.Event | None = None

    def arm(self) -> None:
        self._event.clear()
        self._cuda_event = None

    def signal(self) -> None:
        self._event.set()

    def signal_with_cuda_event(self, event: torch.cuda.Event) -> None:
        self._cuda_event = event
        self._event.set()

    def wait(self) -> None:
        self._event.wait()
        if self._cuda_event is not None:
            self._cuda_event.synchronize()


def _host_array(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> np.ndarray:
    tensor = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
    return tensor.numpy()


@dataclass(slots=True)
class StagingBuffer:
    """Metadata buffers for one step. Sizes: T tokens, S rows, B blocks per row."""

    index: int
    input_ids: np.ndarray  # [T] int64 (decode rows' entries are overwritten on device)
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, flat KV index per token
    token_is_output: np.ndarray  # [T] bool, for penalties when a preempted request is recomputed
    token_owner_row: np.ndarray  # [T] int64, token row of the row each token belongs to
    decode_token_rows: np.ndarray  # [S] int64, where decode rows read their input token
    decode_block_tables: np.ndarray  # [S, B] int64
    decode_context_lens: np.ndarray  # [S] int64
    prefill_block_tables: np.ndarray  # [S, B] int64
    prefill_row_spans: np.ndarray  # [S, 3] int64: token_start, q_len, ctx_len of each prefill row
    first_chunk_token_rows: np.ndarray  # [S] int64: token rows whose request (re)starts its prefill
    logits_indices: np.ndarray  # [S] int64
    sample_token_rows: np.ndarray  # [S] int64, where sampled tokens are written
    sample_seed: np.ndarray  # [S] int64
    sample_step: np.ndarray  # [S] int64
    sample_top_k: np.ndarray  # [S] int64
    sample_temperature: np.ndarray  # [S] float32
    sample_top_p: np.ndarray  # [S] float32
    sample_min_p: np.ndarray  # [S] float32
    sample_presence: np.ndarray  # [S] float32
    sample_frequency: np.ndarray  # [S] float32
    sample_repetition: np.ndarray  # [S] float32
    fence: Fence = field(default_factory=Fence)

    @classmethod
    def allocate(cls, index: int, max_tokens: int, max_rows: int, max_blocks: int, pinned: bool) -> StagingBuffer:
        i64, f32 = torch.int64, torch.float32
        return cls(
            index=index,
            input_ids=_host_array((max_tokens,), i64, pinned),
            positions=_host_array((max_tokens,), i64, pinned),
            slot_mapping=_host_array((max_tokens,), i64, pinned),
            token_is_output=_host_array((max_tokens,), torch.bool, pinned),
            token_owner_row=_host_array((max_tokens,), i64, pinned),
            decode_token_rows=_host_array((max_rows,), i64, pinned),
            decode_block_tables=_host_array((max_rows, max_blocks), i64, pinned),
            decode_context_lens=_host_array((max_rows,), i64, pinned),
            prefill_block_tables=_host_array((max_rows, max_blocks), i64, pinned),
            prefill_row_spans=_host_array((max_rows, 3), i64, pinned),
            first_chunk_token_rows=_host_array((max_rows,), i64, pinned),
            logits_indices=_host_array((max_rows,), i64, pinned),
            sample_token_rows=_host_array((max_rows,), i64, pinned),
            sample_seed=_host_array((max_rows,), i64, pinned),
            sample_step=_host_array((max_rows,), i64, pinned),
            sample_top_k=_host_array((max_rows,), i64, pinned),
            sample_temperature=_host_array((max_rows,), f32, pinned),
            sample_top_p=_host_array((max_rows,), f32, pinned),
            sample_min_p=_host_array((max_rows,), f32, pinned),
            sample_presence=_host_array((max_rows,), f32, pinned),
            sample_frequency=_host_array((max_rows,), f32, pinned),
            sample_repetition=_host_array((max_rows,), f32, pinned),
        )


@dataclass(slots=True)
class PrefillRowMeta:
    token_start: int
    q_len: int
    ctx_len: int
    token_row: int
    block_count: int


class PrefillRows(Sequence[PrefillRowMeta]):
    """A step's prefill rows (``StepMeta.prefill_rows``), kept as one ``[P, 5]`` int64 array in
    ``PrefillRowMeta``'s field order; the ``PrefillRowMeta`` objects are made on first access. An admission
    burst's hundreds of rows thus cost the planner one array, and only an executor that reads them one by
    one (the torch executor, on its own thread) pays for the objects; the ``sim`` never does."""

    __slots__ = ("_rows", "columns")

    def __init__(self, columns: np.ndarray) -> None:
        self.columns = columns
        self._rows: list[PrefillRowMeta] | None = None

    def _list(self) -> list[PrefillRowMeta]:
        if self._rows is None:
            self._rows = list(map(PrefillRowMeta, *self.columns.T.tolist())) if len(self.columns) else []
        return self._rows

    def __len__(self) -> int:
        return len(self.columns)

    def __getitem__(self, index):
        return self._list()[index]

    def __iter__(self) -> Iterator[PrefillRowMeta]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None


@dataclass(slots=True)
class CachedContext:
    """Tokens of reused cached prefixes of penalised rows, in this step's first chunks ([K] each).

    The penalty state of a row is rebuilt from the tokens its prefill computes; a prefix reused from the
    prefix cache is not computed, so its tokens come here to count as if it had been. Plain host arrays
    (rarely used, unbounded in size): they stay referenced by the ``StepMeta`` until the step completes.
    """

    rows: np.ndarray  # [K] int64 token row of each token
    token_ids: np.ndarray  # [K] int64
    is_output: np.ndarray  # [K] bool: a former output of a recomputed request
    positions: np.ndarray  # [K] int64 each token's position in its request


@dataclass(slots=True)
class SparseBias:
    """Additions to sampled rows' logits, one entry each ([N] each): ``logit_bias`` and the -inf of
    ``min_tokens`` (EOS and stop ids of rows that have not reached their minimum). An entry applies to a
    position whose output index is below its ``until`` (the device knows the index: in a verify step a
    decode row's entries apply at each of its positions, and a row's count is the host's only as a bound)."""

    index: np.ndarray  # [N] int64 sample index (row of the step's logits)
    token_ids: np.ndarray  # [N] int64
    values: np.ndarray  # [N] float32 (may be -inf)
    until: np.ndarray  # [N] int64 output index from which the entry no longer applies (ALWAYS: never)


ALWAYS = np.iinfo(np.int64).max  # ``SparseBias.until`` of an entry for every output (``logit_bias``)


@dataclass(slots=True)
class LogprobRows:
    """Sampled rows that asked for logprobs: their sample index and how many alternatives ([L] each). The
    executor returns an entry per row, or in a verify step one per position for a decode row
    (``entries``)."""

    index: np.ndarray  # [L] int64 sample index, ascending (decode rows first)
    k: np.ndarray  # [L] int64 in [0, 20]
    max_k: int

    def entries(self, num_decode: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Where each of the executor's entries was sampled, as ``[E]`` (which of these rows, position in the
        row's run): a decode row of a step that computed ``width`` positions a row has ``width`` entries, in
        order; any other row one. ``index[rows]`` is each entry's sample index, ``k[rows]`` its alternatives."""
        n = len(self.index)
        if width == 1:
            return np.arange(n), np.zeros(n, dtype=np.int64)
        d = int(np.count_nonzero(self.index < num_decode))  # decode rows come first
        rows = np.concatenate([np.repeat(np.arange(d), width), np.arange(d, n)])
        positions = np.concatenate([np.tile(np.arange(width, dtype=np.int64), d), np.zeros(n - d, dtype=np.int64)])
        return rows, positions


@dataclass(slots=True)
class PromptLogprobRows:
    """Prompt positions scored in this step: the logits at step token ``token_index`` score ``target_ids``."""

    token_index: np.ndarray  # [P] int64 index into the step's tokens
    target_ids: np.ndarray  # [P] int64 the prompt token that follows
    seqs: np.ndarray  # [Q] int64 the requests, in order
    counts: np.ndarray  # [Q] int64 how many of the P entries each owns (consecutive)
    k: np.ndarray  # [Q] int64 alternatives each asked for
    max_k: int


class GrammarMask:
    """Token bitmasks of this step's grammar rows, filled by the host after the step was launched.

    The planner fills ``bitmask`` once every earlier step's tokens were applied (the grammar state
    after token N is needed to sample N+1), then calls ``set_ready``; the device runs the step's
    forward meanwhile and only its sampling waits (``wait_ready``). Rows without a grammar never wait.
    ``begin_fill`` marks the moment the fill enters the grammar library (``wait_fill_begun``: the simulated
    device's cue to do its own host work, ``SimExecutor._wait_for_host_gap``).

    In a verify step (``width`` > 1) each of the first ``num_decode`` rows (the decode rows: sample indices
    below the step's ``num_decode``) has ``width`` bitmask rows, one per position it may compute: its mask
    after the drafts before that position (``GrammarCompiler.fill_draft_masks``); the other rows one each.

    ``device_drafts`` (a draft model's engine, in a verify step): those drafts are made by the device at the
    start of this very step, so the host's walk along them waits for them: the device hands every row's
    drafts over with ``offer_drafts`` (each ``[G, k]`` row's first ``counts`` drafts; the first ``num_decode``
    rows are read), then runs its forwards, and its sampling waits for the mask as ever::

        device   [propose: draft forwards]●offer_drafts [forward: target .....................][wait][sample]
        planner  [apply N, fill first positions][wait_drafts ●][walk the drafts, fill]●set_ready
    """

    __slots__ = ("_drafts", "_drafts_offered", "_filling", "_ready", "bitmask", "device_drafts", "index",
                 "num_decode", "ready_time", "seqs", "width")

    def __init__(self, index: np.ndarray, seqs: np.ndarray, bitmask: np.ndarray, width: int = 1,
                 num_decode: int = 0, device_drafts: bool = False) -> None:
        self.index = index  # [G] int64 sample index
        self.seqs = seqs  # [G] int64 the requests
        # [num_decode * width + G - num_decode, ceil(V / 32)] int32, bit set = allowed; all written by the fill
        self.bitmask = bitmask
        self.width = width  # bitmask rows of each decode row (1 + the step's planned drafts)
        self.num_decode = num_decode if width > 1 else 0
        self.device_drafts = device_drafts and self.num_decode > 0
        self._ready = threading.Event()
        self._filling = threading.Event()  # the fill's library call has begun (or the mask is ready)
        self.ready_time = 0.0  # perf_counter when the mask became ready
        self._drafts_offered = threading.Event()
        self._drafts: tuple[np.ndarray, np.ndarray] | None = None

    @staticmethod
    def num_mask_rows(num_rows: int, num_decode: int, width: int) -> int:
        return num_decode * width + num_rows - num_decode

    def first_rows(self) -> np.ndarray:
        """``[G]`` the bitmask row of each row's first position (its own row when ``width`` is 1)."""
        g, d, w = len(self.index), self.num_decode, self.width
        if w == 1:
            return np.arange(g)
        return np.concatenate([np.arange(d) * w, np.arange(d * w, d * w + g - d)])

    def begin_fill(self) -> None:
        """The host enters the grammar library's fill, which runs without the GIL: a modelled device may do
        its own host work now without delaying the host (``SimExecutor``)."""
        self._filling.set()

    def wait_fill_begun(self, timeout: float) -> bool:
        """Wait until ``begin_fill`` or ``set_ready`` (at most ``timeout`` seconds)."""
        return self._filling.wait(timeout)

    def set_ready(self, now: float) -> None:
        self.ready_time = now
        self._filling.set()
        self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def offer_drafts(self, drafts: np.ndarray, counts: np.ndarray) -> None:
        """The device's drafts of this step's rows (``device_drafts``): ``[G, k]`` int64 and ``[G]`` counts."""
        self._drafts = (drafts, counts)
        self._drafts_offered.set()

    def wait_drafts(self, gone: Callable[[], bool], poll_s: float = 0.005) -> tuple[np.ndarray, np.ndarray] | None:
        """The drafts ``offer_drafts`` handed over; None if ``gone()`` (the step ended, failed, without
        offering them) turns true first."""
        while not self._drafts_offered.wait(poll_s):
            if gone():
                return self._drafts
        return self._drafts


@dataclass(slots=True)
class SamplerExtras:
    """Per-step sampler work beyond the plain sampler: present only when some row asked for it."""

    bias: SparseBias | None = None
    logprobs: LogprobRows | None = None
    prompt_logprobs: PromptLogprobRows | None = None
    grammar: GrammarMask | None = None


@dataclass(slots=True)
class StepMeta:
    """Host-side header of a written staging buffer: sizes and per-step flags."""

    step_id: int
    staging: StagingBuffer
    num_tokens: int
    num_decode: int
    decode_max_blocks: int
    prefill_rows: Sequence[PrefillRowMeta]  # a PrefillRows from the metadata writer
    num_sampled: int
    context_tokens: int  # total context attended over, for cost models
    all_greedy: bool
    any_filter: bool  # some row uses top-k, top-p or min-p
    any_penalty: bool
    first_chunk_rows: list[int]  # token rows whose request (re)starts its prefill in this step
    cached_context: CachedContext | None = None  # penalised first chunks after a prefix-cache hit
    extras: SamplerExtras | None = None  # logit bias, min_tokens, logprobs, grammar masks
    # Speculative engines (``docs/speculative.md``): drafts each decode row verifies; its tokens are the
    # ``1 + spec_depth`` first of the step, row after row, and the device derives their ids, positions and slots
    # from what it holds. ``decode_context_lens`` is then each row's reserved KV (positions past it are not
    # written) and ``sample_step`` of decode rows is not read. Its extras index the sampled rows as ever; the
    # executor finds each row's positions in the verify layout (``torch_executor._ExtrasAt``).
    spec_depth: int = 0
    # Speculative engines: the reused cached prefixes of this step's first chunks (every row, penalised or not),
    # for the device's token history, which the n-gram proposer reads.
    history_context: CachedContext | None = None

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode * (self.spec_depth + 1)
