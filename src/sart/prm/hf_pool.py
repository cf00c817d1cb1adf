"""The transformers PRMs' KV pool: every cached branch's keys and values in one tensor per
layer, so that a check merges and splits its rows in a fixed number of operations.

Per layer the pool holds ``[slots, positions, heads, head_dim]`` keys and values (and,
for a model that keeps per-position state on its caches, each state tensor as
``[slots, positions, ...]``); a branch owns a slot, its positions from 0. ``gather``
builds a check's merged past from the pool: each row's first ``past[r]`` positions,
right-aligned in ``max(past)`` columns, in one indexed read per tensor (a pad column
repeats one of the row's own positions: masked, and never NaN). ``store`` writes each
row's new positions from the cache a forward returned into the row's slot, in one
indexed write per tensor. Neither depends on the number of rows: on a GPU each
operation is a kernel launch, and merging and splitting per row made a 32-branch
check issue about 500 operations per branch.

The pool grows by doubling, in slots and in positions (a copy of the pool then), up to
what the branches cached at once and the longest of them need: it holds
``slots x positions`` keys and values whatever each branch's own length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(keys, values)``, ``[rows, heads, positions, head_dim]``."""


class KVPool:
    """Slots of keys, values and per-position state (see the module docstring)."""

    def __init__(self) -> None:
        self._layers: Layers = []  # per layer [slots, positions, heads, head_dim]
        self._state: dict[str, torch.Tensor] = {}  # per name [slots, positions, ...]
        self._free: list[int] = []
        self._slots = 0  # slots handed out so far (the free ones included)

    @property
    def capacity(self) -> tuple[int, int]:
        """``(slots, positions)`` the pool's tensors hold now."""
        if not self._layers:
            return 0, 0
        keys = self._layers[0][0]
        return keys.shape[0], keys.shape[1]

    @property
    def in_use(self) -> int:
        """Slots handed out and not released."""
        return self._slots - len(self._free)

    def allocate(self) -> int:
        """A free slot (its positions are overwritten by the branch's first ``store``)."""
        if self._free:
            return self._free.pop()
        self._slots += 1
        return self._slots - 1

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def clear(self) -> None:
        """Drop every slot and the tensors (their memory back)."""
        self.__init__()  # type: ignore[misc]

    def gather(
        self, slots: Sequence[int | None], past: Sequence[int], device: torch.device
    ) -> tuple[Layers, dict[str, torch.Tensor]]:
        """The merged past of rows ``slots``: row ``r``'s first ``past[r]`` positions
        right-aligned in ``max(past)`` columns (every ``past[r] >= 1``)."""
        width = max(past)
        index = _Index(
            [[s] for s in slots], [[0] * (width - n) + list(range(n)) for n in past], device
        )
        layers = [
            (k[index.on(k)].transpose(1, 2), v[index.on(v)].transpose(1, 2))
            for k, v in self._layers
        ]
        state = {name: t[index.on(t)] for name, t in self._state.items()}
        return layers, state

    def store(
        self,
        layers: Layers,
        state: dict[str, torch.Tensor],
        slots: Sequence[int],
        past: Sequence[int],
        new: Sequence[int],
    ) -> None:
        """Write row ``r``'s ``new[r]`` positions of a forward's merged cache (``layers``,
        ``state``: the past's ``max(past)`` columns, then the new tokens, right-padded)
        into slot ``slots[r]`` from position ``past[r]`` on."""
        held = max(past)
        src_rows: list[int] = []
        src_cols: list[int] = []
        dst_slots: list[int] = []
        dst_cols: list[int] = []
        for row, (slot, start, count) in enumerate(zip(slots, past, new)):
            src_rows += [row] * count
            src_cols += range(held, held + count)
            dst_slots += [slot] * count
            dst_cols += range(start, start + count)
        if not dst_cols:
            return
        self._reserve(layers, state, max(slots) + 1, max(dst_cols) + 1)
        device = layers[0][0].device
        at = _Index(dst_slots, dst_cols, device)
        source = _Index(src_rows, src_cols, device)
        for (keys, values), (k, v) in zip(self._layers, layers):
            keys[at.on(keys)] = k.transpose(1, 2)[source.on(k)]
            values[at.on(values)] = v.transpose(1, 2)[source.on(v)]
        for name, t in self._state.items():
            t[at.on(t)] = state[name][source.on(t)]

    def _reserve(
        self, layers: Layers, state: dict[str, torch.Tensor], slots: int, positions: int
    ) -> None:
        """Grow the tensors (doubling) to hold ``slots`` slots of ``positions``; the
        first store makes them, shaped and placed as ``layers`` and ``state``."""
        have_slots, have_positions = self.capacity
        if self._layers and slots <= have_slots and positions <= have_positions:
            return
        # Each dimension doubles only when it must grow (a longer branch is no reason
        # for more slots).
        size = (
            have_slots if slots <= have_slots else max(slots, 2 * have_slots),
            have_positions if positions <= have_positions else max(positions, 2 * have_positions),
        )

        def grown(
            old: torch.Tensor | None, like: torch.Tensor, tail: tuple[int, ...]
        ) -> torch.Tensor:
            # Zeros: a gathered pad column is a real position, but a slot's unwritten
            # positions must not hold garbage that a bug could read as NaN.
            out = like.new_zeros((*size, *tail))
            if old is not None:
                out[: old.shape[0], : old.shape[1]] = old
            return out

        old_layers = self._layers or [(None, None)] * len(layers)  # type: ignore[list-item]
        self._layers = [
            (
                grown(ok, k, (k.shape[1], k.shape[3])),
                grown(ov, v, (v.shape[1], v.shape[3])),
            )
            for (ok, ov), (k, v) in zip(old_layers, layers)
        ]
        self._state = {
            name: grown(self._state.get(name), t, tuple(t.shape[2:])) for name, t in state.items()
        }


class _Index:
    """A (rows, columns) index, uploaded once per device it is used on (a model spread
    over several devices keeps each layer's tensors where the layer is)."""

    def __init__(self, rows: list, cols: list, device: torch.device) -> None:
        self._lists = (rows, cols)
        self._by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.on_device(device)

    def on_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._by_device:
            rows, cols = self._lists
            self._by_device[device] = (
                torch.tensor(rows, dtype=torch.long, device=device),
                torch.tensor(cols, dtype=torch.long, device=device),
            )
        return self._by_device[device]

    def on(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The index where ``tensor`` is."""
        return self.on_device(tensor.device)


__all__ = ["KVPool", "Layers"]
