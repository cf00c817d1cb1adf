"""The incremental scoring of ``TransformersPRM``: each branch's KV cache kept
between checks, and the rows of one call batched over those caches.

A branch's ``BranchCache`` holds the KV cache of its last input, that input's
ids and the rewards read at its rating positions. A check's item becomes a
``Row``: the new tokens past the longest prefix its cache holds. Rows with
similar numbers of new tokens run together: their caches are merged into one
(left-padded to the longest past, the pads masked), one forward scores them,
and the returned cache is split back into one per row; a cache layout that
cannot be merged or split falls back to one forward per row.

``IncrementalRows`` is the part of ``TransformersPRM`` that does this; the
forward itself (``_forward``) and the cache API are the PRM's.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs
import torch

from sart.prm.formats import good_probability
from sart.prm.hf_cache import CacheAPI, cut_rows, stack_left_padded
from sart.prm.window import Encoded
from sart.types import BranchId

T = TypeVar("T")


def chunks(seq: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """``seq`` in consecutive slices of at most ``size`` items."""
    for start in range(0, len(seq), size):
        yield seq[start : start + size]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


@attrs.define
class BranchCache:
    """What a branch keeps between checks: the KV cache of its last input, that
    input's ids, and the rewards read at its rating positions."""

    cache: Any
    ids: list[int] = attrs.Factory(list)
    rewards: dict[int, float] = attrs.Factory(dict)


@attrs.define
class Row:
    """One item of an incremental call: its input, what its branch's cache
    already holds of it, and, once scored, the branch's new entry."""

    branch: BranchId
    ids: list[int]
    positions: list[int]
    """Rating positions in ``ids``."""
    start: int = 0
    """Tokens of ``ids`` the cache holds (their common prefix with the cached input)."""
    cache: Any = None
    """The branch's cache, holding at least ``start`` tokens; ``None`` if ``start == 0``."""
    rewards: dict[int, float] = attrs.Factory(dict)
    """Rewards by rating position: those before ``start`` are known beforehand."""
    done: BranchCache | None = None
    """The branch's entry to keep, once the row is scored."""

    @property
    def new(self) -> list[int]:
        return self.ids[self.start :]

    def new_positions(self) -> list[int]:
        """The rating positions not yet read, relative to ``new``."""
        return [p - self.start for p in self.positions if p >= self.start]

    def finish(self, cache: Any, rewards: Sequence[float] = ()) -> None:
        """Record the rewards read at ``new_positions`` and the cache to keep
        (``None``: keep none)."""
        fresh = [p for p in self.positions if p >= self.start]
        self.rewards.update(zip(fresh, rewards, strict=True))
        self.done = None if cache is None else BranchCache(cache, self.ids, self.rewards)


