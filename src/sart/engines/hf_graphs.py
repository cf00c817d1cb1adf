"""Decode steps over buffers the engine owns, replayed as CUDA graphs (``cuda_graphs=True``).

On a GPU a decode step of a small or mid-sized model is launch-bound: transformers'
forward issues about a thousand kernels (the long testbed's policy), each costing
host time the GPU waits on. A CUDA graph replays a captured forward as one launch,
but only over tensors at fixed addresses and of fixed shapes, so it cannot read
``hf_kv``'s step batches (a new one at every rebuild) or transformers' caches
(which grow). As vLLM's model runner does, ``StaticDecode`` keeps its own:

- one KV buffer per layer, ``[rows, heads, columns, head_dim]``, zeroed once (a
  column no row has written must be finite: it is masked, and a masked NaN is
  still NaN); branches' spans live there as they live in a step batch, and a
  rebuild (the live branches changed) writes them in place with ``hf_kv.fill``;
- the step's inputs in one ``[rows, 3]`` tensor (token, length, the column the
  new token is written to) and the logits out in one ``[rows, vocab]`` buffer;
- a graph per bucket of (rows, columns): rows rounded up to a power of two,
  columns to a multiple of ``column_bucket``. A step attends over its bucket's
  columns, masked to each row's positions, so one graph serves
  ``column_bucket`` steps of a growing batch; padded rows decode token 0 at
  position 0 and are never read.

The graph's forward builds the mask and positions from the inputs on the device
and writes the new keys and values into their column with ``index_copy_`` (the
column is a tensor, so a replay writes where that step's inputs say). A step is
then: one upload of the inputs, one copy into the graph's, the replay, one copy of
the logits out.

Buffers grow (rows to the bucket needed, columns to at least twice what they
were), and growing drops the graphs captured over the old ones: they are captured
again as buckets are used. They grow only within a memory budget (``max_bytes``; by
default half the device memory not otherwise in use when they grow): a step whose
bucket needs more raises ``OverBudget`` before touching anything, and the engine
decodes that step by its default path (step batches as large as the rows need, not
rounded up to a bucket), so a long or wide batch runs slower instead of running out
of memory. ``capture=False`` runs the same forward without a graph
(on a CPU, and in tests: every step of the graph path but the capture). The
captured graphs share one memory pool, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sart import hf_compat
from sart.engines.hf_kv import KV, InPlaceCache, Span, fill
from sart.errors import ConfigError

COLUMN_BUCKET = 256
"""Columns are bucketed by this many: a graph serves that many steps of a growing batch."""


class CaptureFailed(RuntimeError):
    """A bucket's forward could not be captured as a CUDA graph (the model did
    something a capture forbids, such as reading a tensor back to the host). The
    step's rows are laid out in ``kv`` (row ``r`` the ``r``-th span, right-aligned
    before the step's column), its token not forwarded: the engine decodes on
    without graphs from there."""


class OverBudget(RuntimeError):
    """A step's bucket needs KV buffers over the memory budget (``max_bytes``). Raised
    before anything changed: the spans are where they were, and the caller decodes
    the step without the buffers."""


MEMORY_FRACTION = 0.5
"""The share of the device memory not otherwise in use (free, cached by torch's
allocator but unused, or held by this decoder's buffers) that growing buffers may
take when no ``max_bytes`` is given."""


def row_bucket(rows: int) -> int:
    """The rows a batch of ``rows`` is padded to: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


class _ColumnWrite(InPlaceCache):
    """``InPlaceCache`` writing the new token's keys and values into a column given
    as a tensor (``index_copy_``), so a replayed graph writes where its inputs say."""

    _column: torch.Tensor | None = None

    def _write(self, into: torch.Tensor, states: torch.Tensor) -> None:
        assert self._column is not None  # set as soon as the cache is built (``_cache``)
        into.index_copy_(2, self._column, states)


def supported(model: Any) -> bool:
    """Whether the model's cache layers are plain dynamic ones (``InPlaceCache`` can
    stand for them); sliding-window layers are not."""
    config = model.config
    weight = next(model.parameters())
    layers = int(getattr(config, "num_hidden_layers", 1))
    empty = weight.new_zeros((1, 1, 1, 1))
    return InPlaceCache.build([(empty, empty)] * layers, config) is not None


def graphed(model: Any) -> StaticDecode:
    """``HFEngine(cuda_graphs=True)``'s decoder for ``model``, or a ``ConfigError``
    saying why it cannot have one."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ConfigError(f"cuda_graphs=True needs a CUDA device; the model is on {device}")
    if not supported(model):
        raise ConfigError(
            "cuda_graphs=True needs plain dynamic cache layers; this model's are not "
            "(sliding-window attention): leave it off"
        )
    return StaticDecode(model)


class StaticDecode:
    """Decode steps over the engine's own buffers, each bucket's forward captured as
    a CUDA graph (``capture=True``) or run as is (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        capture: bool | None = None,
        column_bucket: int = COLUMN_BUCKET,
        max_bytes: int | None = None,
    ) -> None:
        weight = next(model.parameters())
        self.model = model
        self.device = weight.device
        self.dtype = weight.dtype
        self.capture = self.device.type == "cuda" if capture is None else capture
        """Whether each bucket's forward is captured as a graph (``None``: where the
        model is on a CUDA device; elsewhere the same forward runs as is)."""
        self.column_bucket = column_bucket
        self.max_bytes = max_bytes
        """The most the KV buffers may take (``None``: on a CUDA device,
        ``MEMORY_FRACTION`` of the memory not otherwise in use when they grow; elsewhere
        no limit). Lowered to what failed if an allocation runs out of memory."""
        self.over_budget = 0
        """Steps that needed buffers over the budget (the engine decoded them without)."""
        self.kv: KV = []
        """The KV buffers, one (keys, values) per layer: every live branch's span is here."""
        self._inputs = torch.zeros((0, 3), dtype=torch.long, device=self.device)
        self._logits = torch.zeros((0, 0), device=self.device)
        self._columns = torch.arange(0, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[Any, _ColumnWrite]] = {}
        self._pool: Any = None
        self._rows: tuple[object, ...] = ()
        self._width = -1
        self._cache_arg = hf_compat.cache_argument(model)
        self.captures = 0
        """Graphs captured so far (a benchmark reports them: each costs a few forwards)."""

    def clear(self) -> None:
        """The live branches changed: the next step rebuilds the buffers' rows."""
        self._rows = ()

    def step(
        self, keys: tuple[object, ...], spans: Sequence[Span], lengths: Sequence[int],
        tokens: Sequence[int],
    ) -> torch.Tensor:  # fmt: skip
        """Forward one token for each row (``keys`` names them, ``spans`` holds their KV
        of ``lengths`` positions); the next-token logits, one float row each. Each row's
        span afterwards is its row of ``kv``, one position longer (the caller sets it)."""
        rows, width = len(spans), max(lengths)
        bucket = (row_bucket(rows), -(-(width + 1) // self.column_bucket) * self.column_bucket)
        with torch.inference_mode():
            self._reserve(*bucket, spans)
            if not (keys == self._rows and width == self._width + 1):
                fill(self.kv, spans, width)
                self._rows = keys
            self._width = width
            padded = [[0, 0, width]] * (bucket[0] - rows)  # token 0 at position 0: never read
            inputs = [[t, n, width] for t, n in zip(tokens, lengths)] + padded
            self._inputs[: bucket[0]].copy_(torch.tensor(inputs, device=self.device))
            if self.capture:
                self._graph(*bucket).replay()
            else:
                self._forward(*bucket, self._cache(*bucket))
            return self._logits[:rows].clone()

    # ------------------------------------------------------------ internals

    def _reserve(self, rows: int, columns: int, spans: Sequence[Span]) -> None:
        """Buffers of at least ``rows`` x ``columns``: new ones (the spans moved into
        them, the graphs over the old ones dropped) if these are smaller."""
        have = (self.kv[0][0].shape[0], self.kv[0][0].shape[2]) if self.kv else (0, 0)
        if rows <= have[0] and columns <= have[1]:
            return
        rows = max(rows, have[0])
        first = spans[0].pairs
        # Growing columns at least doubles them (few regrowths over a long branch),
        # unless only the columns the step needs fit in the budget.
        wanted = [have[1]] if columns <= have[1] else [columns, max(columns, 2 * have[1])]
        budget = self._budget()
        fits = [c for c in wanted if budget is None or _bytes(first, rows, c) <= budget]
        if not fits:
            self.over_budget += 1
            raise OverBudget(
                f"{rows} rows x {wanted[0]} columns of KV take {_bytes(first, rows, wanted[0])} "
                f"bytes, over the buffers' budget of {budget}"
            )
        columns = fits[-1]
        try:
            kv = [
                (
                    k.new_zeros((rows, k.shape[1], columns, k.shape[3])),
                    v.new_zeros((rows, v.shape[1], columns, v.shape[3])),
                )
                for k, v in first
            ]
        except torch.OutOfMemoryError as exc:  # the budget was too generous: lowered
            self.max_bytes = _bytes(first, rows, columns) - 1
            self.over_budget += 1
            raise OverBudget(f"{rows} rows x {columns} columns of KV: {exc}") from exc
        if self.kv:  # live branches' spans are in the old buffers: carried over by the
            self._rows = ()  # rebuild this step does (``fill`` into the new ones)
        self.kv = kv
        self._inputs = torch.zeros((rows, 3), dtype=torch.long, device=self.device)
        vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self._logits = torch.zeros((rows, vocab), device=self.device)
        self._columns = torch.arange(columns, device=self.device)
        self._graphs.clear()

    def _budget(self) -> int | None:
        """What the buffers may take now (see ``max_bytes``)."""
        if self.max_bytes is not None or self.device.type != "cuda":
            return self.max_bytes
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        held = sum(k.nbytes + v.nbytes for k, v in self.kv)
        return int(MEMORY_FRACTION * (free + cached + held))

    def _cache(self, rows: int, columns: int) -> _ColumnWrite:
        """The cache the forward of bucket (``rows``, ``columns``) reads: views of the
        buffers, written at the column the inputs name. Built outside a capture
        (transformers' cache constructor may copy from the host, which a capture
        forbids) and kept with its graph."""
        full = [(k[:rows, :, :columns], v[:rows, :, :columns]) for k, v in self.kv]
        cache = _ColumnWrite.build(full, self.model.config)
        assert cache is not None  # the engine checked ``supported`` before building this
        cache._column = self._inputs[:1, 2]
        return cache  # type: ignore[return-value]

    def _forward(self, rows: int, columns: int, cache: _ColumnWrite) -> None:
        """The step at bucket (``rows``, ``columns``) over the buffers: what a graph
        captures. Only tensor work, none of it reading back to the host."""
        inputs = self._inputs[:rows]
        lengths, column = inputs[:, 1], inputs[:1, 2]
        cols = self._columns[:columns]
        # Row r attends to its lengths[r] positions before the written column, and to it.
        keep = (cols[None, :] >= (column - lengths)[:, None]) & (cols[None, :] <= column)
        mask = (~keep).to(self.dtype)[:, None, None, :] * torch.finfo(self.dtype).min
        out = self.model(
            input_ids=inputs[:, :1],
            position_ids=lengths[:, None],
            attention_mask=mask,
            use_cache=True,
            **{self._cache_arg: cache},
        )
        self._logits[:rows].copy_(out.logits[:, -1])

    def _graph(self, rows: int, columns: int) -> Any:
        """The graph of bucket (``rows``, ``columns``), captured on first use: warmed up
        on a side stream, then captured into the shared pool. A step is idempotent (it
        writes the same column from the same inputs), so the warm-up runs are harmless."""
        kept = self._graphs.get((rows, columns))
        if kept is None:
            try:
                kept = self._capture(rows, columns)
            except Exception as exc:  # whatever the capture met: the caller decodes on
                raise CaptureFailed(
                    f"capturing the decode forward at {rows} rows x {columns} columns as a "
                    f"CUDA graph failed: {type(exc).__name__}: {exc}"
                ) from exc
            self._graphs[(rows, columns)] = kept
            self.captures += 1
        return kept[0]

    def _capture(self, rows: int, columns: int) -> tuple[Any, _ColumnWrite]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        cache = self._cache(rows, columns)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(rows, columns, cache)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(rows, columns, cache)
        return graph, cache  # the cache's views kept with the graph that reads them


def _bytes(pairs: KV, rows: int, columns: int) -> int:
    """The bytes of KV buffers shaped like ``pairs``' layers at ``rows`` x ``columns``."""
    per_position = sum(
        (k.shape[1] * k.shape[3]) * k.element_size() + (v.shape[1] * v.shape[3]) * v.element_size()
        for k, v in pairs
    )
    return rows * columns * per_position


__all__ = [
    "COLUMN_BUCKET",
    "MEMORY_FRACTION",
    "CaptureFailed",
    "OverBudget",
    "StaticDecode",
    "graphed",
    "row_bucket",
    "supported",
]
