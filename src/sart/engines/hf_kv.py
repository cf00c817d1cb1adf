"""The transformers engine's KV storage: where a branch's KV is, and the batch a step reads.

A branch's KV (its prompt's and the tokens it generated) is a ``Span``: a row of
a tensor per layer and the columns it holds there. A new branch's span is its
prompt's KV (held by the request, never written); after a decode step it is the
branch's row of the step batch the model read, whose last column the step filled;
a fork starts with its parent's span (the parent only ever writes past it); a
resumed branch's is the cache of the forward that recomputed it. No branch keeps
a copy of its own: a step batch is the storage.

``batch`` builds a step's left-padded batch from the rows' spans with one indexed
read and one indexed write per layer and tensor for each tensor the spans are in
(the last batch, a new request's prompt, a recomputed branch), whatever the number
of rows: on a GPU every operation is a kernel launch, and copying each row's KV
into place (three copies per row and layer) made each rebuild cost thousands. A
pad column repeats one of its row's positions (masked, and never NaN: 0 * NaN is
NaN). A last column is left free for the step's new token; ``InPlaceCache`` hands
that batch to the model as transformers' ``DynamicCache``, whose update writes the
new token into that column instead of concatenating (which copies the whole
batch, and on construction copies it once more). ``StepBatch`` keeps a step's
batch for the next one while the same branches go on: each row then has grown by
exactly the token written into the free column, so the next batch is this one
plus a new free column, taken from spare room reserved at the last rebuild (no
copy at all, and no tensor work per branch: the long testbed's steady step issues
the same ~1,080 operations at 8 branches and at 32). Only a change in the live
branches (one ends, starts, is aborted or paused) rebuilds it.

Padding costs attention over the longest row: a batch of 31 branches of 300
tokens and one of 2,048 attends to 32 x 2,048 positions. ``groups`` splits the
rows by length into batches forwarded one after the other when the padding
this saves outweighs a forward's fixed cost (``split_cost``: in positions, from
the model's size and the device), and ``StepBatches`` keeps one ``StepBatch``
per group. On the long testbed's policy on this project's CPU, one thread: 32
rows at 2,048 positions 21.7 ms a forward, at 300 4.9 ms; 31 rows at 300 plus
one at 2,048 in two forwards 8.0 ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from sart.hf_compat import LEGACY

KV = list[tuple[torch.Tensor, torch.Tensor]]


class Span:
    """Where a branch's KV is: per layer ``pairs[layer]`` (keys, values) of shape
    ``[rows, heads, columns, head_dim]``, its row ``row``, columns ``start`` to
    ``end`` (its prompt's first position to its last)."""

    __slots__ = ("end", "pairs", "row", "start")

    def __init__(self, pairs: KV, row: int, start: int, end: int) -> None:
        self.pairs, self.row, self.start, self.end = pairs, row, start, end

    @property
    def length(self) -> int:
        return self.end - self.start

    def copy(self) -> Span:
        """The same positions (a fork's, which then grows apart from its parent's)."""
        return Span(self.pairs, self.row, self.start, self.end)


def batch(spans: Sequence[Span], width: int, spare: int = 0) -> KV:
    """The left-padded batch of ``spans`` at ``width`` positions, one free one after
    them and ``spare`` more: per layer ``[rows, heads, width + 1 + spare, head_dim]``,
    row ``r`` holding ``spans[r]`` right-aligned in its first ``width`` columns (a pad
    repeats the row's first position). One read and one write per layer and tensor
    for each tensor the spans are in."""
    columns = width + 1 + spare
    out: KV = [
        (
            k.new_empty((len(spans), k.shape[1], columns, k.shape[3])),
            v.new_empty((len(spans), v.shape[1], columns, v.shape[3])),
        )
        for k, v in spans[0].pairs
    ]
    fill(out, spans, width)
    return out


def fill(out: KV, spans: Sequence[Span], width: int) -> None:
    """Write ``spans`` into rows ``0 .. len(spans) - 1`` of ``out`` as ``batch`` lays
    them out (right-aligned in columns ``0 .. width - 1``). ``out`` may be a tensor the
    spans are in (a kept batch rebuilt in place, ``sart.engines.hf_graphs``): each
    layer's rows are all read before any is written."""
    sources: dict[int, tuple[KV, list[int], list[int], list[list[int]]]] = {}
    for row, span in enumerate(spans):
        _, dest, src, cols = sources.setdefault(id(span.pairs), (span.pairs, [], [], []))
        dest.append(row)
        src.append(span.row)
        cols.append([span.start] * (width - span.length) + list(range(span.start, span.end)))
    device = out[0][0].device
    indices = [
        (
            pairs,
            torch.tensor(dest, device=device),
            torch.tensor(src, device=device)[:, None],
            torch.tensor(cols, dtype=torch.long, device=device),
        )
        for pairs, dest, src, cols in sources.values()
    ]
    for layer, (keys, values) in enumerate(out):
        # [rows, width, heads, head_dim] read, written as [rows, heads, width, ...].
        read = [
            (at, pairs[layer][0][rows, :, index], pairs[layer][1][rows, :, index])
            for pairs, at, rows, index in indices
        ]
        for at, k, v in read:
            keys[at, :, :width] = k.transpose(1, 2)
            values[at, :, :width] = v.transpose(1, 2)


class StepBatch:
    """A decode step's batch, kept for the next step (see the module docstring).

    ``clear`` must be called whenever the live branches change: ``get`` also checks
    that the rows are the same branches and one position longer, but a branch can
    change under the same id (a request id reused)."""

    SPARE = 64
    """Free columns reserved at a rebuild: steps until the next rebuild, at most."""

    def __init__(self) -> None:
        self._pairs: KV = []
        self._rows: tuple[object, ...] = ()
        self._width = -1

    def clear(self) -> None:
        self._pairs, self._rows = [], ()

    @property
    def pairs(self) -> KV:
        """The batch's tensors at their full size (the spare columns included): a
        position written into column ``c`` of ``get``'s views is at ``c`` here too."""
        return self._pairs

    def get(self, keys: tuple[object, ...], spans: Sequence[Span], width: int) -> KV:
        """The batch of ``spans`` (named ``keys``) at ``width`` positions plus a free
        one: last step's plus a column when the rows are the same and one longer, else
        a new one."""
        room = self._pairs[0][0].shape[2] if self._pairs else 0
        if not (keys == self._rows and width == self._width + 1 and width < room):
            self._pairs = batch(spans, width, self.SPARE)
            self._rows = keys
        self._width = width
        return [(k[:, :, : width + 1], v[:, :, : width + 1]) for k, v in self._pairs]


class InPlaceCache(DynamicCache):
    """transformers' ``DynamicCache`` over a ``batch``: the cache the model sees holds
    its first ``width`` positions, and a one-token forward's update writes the new
    keys and values into the free last position, returning the whole batch.

    ``build`` returns None where the model's cache layers are not plain dynamic ones
    (sliding-window layers keep only a window, which writing in place would not do):
    the engine then takes transformers' own cache."""

    _full: KV | None = None

    @classmethod
    def build(cls, full: KV, config: Any) -> InPlaceCache | None:
        held = [(k[:, :, :-1], v[:, :, :-1]) for k, v in full]
        if LEGACY:  # transformers 4.x
            cache = cls.from_legacy_cache(tuple(held))  # type: ignore[attr-defined]
        else:
            # Built empty (no copy), then pointed at the batch's positions: transformers
            # 5 copies the data a cache is built from.
            from transformers.cache_utils import DynamicLayer

            cache = cls(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in held], config=config)
            if any(type(layer) is not DynamicLayer for layer in cache.layers):
                return None
            for layer, (k, v) in zip(cache.layers, held):
                layer.keys, layer.values = k, v  # type: ignore[union-attr]
        cache._full = full
        return cache

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._full is None or key_states.shape[2] != 1:  # while being built
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        keys, values = self._full[layer_idx]
        self._write(keys, key_states)
        self._write(values, value_states)
        return keys, values

    def _write(self, into: torch.Tensor, states: torch.Tensor) -> None:
        """Write a one-token forward's keys or values into the batch's free column."""
        into[:, :, -1:] = states


