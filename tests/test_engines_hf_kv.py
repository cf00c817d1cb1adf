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
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sart.engines.hf import HFEngine  # noqa: E402
from sart.engines.hf_kv import (  # noqa: E402
    Span,
    StepBatch,
    StepBatches,
    batch,
    fill,
    groups,
    split_cost,
)
from sart.messages import BranchSpec  # noqa: E402
from sart.types import BranchId, SamplingSettings  # noqa: E402

HEADS, DIM, LAYERS = 2, 3, 2


def _tensor(rows: list[list[float]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV of ``rows`` (each a row's positions) for every layer: keys ``value + layer``,
    values their negation."""
    grid = torch.tensor(rows)
    keys = grid[:, None, :, None].expand(len(rows), HEADS, grid.shape[1], DIM)
    return [(keys + layer, -(keys + layer)) for layer in range(LAYERS)]


def _row(pairs: list, row: int, width: int, layer: int = 0) -> list[float]:
    keys, values = pairs[layer]
    assert torch.equal(values[row, :, :width], -keys[row, :, :width])
    return (keys[row, 0, :width, 0] - layer).tolist()


def test_a_batch_right_aligns_each_span_from_every_tensor_they_are_in() -> None:
    prompt = _tensor([[1.0, 2.0]])  # a new request's prompt: two branches start from it
    step = _tensor([[5.0, 6.0, 7.0, 8.0, 0.0], [0.0, 3.0, 4.0, 9.0, 0.0]])  # a last batch
    spans = [
        Span(step, 1, 1, 4),  # a row of the last batch, one column in
        Span(prompt, 0, 0, 2),
        Span(step, 0, 0, 4),
        Span(prompt, 0, 0, 2),
    ]
    pairs = batch(spans, width=4, spare=2)
    assert pairs[0][0].shape == (4, HEADS, 4 + 1 + 2, DIM)
    # Pads (masked) repeat the row's first position: finite, never garbage.
    assert [_row(pairs, r, 4) for r in range(4)] == [
        [3.0, 3.0, 4.0, 9.0],
        [1.0, 1.0, 1.0, 2.0],
        [5.0, 6.0, 7.0, 8.0],
        [1.0, 1.0, 1.0, 2.0],
    ]
    assert _row(pairs, 2, 4, layer=1) == [5.0, 6.0, 7.0, 8.0]


def test_a_batchs_work_does_not_grow_with_its_rows() -> None:
    # One read and one write per layer and tensor for each tensor the spans are in.
    from torch.profiler import ProfilerActivity, profile

    def ops(rows: int) -> int:
        step = _tensor([[float(c) for c in range(40)] for _ in range(rows)])
        spans = [Span(step, r, r % 7, 30 + r % 9) for r in range(rows)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            batch(spans, width=40, spare=4)
        return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))

    assert ops(32) == ops(4)


def test_a_forks_span_is_its_parents_positions_and_grows_apart() -> None:
    step = _tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 6.0, 7.0]])
    span = Span(step, 1, 1, 3)
    fork = span.copy()
    fork.end += 1  # the fork's next position, written after its parent's
    assert (span.length, fork.length) == (2, 3) and fork.pairs is span.pairs
    pairs = batch([span, fork], width=3)
    assert [_row(pairs, 0, 3), _row(pairs, 1, 3)] == [[5.0, 5.0, 6.0], [5.0, 6.0, 7.0]]


def test_a_batch_rebuilt_in_the_tensor_its_spans_are_in_reads_before_it_writes() -> None:
    # The CUDA-graph path keeps one buffer (hf_graphs) and rebuilds rows in it: row 0
    # is written from a prompt while row 1 must still read what row 0 held.
    prompt = _tensor([[1.0, 2.0]])
    step = [(k.clone(), v.clone()) for k, v in _tensor([[5.0, 6.0, 7.0, 8.0, 0.0], [0.0] * 5])]
    fill(step, [Span(prompt, 0, 0, 2), Span(step, 0, 0, 4)], width=4)
    assert [_row(step, 0, 4), _row(step, 1, 4)] == [[1.0, 1.0, 1.0, 2.0], [5.0, 6.0, 7.0, 8.0]]
    assert _row(step, 1, 4, layer=1) == [5.0, 6.0, 7.0, 8.0]


def test_the_step_batch_is_reused_only_for_the_same_rows_one_longer() -> None:
    kept = StepBatch()
    prompt = _tensor([[1.0, 2.0]])
    first = kept.get(("a",), [Span(prompt, 0, 0, 2)], width=2)
    assert first[0][0].shape[2] == 3  # two positions and the free one
    first[0][0][:, :, -1:] = 9.0  # what the forward writes
    grown = [Span(kept.pairs, 0, 0, 3)]
    again = kept.get(("a",), grown, width=3)
    assert again[0][0].data_ptr() == first[0][0].data_ptr()  # the same storage
    assert again[0][0][0, 0, :3, 0].tolist() == [1.0, 2.0, 9.0]
    other = kept.get(("b",), grown, width=4)  # other rows: rebuilt
    assert other[0][0].data_ptr() != first[0][0].data_ptr()
    assert other[0][0][0, 0, :4, 0].tolist() == [1.0, 1.0, 2.0, 9.0]
    kept.clear()
    assert kept.get(("b",), grown, width=5)[0][0].data_ptr() != other[0][0].data_ptr()


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
    model: object,
    tokenizer: object,
    in_place: bool,
    cost: int | None = None,
    setup: Callable[[HFEngine], None] | None = None,
) -> dict[BranchId, tuple]:
    """A mix that changes the live branches often: prompts of different lengths, a
    fork, an abort, a pause and resume, a request arriving mid-way. Returns each
    branch's tokens and log-probabilities (and, under ``FORWARDS``, the forwards).
    ``setup`` changes the engine before it serves (``test_engines_hf_graphs.py``)."""
    engine = HFEngine(model, tokenizer)
    engine.in_place = in_place
    engine.split_cost = cost
    if setup is not None:
        setup(engine)
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

    def counted(run: Callable[[], object]) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))

    def ops(branches: int) -> tuple[float, int]:
        questions = make_questions(1, branches // 8, LONG.difficulties, cycle=LONG.cycle)
        ids = [f"{branches}-{i}" for i in range(len(questions))]
        for rid, q in zip(ids, questions):
            engine.prefill(rid, q.prompt, settings)
            engine.start_branches(rid, [BranchSpec(i, seed=i) for i in range(8)])
        engine.step(3)  # past the first steps, which build the batch
        steady = counted(lambda: engine.step(4)) / 4
        engine.abort([BranchId(ids[0], 0)])  # the next step rebuilds the batch
        rebuild = counted(lambda: engine.step(1))
        for rid in ids:
            engine.release_prefix(rid)
        return steady, rebuild

    (few, few_rebuild), (many, many_rebuild) = ops(8), ops(32)
    assert many <= 1200, many
    assert (many - few) / 24 <= 3, (few, many)
    assert (many_rebuild - few_rebuild) / 24 <= 3, (few_rebuild, many_rebuild)
