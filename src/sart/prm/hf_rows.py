"""The incremental scoring of ``TransformersPRM``: each branch's KV kept between
checks, and the rows of one call batched over it.

A branch's ``BranchCache`` holds what its last input left: that input's ids, the
rewards read at its rating positions, and its keys and values, either in a slot
of the PRM's ``KVPool`` (``sart.prm.hf_pool``; batches of more than one row) or
in a KV cache of its own (``batch_size=1``, and caches that cannot be merged). A
check's item becomes a ``Row``: the new tokens past the longest prefix its branch
holds. Rows with similar numbers of new tokens run together: the pool gives their
merged past in one read per tensor (left-padded to the longest, the pads masked),
one forward scores them, and the pool takes each row's new positions back in one
write per tensor: a check's tensor work does not grow with its rows. A cache
layout that cannot be merged or split falls back to one forward per row, its own
cache cropped in place.

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
from sart.prm.hf_cache import CacheAPI
from sart.prm.hf_pool import KVPool
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
    """What a branch keeps between checks: its last input's ids, the rewards read at
    its rating positions, and its keys and values: in ``slot`` of the PRM's pool, or
    in ``cache``, a KV cache of its own (the one-by-one path)."""

    cache: Any
    ids: list[int] = attrs.Factory(list)
    rewards: dict[int, float] = attrs.Factory(dict)
    slot: int | None = None


@attrs.define
class Row:
    """One item of an incremental call: its input, what its branch holds of it, and,
    once scored, the branch's new entry."""

    branch: BranchId
    ids: list[int]
    positions: list[int]
    """Rating positions in ``ids``."""
    start: int = 0
    """Tokens of ``ids`` the branch holds (their common prefix with its last input)."""
    cache: Any = None
    """The branch's own cache (one-by-one path), holding at least ``start`` tokens."""
    slot: int | None = None
    """The branch's pool slot, holding at least ``start`` positions (if it has one)."""
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

    def finish(
        self, rewards: Sequence[float] = (), *, cache: Any = None, keep: bool = True
    ) -> None:
        """Record the rewards read at ``new_positions`` and the entry to keep: the
        row's ``slot``, or ``cache`` (``keep=False``: keep none)."""
        fresh = [p for p in self.positions if p >= self.start]
        self.rewards.update(zip(fresh, rewards, strict=True))
        if keep:
            self.done = BranchCache(cache, self.ids, self.rewards, self.slot)


def split_runs(values: Sequence[float], counts: Sequence[int]) -> list[list[float]]:
    """``values`` cut into consecutive runs of ``counts``."""
    out, at = [], 0
    for n in counts:
        out.append(list(values[at : at + n]))
        at += n
    return out


