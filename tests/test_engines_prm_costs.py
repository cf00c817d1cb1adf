"""The PRM cost model: hand-checked numbers, input modes, per-branch state."""

from __future__ import annotations

import pytest

import sart
from sart.engines.costs import H100, H200, QWEN_14B
from sart.engines.prm_costs import (
    QWEN_MATH_PRM_7B,
    Chunk,
    PRMCostModel,
    PRMInput,
    PRMPricer,
    prm_serving,
)
from sart.prm.base import ScoreItem
from sart.types import BranchId

PRM = prm_serving(H100)
FLOPS = 989e12 * 0.5  # H100 dense BF16 peak x the stated 50% efficiency
PER_PAIR = 4 * 28 * 28 * 128  # 4 x layers x heads x head_dim, per (token, attended token)


def item(
    index: int, tokens: int, *, prompt: int = 0, final: bool = False, request: str = "r"
) -> ScoreItem:
    return ScoreItem(BranchId(request, index), (0,) * prompt, "", tokens, final)


def test_parameters_follow_from_the_config_shape() -> None:
    hidden, layers, kv_dim, mlp, vocab = 3584, 28, 4 * 128, 18944, 152064
    attention = (
        2 * hidden * hidden + 2 * hidden * kv_dim + hidden + 2 * kv_dim
    )  # q, o; k, v; biases
    body = layers * (attention + 3 * hidden * mlp + 2 * hidden)  # + the two RMSNorms
    head = hidden * hidden + hidden + 2 * hidden + 2
    total = vocab * hidden + body + hidden + head
    assert total == pytest.approx(QWEN_MATH_PRM_7B.params, rel=1e-3)
    assert QWEN_MATH_PRM_7B.heads * QWEN_MATH_PRM_7B.head_dim == hidden
    assert QWEN_MATH_PRM_7B.context == PRM.window == 4096


def test_doubling_tokens_doubles_the_linear_part() -> None:
    assert PRM.linear_flops(1) == 2 * 7.08e9
    assert PRM.linear_flops(2000) == 2 * PRM.linear_flops(1000)
    # Attention: one token sees itself; n tokens after c cached ones see n c + n (n + 1) / 2.
    assert PRM.attention_flops(1) == PER_PAIR
    assert PRM.attention_flops(3, 10) == PER_PAIR * (30 + 6)


def test_a_full_window_by_hand() -> None:
    work = 2 * 7.08e9 * 4096 + PER_PAIR * 4096 * 4097 / 2
    assert PRM.call_time([Chunk(4096)]) == pytest.approx(0.010 + work / FLOPS)
    assert PRM.call_time([Chunk(4096)]) == pytest.approx(0.010 + 0.1173 + 0.0068, abs=1e-4)
    # One batched prefill: two inputs cost their summed work, one overhead.
    assert PRM.call_time([Chunk(4096), Chunk(4096)]) == pytest.approx(0.010 + 2 * work / FLOPS)


def test_a_small_call_costs_at_least_one_read_of_the_weights() -> None:
    read = 7.08e9 * 2 / (3.35e12 * 0.75)
    assert PRM.call_time([Chunk(1)]) == pytest.approx(0.010 + read)
    assert PRM.call_time([]) == 0.0
    assert prm_serving(H200).call_time([Chunk(1)]) < PRM.call_time([Chunk(1)])  # more bandwidth


def test_reencode_reads_each_input_whole_up_to_the_window() -> None:
    pricer = PRMPricer(PRM, "reencode")
    assert pricer([item(0, 400, prompt=300)]) == PRM.call_time([Chunk(700)])
    assert pricer([item(0, 800, prompt=300)]) == PRM.call_time([Chunk(1100)])
    assert pricer([item(0, 10_000, prompt=300)]) == PRM.call_time([Chunk(4096)])  # windowed
    assert pricer.tokens == 700 + 1100 + 4096


def test_incremental_reads_the_new_tokens_and_a_tail() -> None:
    pricer = PRMPricer(PRM, PRMInput.INCREMENTAL)
    pricer([item(0, 400, prompt=300), item(1, 400, prompt=300)])
    assert pricer.tokens == 2 * 700  # first checks: prompt and response
    # The next check feeds 400 new tokens + 8 re-encoded, attending to the 692 kept.
    assert pricer([item(0, 800, prompt=300)]) == PRM.call_time([Chunk(408, 692)])
    # A final item is fed like any other, then its branch is forgotten.
    assert pricer([item(1, 500, prompt=300, final=True)]) == PRM.call_time([Chunk(108, 692)])
    assert pricer([item(1, 600, prompt=300)]) == PRM.call_time([Chunk(900)])
    # Released requests are forgotten too.
    pricer.release("r")
    assert pricer([item(0, 1200, prompt=300)]) == PRM.call_time([Chunk(1500)])