def groups(lengths: Sequence[int], cost: int | None) -> list[list[int]]:
    """The rows (indices into ``lengths``) in batches of similar length: the split
    whose padded positions (rows x the longest row, per batch) plus ``cost`` per
    batch are fewest, longest rows first. ``cost`` None: one batch.

    Exact over splits into runs of the rows sorted by length (a dynamic programme,
    ``O(rows^2)``; the best split never interleaves lengths); only recomputed when
    the rows change, since rows growing by one each step add the same to every
    split."""
    if cost is None or len(lengths) < 2:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    widths = [lengths[i] + 1 for i in order]  # with the free column
    best = [0] + [0] * len(order)
    start = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        # The last batch is rows first..end-1, as wide as its first (longest) row.
        best[end], start[end] = min(
            (best[first] + cost + (end - first) * widths[first], first) for first in range(end)
        )
    cuts: list[list[int]] = []
    end = len(order)
    while end:
        cuts.append(order[start[end] : end])
        end = start[end]
    return cuts[::-1] if len(cuts) > 1 else [list(range(len(lengths)))]


class StepBatches:
    """The step batches of a step's groups (``groups``), kept between steps.

    The grouping is kept while the same rows go on (each one longer: the same
    split stays the best); each group's ``StepBatch`` then reuses its batch."""

    def __init__(self) -> None:
        self._keys: tuple[object, ...] = ()
        self._groups: list[list[int]] = []
        self._batches: list[StepBatch] = []

    def clear(self) -> None:
        self._keys, self._groups = (), []
        for kept in self._batches:
            kept.clear()

    def split(
        self, keys: tuple[object, ...], lengths: Sequence[int], cost: int | None
    ) -> list[tuple[StepBatch, list[int]]]:
        """Each group of the rows ``keys`` (at ``lengths``) with the step batch it uses."""
        if keys != self._keys:
            self._keys, self._groups = keys, groups(lengths, cost)
            del self._batches[len(self._groups) :]  # their memory back
            self._batches += [StepBatch() for _ in range(len(self._groups) - len(self._batches))]
        return list(zip(self._batches, self._groups))


