"""The transformers engine's KV storage: a branch's own KV and the batch a decode step reads.

A branch's own KV (the tokens it generated and forwarded) lives in per-layer
buffers with room to grow: a token is one write into the next free position,
and a full buffer doubles (up to the branch's token cap), so a branch of ``L``
tokens costs ``O(L)`` copies in all, not the ``O(L^2)`` of concatenating a new
tensor each step (on the long testbed, this and transformers' cache's
concatenations took 46% of a decode step's time). A fork borrows its parent's
buffers: the parent only ever writes past the positions the fork reads, and
the fork copies what it reads before its own first write (copy on write).
A decode step writes a branch's new position only into the step batch (below);
the branch's buffers take it when they are read (the batch rebuilt, a fork), all
the positions held since in one copy per layer. So a decode step does no tensor
work per branch: on a GPU each operation is a kernel launch (on the long testbed a
steady step issues the same ~1,080 operations at 8 branches and at 32, where
copying each branch's position issued 42 more per branch).

``batch`` left-pads the prompt's and the branches' own KV into the one batch a
decode step attends to, writing each part straight into place (one copy), with
a last column left free for the step's new token; ``InPlaceCache`` hands that
batch to the model as transformers' ``DynamicCache``, whose update writes the
new token into that column instead of concatenating (which copies the whole
batch, and on construction copies it once more). ``StepBatch`` keeps a step's
batch for the next one while the same branches go on: each row then has grown
by exactly the token written into the free column, so the next batch is this
one plus a new free column, taken from spare room reserved at the last rebuild
(no copy at all). Only a change in the live branches (one ends, starts, is
aborted or paused) rebuilds it.

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

_FIRST = 16
"""A new buffer's positions, at least."""