def test_incremental_re_encodes_the_window_once_it_moves() -> None:
    pricer = PRMPricer(PRM, "incremental")
    pricer([item(0, 3600, prompt=300)])
    assert pricer([item(0, 3796, prompt=300)]) == PRM.call_time([Chunk(204, 3892)])  # fits
    assert pricer([item(0, 4000, prompt=300)]) == PRM.call_time([Chunk(4096)])  # moved


def test_cached_reads_what_the_prefix_caches_blocks_lack() -> None:
    pricer = PRMPricer(PRM, PRMInput.CACHED)  # 16-token blocks
    pricer([item(0, 405, prompt=300)])
    assert pricer.tokens == 705  # first check: all of it
    # The cache holds the previous input's full blocks: 704 of its 705 tokens.
    assert pricer([item(0, 805, prompt=300)]) == PRM.call_time([Chunk(401, 704)])
    assert pricer([item(1, 100, prompt=300, final=True)]) == PRM.call_time([Chunk(400)])
    pricer.release("r")
    assert pricer([item(0, 900, prompt=300)]) == PRM.call_time([Chunk(1200)])


def test_cached_moves_the_window_in_strides_and_reads_it_once_per_move() -> None:
    pricer = PRMPricer(PRM, "cached", stride=1024)
    pricer([item(0, 3700, prompt=300)])  # 4000 tokens: fits the 4096 context
    # 4400 tokens: the window starts at 1024 (the first stride past the context).
    assert pricer([item(0, 4100, prompt=300)]) == PRM.call_time([Chunk(3376)])
    # Until the next stride the window's start stays, and so does its cache.
    assert pricer([item(0, 4500, prompt=300)]) == PRM.call_time([Chunk(400, 3376)])
    assert pricer([item(0, 4900, prompt=300)]) == PRM.call_time([Chunk(3152)])  # moved: 2048


def test_reencode_costs_about_l_over_2t_times_incremental_over_a_branch() -> None:
    """A branch of L tokens checked every T: re-encoding reads T + 2T + ... + L tokens,
    incremental reading L (no prompt, no tail here): (L / T + 1) / 2 times as many."""
    model = PRMCostModel("no tail", QWEN_MATH_PRM_7B, FLOPS, 1e30, call_overhead=0, tail_tokens=0)
    length, interval = 4000, 400
    pricers = {mode: PRMPricer(model, mode) for mode in PRMInput}
    seconds = dict.fromkeys(PRMInput, 0.0)
    for tokens in range(interval, length + 1, interval):
        for mode, pricer in pricers.items():
            seconds[mode] += pricer([item(0, tokens)])
    reencode, incremental = pricers[PRMInput.REENCODE], pricers[PRMInput.INCREMENTAL]
    assert (reencode.tokens, incremental.tokens) == (22_000, 4000)
    assert reencode.tokens / incremental.tokens == (length / interval + 1) / 2
    # Re-encoding redoes attention too, but less of it in proportion (each check's
    # triangle is smaller than the whole branch's), so the time ratio is a bit lower.
    ratio = seconds[PRMInput.REENCODE] / seconds[PRMInput.INCREMENTAL]
    assert length / (2 * interval) < ratio < (length / interval + 1) / 2


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(sart.ConfigError, match="mode='lazy' must be one of 'incremental'"):
        PRMPricer(PRM, "lazy")
    with pytest.raises(sart.ConfigError, match=r"stride=5000 must be in 1\.\.4096"):
        PRMPricer(PRM, "cached", stride=5000)
    with pytest.raises(sart.ConfigError, match="flops=0 must be > 0"):
        PRMCostModel("x", QWEN_MATH_PRM_7B, flops=0, bandwidth=1, call_overhead=0)
    with pytest.raises(sart.ConfigError, match="call_overhead=-1 must be >= 0"):
        PRMCostModel("x", QWEN_MATH_PRM_7B, flops=1, bandwidth=1, call_overhead=-1)
    with pytest.raises(sart.ConfigError, match="a ModelSpec with heads and context"):
        PRMCostModel("x", QWEN_14B, flops=1, bandwidth=1, call_overhead=0)
