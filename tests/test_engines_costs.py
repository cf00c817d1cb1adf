"""The accelerator cost model (``sart.engines.costs``): roofline decode and prefill times.

Numbers are checked two ways: against literal values worked out by hand from
the datasheet figures in the module docstring, and against a naive per-step
reference that prices every decode step separately with its own live set,
which is what ``CostModel.decode_time``'s segment-wise sum must equal in the
memory-bound regime the presets are in at small batch sizes.

Convention (from ``decode_time``'s docstring): branch ``i`` starts the call
with ``contexts[i]`` tokens of KV, and the ``s``-th step of the call reads
``contexts[i] + s`` tokens for it (the token being decoded attends to
itself), for ``s = 1 .. active_steps[i]``.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sart.engines.costs import (
    H100,
    H200,
    LLAMA_70B,
    PRESETS,
    QWEN_14B,
    STEPS,
    CostModel,
    compute_bound,
    cost_model,
    serving,
)
from sart.errors import ConfigError, UnknownComponentError

REAL_PRESETS = ("h100-14b", "h200-14b", "8xh100-70b")


def reference_decode_time(cost: CostModel, contexts: list[int], active: list[int]) -> float:
    """Price each step on its own: the live set and the KV read of that step only."""
    total = 0.0
    for s in range(1, max(active, default=0) + 1):
        live = [i for i, a in enumerate(active) if a >= s]
        kv_tokens = sum(contexts[i] + s for i in live)
        memory = (cost.weight_bytes + kv_tokens * cost.kv_bytes_per_token) / cost.bandwidth
        compute = 2.0 * cost.params * len(live) / cost.flops
        total += cost.step_overhead + max(memory, compute)
    return total


def is_memory_bound(cost: CostModel, live: int) -> bool:
    """Whether every step with at most ``live`` branches is memory-bound (where the
    segment mean of ``decode_time`` is exact): reading the weights alone takes
    longer than the FLOPs."""
    return cost.weight_bytes / cost.bandwidth > 2.0 * cost.params * live / cost.flops


# ------------------------------------------------------------------ the steps model


@given(st.lists(st.tuples(st.integers(0, 100_000), st.integers(0, 500)), min_size=0, max_size=12))
def test_steps_model_prices_a_decode_step_at_one(pairs: list[tuple[int, int]]) -> None:
    contexts = [c for c, _ in pairs]
    active = [a for _, a in pairs]
    assert STEPS.decode_time(contexts, active) == float(max(active, default=0))


def test_steps_model_prefill_is_free_and_it_has_no_capacity() -> None:
    assert cost_model("steps") is STEPS
    assert STEPS.prefill_time(1) == 0.0
    assert STEPS.prefill_time(100_000) == 0.0
    assert STEPS.kv_capacity_tokens is None
    assert STEPS.decode_time([5, 7], [3, 9]) == 9.0


# ------------------------------------------------------------- hand-computed numbers


def test_h100_14b_parameters_from_the_datasheet() -> None:
    cost = PRESETS["h100-14b"]
    assert cost.weight_bytes == pytest.approx(14.8e9 * 2)
    # K and V x 48 layers x 8 KV heads x 128 dims x 2 bytes.
    assert cost.kv_bytes_per_token == 2 * 48 * 8 * 128 * 2 == 196_608
    assert cost.bandwidth == pytest.approx(3.35e12 * 0.75)
    assert cost.flops == pytest.approx(989e12 * 0.5)
    assert cost.step_overhead == pytest.approx(1e-3)  # no all-reduce at tp=1
    # (80 GB x 0.9 - 29.6 GB of weights) / 196,608 bytes = 215,657.55 tokens.
    assert cost.kv_capacity_tokens == 215_657


def test_tensor_parallel_overhead_adds_two_all_reduces_per_layer() -> None:
    cost = PRESETS["8xh100-70b"]
    assert cost.step_overhead == pytest.approx(1e-3 + 2 * 80 * 8e-6)  # 2.28 ms
    assert cost.bandwidth == pytest.approx(8 * 3.35e12 * 0.75)
    assert cost.flops == pytest.approx(8 * 989e12 * 0.5)
    # (8 x 80 GB x 0.9 - 141.2 GB) / (2 x 80 x 8 x 128 x 2 bytes) = 1,326,904.3 tokens.
    assert cost.kv_capacity_tokens == 1_326_904


def test_one_branch_one_step_by_hand() -> None:
    cost = PRESETS["h100-14b"]
    ctx = 1000
    # The step reads the weights and ctx + 1 tokens of KV (the new token included).
    memory = (29.6e9 + (ctx + 1) * 196_608) / 2.5125e12  # 11.859 ms
    compute = 2 * 14.8e9 / 494.5e12  # 0.0599 ms: memory-bound
    assert memory > compute
    assert cost.decode_time([ctx], [1]) == pytest.approx(1e-3 + memory, rel=1e-12)
    assert cost.decode_time([ctx], [1]) == pytest.approx(0.012859, rel=1e-4)


@given(
    fixed=st.floats(0, 0.1),
    per_row=st.floats(1e-6, 0.01),
    contexts=st.lists(st.integers(0, 30_000), min_size=1, max_size=64),
)
def test_compute_bound_prices_a_step_as_fixed_plus_per_row(
    fixed: float, per_row: float, contexts: list[int]
) -> None:
    cost = compute_bound("cpu", fixed, per_row)
    rows = len(contexts)
    assert cost.decode_time(contexts, [1] * rows) == pytest.approx(fixed + per_row * rows)
    assert cost.kv_capacity_tokens is None


def test_compute_bound_names_a_bad_field() -> None:
    with pytest.raises(ConfigError, match="per_row=0 must be > 0"):
        compute_bound("cpu", 1e-3, 0)
    with pytest.raises(ConfigError, match="fixed=-1 must be >= 0"):
        compute_bound("cpu", -1, 1e-3)


@pytest.mark.parametrize("name", REAL_PRESETS)
@pytest.mark.parametrize("ctx", [0, 1, 4096, 30_000])
def test_one_branch_one_step_follows_the_roofline(name: str, ctx: int) -> None:
    cost = PRESETS[name]
    expected = cost.step_overhead + max(
        (cost.weight_bytes + (ctx + 1) * cost.kv_bytes_per_token) / cost.bandwidth,
        2 * cost.params / cost.flops,
    )
    assert cost.decode_time([ctx], [1]) == pytest.approx(expected, rel=1e-12)


def test_a_large_batch_is_compute_bound() -> None:
    cost = PRESETS["h100-14b"]
    live = 2000
    # Memory: (29.6 GB + 2000 x 196,608 B) / 2.5125 TB/s = 11.94 ms;
    # compute: 2 x 14.8e9 x 2000 / 494.5e12 = 119.7 ms.
    compute = 2 * 14.8e9 * live / 494.5e12
    assert cost.decode_time([0] * live, [1] * live) == pytest.approx(1e-3 + compute, rel=1e-12)


def test_prefill_is_compute_time_plus_overhead() -> None:
    cost = PRESETS["h100-14b"]
    # 2 x 14.8e9 x 300 / 494.5e12 = 17.96 ms.
    assert cost.prefill_time(300) == pytest.approx(1e-3 + 2 * 14.8e9 * 300 / 494.5e12, rel=1e-12)
    assert cost.prefill_time(600) > cost.prefill_time(300)


def test_ended_branches_leave_the_live_set_by_hand() -> None:
    cost = PRESETS["h200-14b"]
    # Branch a (ctx 100) lives 1 step, branch b (ctx 300) lives 2 steps.
    step1 = (cost.weight_bytes + (101 + 301) * cost.kv_bytes_per_token) / cost.bandwidth
    step2 = (cost.weight_bytes + 302 * cost.kv_bytes_per_token) / cost.bandwidth
    expected = 2 * cost.step_overhead + step1 + step2
    assert cost.decode_time([100, 300], [1, 2]) == pytest.approx(expected, rel=1e-12)
    # A branch that is not live for any step costs nothing.
    assert cost.decode_time([100, 300, 5000], [1, 2, 0]) == pytest.approx(expected, rel=1e-12)


# -------------------------------------------------- the segment sum against a reference

contexts_and_steps = st.lists(
    st.tuples(st.integers(0, 20_000), st.integers(0, 60)), min_size=1, max_size=8
)


@settings(max_examples=200)
@given(st.sampled_from(REAL_PRESETS), contexts_and_steps)
def test_decode_time_equals_the_per_step_sum(name: str, pairs: list[tuple[int, int]]) -> None:
    cost = PRESETS[name]
    contexts = [c for c, _ in pairs]
    active = [a for _, a in pairs]
    assert is_memory_bound(cost, len(contexts))  # the regime where the mean is exact
    assert cost.decode_time(contexts, active) == pytest.approx(
        reference_decode_time(cost, contexts, active), rel=1e-9, abs=1e-15
    )


def test_decode_time_grows_with_context_and_with_steps() -> None:
    cost = PRESETS["h100-14b"]
    assert cost.decode_time([10_000], [5]) > cost.decode_time([10], [5])
    assert cost.decode_time([10], [6]) > cost.decode_time([10], [5])
    assert cost.decode_time([], []) == 0.0
    assert cost.decode_time([10], [0]) == 0.0


# ------------------------------------------------------------- capacity and presets


def test_kv_capacities_are_positive_and_ordered() -> None:
    caps = {name: PRESETS[name].kv_capacity_tokens for name in REAL_PRESETS}
    assert all(isinstance(c, int) and c > 0 for c in caps.values())
    assert caps["8xh100-70b"] > caps["h200-14b"] > caps["h100-14b"]


def test_presets_are_memory_bound_at_small_batch() -> None:
    for name in REAL_PRESETS:
        cost = PRESETS[name]
        assert is_memory_bound(cost, 64), name


def test_serving_refuses_a_model_that_does_not_fit() -> None:
    # 70.6 B parameters in BF16 are 141.2 GB; one H100 holds 72 GB at 0.9 utilisation.
    with pytest.raises(ConfigError, match="tp"):
        serving("too-small", H100, LLAMA_70B, tp=1)
    # Two H100s (144 GB) hold the weights, with room for a little KV.
    two = serving("just-fits", H100, LLAMA_70B, tp=2)
    assert two.kv_capacity_tokens is not None
    assert 0 < two.kv_capacity_tokens < PRESETS["8xh100-70b"].kv_capacity_tokens
    with pytest.raises(ConfigError, match="tp=0"):
        serving("none", H200, QWEN_14B, tp=0)


def test_serving_a_bigger_group_is_faster_per_step() -> None:
    one = serving("one", H200, QWEN_14B, tp=1)
    four = serving("four", H200, QWEN_14B, tp=4)
    assert four.decode_time([1000], [1]) < one.decode_time([1000], [1])
    assert four.kv_capacity_tokens is not None and one.kv_capacity_tokens is not None
    assert four.kv_capacity_tokens > 4 * one.kv_capacity_tokens  # weights are stored once


def test_cost_model_lookup() -> None:
    custom = serving("custom", H200, QWEN_14B)
    assert cost_model(custom) is custom
    for name in PRESETS:
        assert cost_model(name) is PRESETS[name]
    with pytest.raises(UnknownComponentError) as info:
        cost_model("nope")
    message = str(info.value)
    assert "'nope'" in message
    for name in PRESETS:
        assert name in message


def test_cost_model_fields_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="bandwidth"):
        CostModel(
            name="bad",
            weight_bytes=1,
            kv_bytes_per_token=1,
            bandwidth=-1,
            flops=1,
            params=1,
            step_overhead=0,
        )


def test_reference_agrees_with_the_steps_model_shape() -> None:
    # Sanity check of the reference itself: with zero bytes and FLOPs, it counts steps.
    zero = CostModel(
        name="zero",
        weight_bytes=0,
        kv_bytes_per_token=0,
        bandwidth=1,
        flops=1,
        params=0,
        step_overhead=1.0,
    )
    assert reference_decode_time(zero, [3, 4], [2, 7]) == 7.0
    assert zero.decode_time([3, 4], [2, 7]) == 7.0
    assert math.isclose(reference_decode_time(zero, [], []), 0.0)