class IncrementalRows:
    """Planning, batching, merging and splitting rows over branch caches (a mixin of
    ``TransformersPRM``, which sets the attributes below and defines ``_forward``)."""

    batch_size: int
    max_cached_branches: int | None
    _caches: OrderedDict[BranchId, BranchCache]
    _cache_api: CacheAPI
    _empty_cache: Any
    _merging: bool
    _merge_pasts: bool
    _state_key: str | None
    _forward: Callable[..., tuple[Any, list[Any]]]
    """The PRM's forward over rows (``TransformersPRM._forward``)."""

    def _plan(self, branch: BranchId, enc: Encoded) -> Row:
        """The branch's row: its cached entry taken out (put back only once
        scored: a failed forward may leave a cache half-updated) and the longest
        prefix of the input it holds."""
        ids, positions = enc.ids(), enc.positions()
        entry = self._caches.pop(branch, None)
        if entry is None:
            return Row(branch, ids, positions)
        start = _common_prefix(entry.ids, ids)
        # A rating position inside the common prefix must have its reward already.
        start = min([start, *(p for p in positions if p < start and p not in entry.rewards)])
        if start == 0:
            return Row(branch, ids, positions)
        known = {p: r for p, r in entry.rewards.items() if p < start}
        return Row(branch, ids, positions, start, entry.cache, known)

    def _run(self, rows: Sequence[Row]) -> None:
        """Score the rows: the new tokens of up to ``batch_size`` of them per forward."""
        pending = []
        for row in rows:
            if row.start < len(row.ids):
                pending.append(row)
            else:  # nothing new (the same text, or a prefix of it): no forward
                with torch.inference_mode():  # the cache holds inference tensors
                    self._cache_api.crop(row.cache, row.start)
                row.finish(row.cache)
        # Rows with and without a cache are batched apart: a model's per-position
        # cache state need not have a neutral value for an all-padding past.
        for cached in (False, True):
            group = [row for row in pending if (row.cache is not None) == cached]
            # A right pad costs a whole forward per token, a left pad only attention:
            # rows with similar numbers of new tokens go together first.
            group.sort(key=lambda row: (len(row.ids) - row.start, row.start))
            for chunk in chunks(group, self.batch_size):
                self._run_chunk(chunk)

    def _run_chunk(self, chunk: Sequence[Row]) -> None:
        merged = self._merge(chunk) if len(chunk) > 1 else None
        if merged is None:
            for row in chunk:
                self._run_one(row)
            return
        for row in chunk:  # the merged cache holds their data: let theirs go (memory)
            row.cache = None
        output, logits = self._forward(
            [row.new for row in chunk],
            [row.new_positions() for row in chunk],
            cache=merged,
            past=[row.start for row in chunk],
        )
        caches = self._split(self._cache_api.returned(output, merged), chunk)
        for row, cache, two_way in zip(chunk, caches, logits):
            row.finish(cache, good_probability(two_way))

    def _run_one(self, row: Row) -> None:
        """The row on its own cache, cropped in place (the one-by-one path)."""
        if row.cache is None:
            cache = self._new_cache()
        else:
            cache = row.cache
            with torch.inference_mode():
                self._cache_api.crop(cache, row.start)
        output, logits = self._forward([row.new], [row.new_positions()], cache=cache)
        row.finish(self._cache_api.returned(output, cache), good_probability(logits[0]))

    def _merge(self, chunk: Sequence[Row]) -> Any | None:
        """One cache for the chunk's rows: each row's first ``start`` positions,
        left-padded to the longest (the pads are masked in ``_forward``); ``None``
        if their caches cannot be merged (then they run one by one)."""
        if not self._merging:
            return None
        if all(row.cache is None for row in chunk):
            return self._new_cache()
        if not self._merge_pasts and len({row.start for row in chunk}) > 1:
            return None
        parts = []
        for row in chunk:
            part = self._cache_parts(row.cache)
            if part is None:
                return None
            parts.append(part)
        if len({len(layers) for layers, _ in parts}) != 1:
            return None
        past = [row.start for row in chunk]
        with torch.inference_mode():
            layers = [
                (
                    stack_left_padded([k for k, _ in layer], past, dim=2),
                    stack_left_padded([v for _, v in layer], past, dim=2),
                )
                for layer in zip(*(layers for layers, _ in parts))
            ]
            state = {
                name: stack_left_padded([s[name] for _, s in parts], past, dim=1)
                for name in parts[0][1]
            }
            return self._filled(layers, state)

    def _split(self, cache: Any, chunk: Sequence[Row]) -> list[Any]:
        """One cache per row from the merged one, its real positions only (past
        and new, without the pads); ``None`` each if the cache cannot be split."""
        parts = self._cache_parts(cache)
        if parts is None:
            self._merging = False  # the forward returned a cache of another layout
            return [None] * len(chunk)
        layers, state = parts
        held = cache.get_seq_length() - max(len(row.new) for row in chunk)
        spans = [(row.start, len(row.new)) for row in chunk]
        with torch.inference_mode():
            cut_layers = [
                (cut_rows(keys, held, spans, dim=2), cut_rows(values, held, spans, dim=2))
                for keys, values in layers
            ]
            cut_state = {name: cut_rows(v, held, spans, dim=1) for name, v in state.items()}
            return [
                self._filled(
                    [(keys[r], values[r]) for keys, values in cut_layers],
                    {name: rows[r] for name, rows in cut_state.items()},
                )
                for r in range(len(chunk))
            ]

    def _cache_parts(self, cache: Any) -> tuple[list[tuple[Any, Any]], dict[str, Any]] | None:
        """The cache's layers (``CacheAPI.tensors``) and the model's per-position
        state on it (``cache_state_key``; empty if the model keeps none), or
        ``None`` if the cache cannot be merged or split."""
        layers = self._cache_api.tensors(cache)
        if layers is None:
            return None
        if self._state_key is None:
            return layers, {}
        state = getattr(cache, self._state_key, None)
        return (layers, state) if isinstance(state, dict) and state else None

    def _new_cache(self) -> Any:
        # Building a DynamicCache from the config costs ~50 us (its layer types),
        # copying an empty one a third of that; a batched check makes one per row.
        return copy.deepcopy(self._empty_cache)

    def _filled(self, layers: Sequence[tuple[Any, Any]], state: dict[str, Any]) -> Any:
        cache = self._cache_api.fill(self._new_cache(), layers)
        if self._state_key is not None:
            setattr(cache, self._state_key, state)
        return cache

    def _remember(self, branch: BranchId, entry: BranchCache) -> None:
        self._caches[branch] = entry
        if self.max_cached_branches is not None:
            while len(self._caches) > self.max_cached_branches:
                self._caches.popitem(last=False)