class OwnKV:
    """A branch's own KV: per layer a ``(key, value)`` buffer of shape
    ``[1, heads, capacity, head_dim]`` whose first ``stored`` positions hold it, and
    the positions after them, up to ``count``, still in the step batch a decode step
    wrote them into (``hold``): they are copied into the buffers only when the KV is
    read (``flush``: a batch rebuilt, a fork), all of them in one copy per layer, so
    a decode step copies nothing per branch."""

    __slots__ = ("_held", "borrowed", "count", "limit", "pairs", "stored")

    def __init__(self, pairs: KV, count: int, limit: int, borrowed: bool = False) -> None:
        self.pairs = pairs
        self.count = count
        self.stored = count
        self.limit = limit  # the branch's token cap: a grown buffer never holds more
        self.borrowed = borrowed  # another branch's buffers: copy before writing
        self._held: tuple[KV, int, int] | None = None  # (batch, row, first column)

    @classmethod
    def of(cls, pairs: KV, count: int, limit: int) -> OwnKV:
        """The last ``count`` positions of ``pairs`` (a forward's output cache), copied
        into buffers of their own (the forward's tensors also hold the prompt)."""
        own = cls(pairs, count, limit, borrowed=True)
        keep = [(k[:, :, -count:], v[:, :, -count:]) for k, v in pairs]
        own._grow(keep, like=keep)
        return own

    @classmethod
    def in_batch(cls, batch: KV, row: int, column: int, limit: int) -> OwnKV:
        """Own KV of one position, held in ``batch`` (a branch's first forwarded token)."""
        own = cls([], 0, limit)
        own.hold(batch, row, column)
        return own

    @property
    def capacity(self) -> int:
        return self.pairs[0][0].shape[2] if self.pairs else 0

    def fork(self) -> OwnKV:
        """The KV a fork starts from: these buffers, borrowed."""
        self.flush()
        return OwnKV(self.pairs, self.count, self.limit, borrowed=True)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s keys and values, ``[1, heads, count, head_dim]`` views."""
        self.flush()
        keys, values = self.pairs[index]
        return keys[:, :, : self.count], values[:, :, : self.count]

    def hold(self, batch: KV, row: int, column: int) -> None:
        """Add the position a decode step wrote into ``batch`` (a step batch's tensors,
        per layer ``[rows, heads, columns, head_dim]``) at ``row``, ``column``. Positions
        held in one batch row, one after the other, are copied together later."""
        held = self._held
        if held is not None:
            first_batch, first_row, first = held
            if not (
                first_batch is batch
                and first_row == row
                and first + self.count - self.stored == column
            ):
                self.flush()
                held = None
        if held is None:
            self._held = (batch, row, column)
        self.count += 1

    def flush(self) -> None:
        """Copy the positions held in a step batch into the buffers (one copy per layer
        and tensor), growing or un-borrowing them first."""
        if self._held is None:
            return
        batch, row, column = self._held
        self._held = None
        if self.borrowed or self.count > self.capacity:
            kept = [(k[:, :, : self.stored], v[:, :, : self.stored]) for k, v in self.pairs]
            self._grow(kept, like=batch)
        n = self.count - self.stored
        for (keys, values), (k, v) in zip(self.pairs, batch):
            keys[0, :, self.stored : self.count] = k[row, :, column : column + n]
            values[0, :, self.stored : self.count] = v[row, :, column : column + n]
        self.stored = self.count

    def append(self, new: KV) -> None:
        """Add one position (``new``: per layer ``[1, heads, 1, head_dim]``) now."""
        self.flush()
        if self.borrowed or self.count == self.capacity:
            kept = [(k[:, :, : self.count], v[:, :, : self.count]) for k, v in self.pairs]
            self._grow(kept, like=new)
        at = self.count
        for (keys, values), (k, v) in zip(self.pairs, new):
            keys[:, :, at : at + 1] = k
            values[:, :, at : at + 1] = v
        self.count = self.stored = at + 1

    def _grow(self, keep: KV, like: KV) -> None:
        # Doubling keeps appends amortised O(1); the limit keeps a branch near its
        # cap from holding twice what it can use. ``like`` (per layer) gives the
        # shapes: there may be nothing to keep yet.
        capacity = max(self.count + 1, min(max(_FIRST, 2 * self.count), self.limit))
        grown: KV = []
        for layer, (lk, lv) in enumerate(like):
            keys = lk.new_empty((1, lk.shape[1], capacity, lk.shape[3]))
            values = lv.new_empty((1, lv.shape[1], capacity, lv.shape[3]))
            if keep:
                k, v = keep[layer]
                keys[:, :, : k.shape[2]] = k
                values[:, :, : v.shape[2]] = v
            grown.append((keys, values))
        self.pairs, self.borrowed = grown, False


def empty(new: KV, limit: int) -> OwnKV:
    """Own KV holding only ``new`` (a branch's first forwarded token)."""
    own = OwnKV([], 0, limit)
    own.append(new)
    return own


def batch(rows: Sequence[tuple[KV, OwnKV | None]], width: int, spare: int = 0) -> KV:
    """The left-padded batch of ``rows`` (each a prompt's KV and a branch's own KV) at
    ``width`` positions, one free one after them and ``spare`` more: per layer
    ``[rows, heads, width + 1 + spare, head_dim]``, zeros in the padding (masked, but a
    masked position must not hold a NaN: 0 * NaN is NaN)."""
    pairs: KV = []
    columns = width + 1 + spare
    for layer in range(len(rows[0][0])):
        k0, v0 = rows[0][0][layer]
        keys = k0.new_empty((len(rows), k0.shape[1], columns, k0.shape[3]))
        values = v0.new_empty((len(rows), v0.shape[1], columns, v0.shape[3]))
        for row, (prompt, own) in enumerate(rows):
            pk, pv = prompt[layer]
            mine = own.count if own is not None else 0
            pad = width - pk.shape[2] - mine
            if pad:
                keys[row, :, :pad] = 0
                values[row, :, :pad] = 0
            at = pad + pk.shape[2]
            keys[row, :, pad:at] = pk[0]
            values[row, :, pad:at] = pv[0]
            if own is not None and mine:
                ok, ov = own.layer(layer)
                keys[row, :, at:width] = ok[0]
                values[row, :, at:width] = ov[0]
        pairs.append((keys, values))
    return pairs


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

    def get(
        self, keys: tuple[object, ...], rows: Sequence[tuple[KV, OwnKV | None]], width: int
    ) -> KV:
        """The batch of ``rows`` (named ``keys``) at ``width`` positions plus a free one:
        last step's plus a column when the rows are the same and one longer, else a
        new one."""
        room = self._pairs[0][0].shape[2] if self._pairs else 0
        if not (keys == self._rows and width == self._width + 1 and width < room):
            self._pairs = batch(rows, width, self.SPARE)
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
        keys[:, :, -1:] = key_states
        values[:, :, -1:] = value_states
        return keys, values


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
    "OwnKV",
    "StepBatch",
    "StepBatches",
    "batch",
    "empty",
    "groups",
    "split_cost",
]