class IncrementalRows:
    """Planning and batching rows over branch caches (a mixin of ``TransformersPRM``,
    which sets the attributes below and defines ``_forward``)."""

    batch_size: int
    max_cached_branches: int | None
    device: Any
    _caches: OrderedDict[BranchId, BranchCache]
    _pool: KVPool
    _cache_api: CacheAPI
    _empty_cache: Any
    _merging: bool
    _merge_pasts: bool
    _state_key: str | None
    _forward: Callable[..., tuple[Any, Any, list[int]]]
    """The PRM's forward over rows (``TransformersPRM._forward``): its output, the
    (bad, good) logits of every row's rating positions, and how many each row has."""

    @property
    def _pooled(self) -> bool:
        """Whether branches keep their KV in the pool (else in caches of their own)."""
        return self._merging and self.batch_size > 1

    def _plan(self, branch: BranchId, enc: Encoded) -> Row:
        """The branch's row: its entry taken out (put back only once scored: a failed
        forward may leave its cache half-updated) and the longest prefix of the input
        it holds."""
        ids, positions = enc.ids(), enc.positions()
        entry = self._caches.pop(branch, None)
        if entry is None:
            return Row(branch, ids, positions)
        start = _common_prefix(entry.ids, ids)
        # A rating position inside the common prefix must have its reward already.
        start = min([start, *(p for p in positions if p < start and p not in entry.rewards)])
        if start == 0:  # nothing to reuse; a slot is kept for the branch's new positions
            return Row(branch, ids, positions, slot=entry.slot)
        known = {p: r for p, r in entry.rewards.items() if p < start}
        return Row(branch, ids, positions, start, entry.cache, entry.slot, known)

    def _run(self, rows: Sequence[Row]) -> None:
        """Score the rows: the new tokens of up to ``batch_size`` of them per forward."""
        pending = []
        for row in rows:
            if row.start < len(row.ids):
                pending.append(row)
                continue
            # Nothing new (the same text, or a prefix of it): no forward.
            if row.cache is not None:
                with torch.inference_mode():  # the cache holds inference tensors
                    self._cache_api.crop(row.cache, row.start)
            row.finish(cache=row.cache)
        # Rows with and without a past are batched apart: a model's per-position
        # state need not have a neutral value for an all-padding past.
        for cached in (False, True):
            group = [row for row in pending if (row.start > 0) == cached]
            # A right pad costs a whole forward per token, a left pad only attention:
            # rows with similar numbers of new tokens go together first.
            group.sort(key=lambda row: (len(row.ids) - row.start, row.start))
            for chunk in chunks(group, self.batch_size):
                self._run_chunk(chunk)

    def _run_chunk(self, chunk: Sequence[Row]) -> None:
        if not self._pooled:
            for row in chunk:
                if row.slot is not None:  # the pool stopped during this call: start over
                    row.start, row.slot = (0 if row.cache is None else row.start), None
                self._run_one(row)
        elif self._merge_pasts or len({row.start for row in chunk}) == 1:
            self._run_pooled(chunk)
        else:  # rows share a forward only if their pasts are as long
            for start in sorted({row.start for row in chunk}):
                self._run_pooled([row for row in chunk if row.start == start])

    def _run_pooled(self, chunk: Sequence[Row]) -> None:
        """The chunk's rows in one forward over their merged past from the pool; their
        new positions back into it."""
        past = [row.start for row in chunk]
        cache = self._new_cache()
        if past[0]:  # a chunk's rows all have a past, or none has
            with torch.inference_mode():
                layers, state = self._pool.gather([row.slot for row in chunk], past, self.device)
                cache = self._filled(layers, state)
        output, two_way, counts = self._forward(
            [row.new for row in chunk],
            [row.new_positions() for row in chunk],
            cache=cache,
            past=past,
        )
        rewards = split_runs(good_probability(two_way), counts)
        parts = self._cache_parts(self._cache_api.returned(output, cache))
        if parts is None:  # a layout the pool cannot take: one by one from now on
            self._stop_pooling()
            for row, got in zip(chunk, rewards):
                row.finish(got, keep=False)
            return
        slots = []
        for row in chunk:
            if row.slot is None:
                row.slot = self._pool.allocate()
            slots.append(row.slot)
        with torch.inference_mode():
            self._pool.store(*parts, slots, past, [len(row.new) for row in chunk])
        for row, got in zip(chunk, rewards):
            row.finish(got)

    def _run_one(self, row: Row) -> None:
        """The row on its own cache, cropped in place (the one-by-one path)."""
        if row.cache is None:
            cache = self._new_cache()
        else:
            cache = row.cache
            with torch.inference_mode():
                self._cache_api.crop(cache, row.start)
        output, two_way, _ = self._forward([row.new], [row.new_positions()], cache=cache)
        row.finish(good_probability(two_way), cache=self._cache_api.returned(output, cache))

    def _stop_pooling(self) -> None:
        """The forward returned a cache whose rows cannot be read: the branches held in
        the pool are re-encoded from scratch, one by one."""
        self._merging = False
        for branch in [b for b, e in self._caches.items() if e.slot is not None]:
            del self._caches[branch]
        self._pool.clear()

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
        # copying an empty one a third of that.
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
                self._drop(self._caches.popitem(last=False)[1])

    def _forget(self, branch: BranchId) -> None:
        """Drop the branch's entry, if it has one (its pool slot back)."""
        entry = self._caches.pop(branch, None)
        if entry is not None:
            self._drop(entry)

    def _drop(self, entry: BranchCache | Row) -> None:
        if entry.slot is not None and self._pooled:  # (a stopped pool holds nothing)
            self._pool.release(entry.slot)
