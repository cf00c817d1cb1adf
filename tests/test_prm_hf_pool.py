"""The transformers PRMs' KV pool (``sart.prm.hf_pool``): slots written from a merged
cache, read back right-aligned, grown without losing what they hold."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sart.prm.hf_pool import KVPool  # noqa: E402

HEADS, DIM = 2, 3
CPU = torch.device("cpu")


def merged(values: list[list[float]]) -> tuple[list, dict]:
    """A forward's merged cache of two layers: keys ``value + layer``, values their
    negation; a state tensor ``[rows, positions, 1]`` equal to the value."""
    grid = torch.tensor(values)
    keys = grid[:, None, :, None].expand(len(values), HEADS, grid.shape[1], DIM)
    layers = [(keys + layer, -(keys + layer)) for layer in range(2)]
    return layers, {"seen": grid[:, :, None].clone()}


def row_of(layers: list, state: dict, row: int) -> list[float]:
    keys, values = layers[0]
    assert torch.equal(values, -keys) and torch.equal(layers[1][0], keys + 1)
    assert torch.equal(state["seen"][row, :, 0], keys[row, 0, :, 0])
    return keys[row, 0, :, 0].tolist()


def test_rows_written_from_a_merged_cache_are_read_back_right_aligned() -> None:
    pool = KVPool()
    a, b = pool.allocate(), pool.allocate()
    # A first forward of two fresh rows: 3 and 2 new tokens (row 1 right-padded).
    pool.store(*merged([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]]), [a, b], [0, 0], [3, 2])
    layers, state = pool.gather([b, a], [2, 3], CPU)
    assert layers[0][0].shape == (2, HEADS, 3, DIM)
    assert row_of(layers, state, 1) == [1.0, 2.0, 3.0]
    assert row_of(layers, state, 0)[1:] == [4.0, 5.0]  # column 0 is a (masked) pad
    # The next forward: their past (3 columns) then 1 and 2 new tokens each.
    pool.store(
        *merged([[0.0, 4.0, 5.0, 6.0, 0.0], [1.0, 2.0, 3.0, 7.0, 8.0]]), [b, a], [2, 3], [1, 2]
    )
    layers, state = pool.gather([a, b], [5, 3], CPU)
    assert row_of(layers, state, 0) == [1.0, 2.0, 3.0, 7.0, 8.0]
    assert row_of(layers, state, 1)[2:] == [4.0, 5.0, 6.0]
    # A shorter past reads a prefix (the branch's text was cut back).
    layers, state = pool.gather([a], [2], CPU)
    assert row_of(layers, state, 0) == [1.0, 2.0]


def test_growing_keeps_every_slot_and_released_slots_are_reused() -> None:
    pool = KVPool()
    slots = [pool.allocate() for _ in range(3)]
    pool.store(*merged([[float(s)] for s in slots]), slots, [0, 0, 0], [1, 1, 1])
    small = pool.capacity
    more = [pool.allocate() for _ in range(5)]  # past the slots the tensors hold
    long = [[float(10 + i) for i in range(40)] for _ in more]  # past their positions
    pool.store(*merged(long), more, [0] * 5, [40] * 5)
    assert pool.capacity[0] > small[0] and pool.capacity[1] >= 40
    layers, state = pool.gather(slots, [1, 1, 1], CPU)
    assert [row_of(layers, state, r) for r in range(3)] == [[0.0], [1.0], [2.0]]
    pool.release(slots[1])
    assert pool.allocate() == slots[1]
    pool.clear()
    assert pool.capacity == (0, 0) and pool.allocate() == 0


def test_longer_branches_grow_positions_not_slots() -> None:
    pool = KVPool()
    slots = [pool.allocate() for _ in range(4)]
    pool.store(*merged([[1.0]] * 4), slots, [0] * 4, [1] * 4)
    for length in (10, 30, 90):  # the same four branches, longer each check
        rows = [[float(i) for i in range(length)]] * 4
        pool.store(*merged(rows), slots, [0] * 4, [length] * 4)
        assert pool.capacity[0] == 4 and pool.capacity[1] >= length
