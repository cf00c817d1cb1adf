"""The transformers engine's KV storage (``sart.engines.hf_kv``) and its fast decode path.

Buffers that grow, a fork's copy on write, the left-padded batch, the step batch
kept between steps, the split of a step's rows by length; and the engine's
in-place decoding against transformers' own cache, and its split batches against
one batch: the same tokens and log-probabilities on a mix of requests, forks,
aborts and pauses (``test_engines_scenarios.py`` runs the shared scenarios on it
too).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sart.engines.hf import HFEngine  # noqa: E402
from sart.engines.hf_kv import (  # noqa: E402
    OwnKV,
    StepBatch,
    StepBatches,
    batch,
    empty,
    groups,
    split_cost,
)
from sart.messages import BranchSpec  # noqa: E402
from sart.types import BranchId, SamplingSettings  # noqa: E402

HEADS, DIM, LAYERS = 2, 3, 2


def _token(value: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One position's KV for every layer: keys ``value + layer``, values ``-(value + layer)``."""
    return [
        (
            torch.full((1, HEADS, 1, DIM), value + layer),
            torch.full((1, HEADS, 1, DIM), -(value + layer)),
        )
        for layer in range(LAYERS)
    ]


def _values(own: OwnKV, layer: int = 0) -> list[float]:
    keys, values = own.layer(layer)
    assert torch.equal(values, -keys)
    return keys[0, 0, :, 0].tolist()


def test_appends_past_the_capacity_keep_every_position() -> None:
    own = empty(_token(0), limit=1000)
    for t in range(1, 40):  # past the first buffer (16) and a doubling (32)
        own.append(_token(t))
    assert own.count == 40 and own.capacity >= 40
    assert _values(own) == [float(t) for t in range(40)]
    assert _values(own, layer=1) == [float(t + 1) for t in range(40)]


def test_a_buffer_never_grows_past_the_limit() -> None:
    own = empty(_token(0), limit=20)
    for t in range(1, 17):
        own.append(_token(t))
    assert own.count == 17 and own.capacity == 20  # doubling 16 would give 32


def test_a_fork_reads_its_parents_positions_and_writes_its_own() -> None:
    parent = empty(_token(0), limit=100)
    for t in range(1, 5):
        parent.append(_token(t))
    child = parent.fork()
    assert child.pairs is parent.pairs  # borrowed: nothing copied at the fork
    parent.append(_token(100))  # past what the child reads
    child.append(_token(200))  # copies before writing
    assert child.pairs is not parent.pairs
    assert _values(parent) == [0.0, 1.0, 2.0, 3.0, 4.0, 100.0]
    assert _values(child) == [0.0, 1.0, 2.0, 3.0, 4.0, 200.0]