def split_cost(config: Any, device: torch.device, dtype: torch.dtype) -> int | None:
    """The padded positions a separate forward must save to pay for itself, estimated
    from the model's size: a forward's fixed cost (reading the weights once, and
    each layer's kernel launches) over the cost of attending to one more position
    (reading its keys and values in every layer), at the device's memory bandwidth.

    On a CPU (10 GB/s and 0.2 ms a layer, one core of this project's machine) the
    long testbed's policy gives 2,800 (measured: 3,000) and Qwen2.5-0.5B in
    float32 about 65,000; on an accelerator (2 TB/s, 0.3 ms a layer, eager) splitting
    pays only for a tiny model with thousands of padded positions per row: there
    it returns None (one batch), as vLLM's paged attention has no padding."""
    if device.type != "cpu":
        return None
    layers = int(getattr(config, "num_hidden_layers", 1))
    hidden = int(getattr(config, "hidden_size", 1))
    heads = int(getattr(config, "num_attention_heads", 1))
    head_dim = int(getattr(config, "head_dim", None) or hidden // max(1, heads))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    size = torch.empty((), dtype=dtype).element_size()
    per_position = layers * 2 * kv_heads * head_dim * size
    inner = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    weights = layers * (4 * hidden * hidden + 3 * hidden * inner) * size
    bandwidth, per_layer = 10e9, 2e-4
    return round((layers * per_layer * bandwidth + weights) / per_position)


__all__ = [
    "KV",
    "InPlaceCache",
    "Span",
    "StepBatch",
    "StepBatches",
    "batch",
    "fill",
    "groups",
    "split_cost",
]