def _step_batch(rows: int, columns: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step batch whose position ``c`` of row ``r`` holds ``100 r + c`` (layer 0)."""
    grid = (100 * torch.arange(rows)[:, None] + torch.arange(columns)[None, :]).float()
    keys = grid[:, None, :, None].expand(rows, HEADS, columns, DIM)
    return [(keys + layer, -(keys + layer)) for layer in range(LAYERS)]


def test_positions_held_in_a_step_batch_are_copied_only_when_read() -> None:
    step = _step_batch(rows=3, columns=40)
    own = empty(_token(0), limit=100)
    before = [k.clone() for k, _ in own.pairs]
    for column in range(5, 30):  # 25 decode steps in row 1: nothing written meanwhile
        own.hold(step, row=1, column=column)
    assert own.count == 26 and own.stored == 1
    assert all(torch.equal(k, b) for (k, _), b in zip(own.pairs, before))
    assert _values(own) == [0.0, *[100.0 + c for c in range(5, 30)]]  # read: copied
    assert _values(own, layer=1) == [1.0, *[101.0 + c for c in range(5, 30)]]
    assert own.stored == 26


def test_a_position_in_another_batch_or_row_copies_those_held_before() -> None:
    first, second = _step_batch(rows=2, columns=10), _step_batch(rows=2, columns=10)
    own = OwnKV.in_batch(first, row=0, column=3, limit=50)
    own.hold(first, row=0, column=4)
    own.hold(second, row=1, column=7)  # a rebuilt batch: the held two are copied first
    assert own.stored == 2 and own.count == 3
    own.hold(second, row=1, column=9)  # not next to column 7: 7 is copied first
    assert _values(own) == [3.0, 4.0, 107.0, 109.0]


def test_a_fork_of_a_branch_with_held_positions_reads_them_all() -> None:
    step = _step_batch(rows=1, columns=10)
    parent = empty(_token(0), limit=100)
    for column in (1, 2, 3):
        parent.hold(step, row=0, column=column)
    child = parent.fork()  # copies what the parent holds, then borrows its buffers
    assert child.pairs is parent.pairs and child.count == 4
    parent.hold(step, row=0, column=4)
    child.append(_token(200))
    assert _values(parent) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert _values(child) == [0.0, 1.0, 2.0, 3.0, 200.0]


def test_own_kv_of_a_forwards_cache_keeps_its_last_positions() -> None:
    pairs = [(torch.arange(7.0).repeat(1, HEADS, 1)[..., None].expand(1, HEADS, 7, DIM),) * 2]
    pairs = [(k, -k) for k, _ in pairs]  # 7 positions: 3 of the prompt, 4 generated
    own = OwnKV.of(pairs, 4, limit=50)
    assert _values(own) == [3.0, 4.0, 5.0, 6.0]
    assert own.pairs[0][0].data_ptr() != pairs[0][0].data_ptr()  # not a view of the prompt


def _prompt(values: list[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (
            torch.tensor(values).view(1, 1, -1, 1).expand(1, HEADS, -1, DIM).clone(),
            -torch.tensor(values).view(1, 1, -1, 1).expand(1, HEADS, -1, DIM).clone(),
        )
        for _ in range(LAYERS)
    ]


def test_a_batch_left_pads_with_zeros_then_the_prompt_then_the_branch() -> None:
    own = empty(_token(7), limit=10)
    rows = [(_prompt([1.0, 2.0]), own), (_prompt([3.0, 4.0, 5.0, 6.0]), None)]
    (keys, values), _ = batch(rows, width=4, spare=2)
    assert keys.shape == (2, HEADS, 4 + 1 + 2, DIM)
    assert keys[0, 0, :4, 0].tolist() == [0.0, 1.0, 2.0, 7.0]
    assert keys[1, 0, :4, 0].tolist() == [3.0, 4.0, 5.0, 6.0]
    assert torch.equal(values[:, :, :4], -keys[:, :, :4])


def test_the_step_batch_is_reused_only_for_the_same_rows_one_longer() -> None:
    kept = StepBatch()
    rows = [(_prompt([1.0, 2.0]), None)]
    first = kept.get(("a",), rows, width=2)
    assert first[0][0].shape[2] == 3  # two positions and the free one
    first[0][0][:, :, -1:] = 9.0  # what the forward writes
    rows = [(_prompt([1.0, 2.0]), empty(_token(9), limit=10))]
    again = kept.get(("a",), rows, width=3)
    assert again[0][0].data_ptr() == first[0][0].data_ptr()  # the same storage
    assert again[0][0][0, 0, :3, 0].tolist() == [1.0, 2.0, 9.0]
    other = kept.get(("b",), rows, width=4)  # other rows: rebuilt
    assert other[0][0].data_ptr() != first[0][0].data_ptr()
    kept.clear()
    assert kept.get(("b",), rows, width=5)[0][0].data_ptr() != other[0][0].data_ptr()


def _padded(lengths: list[int], split: list[list[int]], cost: int) -> int:
    return sum(cost + len(rows) * (max(lengths[r] for r in rows) + 1) for rows in split)


def _partitions(items: list[int]) -> list[list[list[int]]]:
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    found = []
    for smaller in _partitions(rest):
        found.append([[first], *smaller])
        for i in range(len(smaller)):
            found.append([*smaller[:i], [first, *smaller[i]], *smaller[i + 1 :]])
    return found


@given(
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=6),
    cost=st.integers(0, 5000),
)
def test_the_split_by_length_is_the_cheapest_of_all_splits(lengths: list[int], cost: int) -> None:
    split = groups(lengths, cost)
    assert sorted(itertools.chain(*split)) == list(range(len(lengths)))  # each row once
    cheapest = min(_padded(lengths, p, cost) for p in _partitions(list(range(len(lengths)))))
    assert _padded(lengths, split, cost) == cheapest


def test_rows_of_very_different_lengths_are_split_and_similar_ones_are_not() -> None:
    lengths = [300] * 31 + [2048]
    assert groups(lengths, 3000) == [[31], list(range(31))]  # saves 31 x 1,748 positions
    assert groups(lengths, 60_000) == [list(range(32))]  # not worth a forward: as given
    assert len(groups([300, 310, 305, 290], 3000)) == 1
    assert groups(lengths, None) == [list(range(32))]  # None: one batch, as given


def test_step_batches_keep_the_split_while_the_same_rows_go_on() -> None:
    kept = StepBatches()
    first = kept.split(("a", "b", "c"), [10, 500, 12], cost=0)
    assert [rows for _, rows in first] == [[1], [2], [0]]
    # One longer each: the same groups and step batches, though lengths now say other.
    again = kept.split(("a", "b", "c"), [11, 501, 11], cost=0)
    assert [(b, rows) for b, rows in again] == [(b, rows) for b, rows in first]
    other = kept.split(("a", "c"), [12, 12], cost=0)  # other rows: split anew
    assert [rows for _, rows in other] == [[0, 1]]
    assert other[0][0] is first[0][0]  # a step batch rebuilds itself on other keys
    kept.clear()
    assert [rows for _, rows in kept.split(("a", "b", "c"), [11, 501, 11], 0)] == [
        [1],
        [0, 2],
    ]


def test_the_split_cost_is_estimated_from_the_model_and_off_on_accelerators() -> None:
    from transformers import AutoConfig

    from sart.testbed import LONG

    config = AutoConfig.from_pretrained(str(LONG.policy_path))
    estimate = split_cost(config, torch.device("cpu"), torch.float32)
    assert estimate is not None and 2000 < estimate < 4000  # measured here: about 3,000
    bigger = AutoConfig.for_model(
        "qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    )
    assert split_cost(bigger, torch.device("cpu"), torch.float32) > 20 * estimate
    assert split_cost(config, torch.device("meta"), torch.float32) is None


# ---------------------------------------------------------- the engine's paths


@pytest.fixture(scope="module")
def model_and_tokenizer(demo_models: dict[str, Path]) -> tuple[object, object]:
    loaded = HFEngine.from_pretrained(str(demo_models["policy"]), dtype=torch.float32)
    return loaded.model, loaded.tokenizer


def _serve(
    model: object, tokenizer: object, in_place: bool, cost: int | None = None
) -> dict[BranchId, tuple]:
    """A mix that changes the live branches often: prompts of different lengths, a
    fork, an abort, a pause and resume, a request arriving mid-way. Returns each
    branch's tokens and log-probabilities (and, under ``FORWARDS``, the forwards)."""
    engine = HFEngine(model, tokenizer)
    engine.in_place = in_place
    engine.split_cost = cost
    forward = engine._forward
    forwards = [0]

    def counted(*args: object, **kwargs: object) -> object:
        forwards[0] += 1
        return forward(*args, **kwargs)

    engine._forward = counted  # type: ignore[method-assign]
    settings = SamplingSettings(temperature=1.0, max_tokens=40, logprobs=2)
    got: dict[BranchId, tuple[list[int], list[float], list[str]]] = {}

    def run(steps: int) -> None:
        for bid, delta in engine.step(steps).deltas.items():
            mine = got.setdefault(bid, ([], [], []))
            mine[0].extend(delta.token_ids)
            mine[1].extend(lp.logprob for lp in delta.logprobs)
            mine[2].append(delta.text)

    engine.prefill("a", "Step 1: add 3 and 4.", settings)
    engine.start_branches("a", [BranchSpec(index=i, seed=i) for i in range(3)])
    engine.prefill("b", "Q: 12 + 7 - 3 =", settings)
    engine.start_branches("b", [BranchSpec(index=0, seed=10), BranchSpec(index=1, seed=11)])
    run(6)
    engine.start_branches("a", [BranchSpec(index=3, seed=3, parent=0)])
    engine.abort([BranchId("b", 1)])
    run(5)
    engine.pause([BranchId("a", 1)])
    engine.prefill("c", "Step 2: check it", settings)
    engine.start_branches("c", [BranchSpec(index=0, seed=20)])
    run(4)
    engine.start_branches("a", [BranchSpec(index=1, seed=1, resume=True)])
    run(60)
    assert engine.stats().live_branches == 0
    got[FORWARDS] = (forwards[0],)
    return got


FORWARDS = BranchId("forwards", 0)


def test_in_place_decoding_gives_transformers_caches_tokens(
    model_and_tokenizer: tuple[object, object],
) -> None:
    fast = _serve(*model_and_tokenizer, in_place=True)
    reference = _serve(*model_and_tokenizer, in_place=False)
    _same_branches(fast, reference)
    # They ran: the fork past its parent's tokens, the resumed branch to its cap.
    assert len(fast[BranchId("a", 3)][0]) > 6 and len(fast[BranchId("a", 1)][0]) == 40


@pytest.mark.parametrize("in_place", [True, False])
def test_batches_split_by_length_give_one_batchs_tokens(
    model_and_tokenizer: tuple[object, object], in_place: bool
) -> None:
    split = _serve(*model_and_tokenizer, in_place=in_place, cost=0)
    one = _serve(*model_and_tokenizer, in_place=in_place, cost=None)
    assert split[FORWARDS][0] > one[FORWARDS][0] + 20  # it did split: more forwards
    _same_branches(split, one)


def _same_branches(fast: dict[BranchId, tuple], reference: dict[BranchId, tuple]) -> None:
    del fast[FORWARDS], reference[FORWARDS]
    assert fast.keys() == reference.keys() and len(fast) >= 6
    for bid in reference:
        assert fast[bid][0] == reference[bid][0], bid
        assert fast[bid][1] == pytest.approx(reference[bid][1], abs=1e-4), bid
        assert "".join(fast[bid][2]) == "".join(reference[bid][2]), bid


def test_a_decode_steps_tensor_operations_do_not_grow_with_the_branches() -> None:
    # On a GPU every operation is a kernel launch: work done per branch made a step
    # launch-bound (issue 46). Steady-state steps of the long testbed's policy, one
    # batch: the same operations at 32 branches as at 8, and no more than 1,200.
    from torch.profiler import ProfilerActivity, profile

    from sart.testbed import LONG, make_questions

    engine = HFEngine.from_pretrained(str(LONG.policy_path))
    engine.split_cost = None  # one batch whatever the lengths (as on an accelerator)
    settings = SamplingSettings(temperature=1.0, max_tokens=2048, ignore_eos=True)

    def ops(branches: int) -> float:
        questions = make_questions(1, branches // 8, LONG.difficulties, cycle=LONG.cycle)
        ids = [f"{branches}-{i}" for i in range(len(questions))]
        for rid, q in zip(ids, questions):
            engine.prefill(rid, q.prompt, settings)
            engine.start_branches(rid, [BranchSpec(i, seed=i) for i in range(8)])
        engine.step(3)  # past the first steps, which build the batch
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step(4)
        for rid in ids:
            engine.release_prefix(rid)
        return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / 4

    few, many = ops(8), ops(32)
    assert many <= 1200, many
    assert (many - few) / 24 <= 3, (few, many)
