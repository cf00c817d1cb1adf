"""Confidence signals, ``ConfidenceScorer`` and DeepConf's warm-up threshold."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sart.errors import ConfigError, PRMError
from sart.messages import BranchDelta, ScoreItem, StepOutput, TokenLogprobs
from sart.policies.prune import WarmupThreshold, percentile
from sart.rewards import (
    ConfidenceScorer,
    GroupConfidence,
    LowestGroupConfidence,
    LowestTokenLogprob,
    MeanTokenLogprob,
    TailConfidence,
    TokenConfidence,
    token_confidence,
)
from sart.types import BranchId, BranchStatus, Phase
from sart.views import BranchView, Limits, RequestView

B0 = BranchId("r", 0)


def tok(confidence: float, logprob: float = -0.1, k: int = 2) -> TokenLogprobs:
    """A token whose top-k values have negative mean ``confidence``."""
    return TokenLogprobs(logprob, (-confidence,) * k)


def feed(scorer: ConfidenceScorer, tokens: list[TokenLogprobs], bid: BranchId = B0) -> None:
    delta = BranchDelta(new_tokens=len(tokens), text="", logprobs=tuple(tokens))
    scorer.observe(StepOutput(steps=len(tokens), deltas={bid: delta}))


def item(bid: BranchId = B0, num_tokens: int = 1) -> ScoreItem:
    return ScoreItem(branch=bid, prompt="p", text="", num_tokens=num_tokens, final=False)


def raw(scorer: ConfidenceScorer, bid: BranchId = B0) -> float:
    """The signal's raw value, inverted from the reward (scale 1)."""
    reward = scorer.score([item(bid)])[0]
    return -math.log(1.0 - reward) * scorer.scale


def test_token_confidence_is_minus_the_mean_of_the_top_k() -> None:
    assert token_confidence(TokenLogprobs(-0.1, (-0.1, -2.0, -3.9))) == pytest.approx(2.0)
    with pytest.raises(PRMError, match="top-k"):
        token_confidence(TokenLogprobs(-0.1, ()))


windows = st.integers(1, 6)
confidences = st.lists(st.floats(0.0, 20.0), min_size=1, max_size=40)


@given(windows, confidences)
def test_group_confidence_is_the_mean_of_the_last_window(window: int, cs: list[float]) -> None:
    scorer = ConfidenceScorer(GroupConfidence(window), scale=1.0)
    feed(scorer, [tok(c) for c in cs])
    assert raw(scorer) == pytest.approx(sum(cs[-window:]) / len(cs[-window:]), abs=1e-6)


@given(windows, confidences)
def test_lowest_group_is_the_lowest_full_window_mean(window: int, cs: list[float]) -> None:
    scorer = ConfidenceScorer(LowestGroupConfidence(window), scale=1.0)
    for c in cs:  # one token per decode call: the state must carry across calls
        feed(scorer, [tok(c)])
    if len(cs) < window:
        expected = sum(cs) / len(cs)
    else:
        expected = min(sum(cs[i : i + window]) / window for i in range(len(cs) - window + 1))
    assert raw(scorer) == pytest.approx(expected, abs=1e-6)


def test_token_and_tail_confidence() -> None:
    token = ConfidenceScorer(TokenConfidence(), scale=1.0)
    tail = ConfidenceScorer(TailConfidence(tail=2), scale=1.0)
    for scorer in (token, tail):
        feed(scorer, [tok(5.0), tok(1.0), tok(3.0)])
    assert raw(token) == pytest.approx(3.0)
    assert raw(tail) == pytest.approx(2.0)


def test_logprob_signals_are_probabilities_and_need_no_top_k() -> None:
    low = ConfidenceScorer(LowestTokenLogprob())
    mean = ConfidenceScorer(MeanTokenLogprob())
    assert low.logprobs_wanted == 0 and mean.logprobs_wanted == 0
    tokens = [TokenLogprobs(lp) for lp in (-0.1, -2.0, -0.3)]
    for scorer in (low, mean):
        feed(scorer, tokens)
    assert low.score([item()]) == [pytest.approx(math.exp(-2.0))]
    assert mean.score([item()]) == [pytest.approx(math.exp(-2.4 / 3))]


def test_rewards_rise_with_confidence_and_stay_in_0_1() -> None:
    scorer = ConfidenceScorer(GroupConfidence(4))
    branches = [BranchId("r", i) for i in range(4)]
    for bid, c in zip(branches, (0.0, 1.0, 10.0, 1e6)):
        feed(scorer, [tok(c)] * 4, bid)
    rewards = scorer.score([item(b) for b in branches])
    assert rewards == sorted(rewards) and rewards[0] == 0.0 and rewards[-1] <= 1.0
    assert len(set(rewards)) == 4


def test_state_is_bounded_by_the_window_and_released_per_request() -> None:
    scorer = ConfidenceScorer(LowestGroupConfidence(window=8))
    other = BranchId("s", 0)
    for _ in range(500):  # 5,000 tokens: the state must not grow with them
        feed(scorer, [tok(3.0)] * 10)
    feed(scorer, [tok(3.0)], other)
    assert scorer.state_size(B0) == 8
    assert scorer.requests_held == 2
    scorer.release("r")
    assert scorer.state_size(B0) == 0 and scorer.requests_held == 1
    assert scorer.score([item(other)])[0] > 0.0  # the other request keeps its state


def test_a_branch_without_logprobs_fails_its_request_clearly() -> None:
    scorer = ConfidenceScorer()
    with pytest.raises(PRMError, match="no log-probabilities") as err:
        scorer.score([item(num_tokens=5)])
    assert list(err.value.request_ids) == ["r"]
    assert scorer.score([item(num_tokens=0)]) == [0.5]  # nothing generated: neutral


def test_sampled_only_logprobs_fail_a_top_k_signal_at_its_score_not_in_observe() -> None:
    scorer = ConfidenceScorer(GroupConfidence(4))
    feed(scorer, [TokenLogprobs(-0.5)])  # must not raise: observe runs inside decoding
    with pytest.raises(PRMError, match="top-k"):
        scorer.score([item()])


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="scale"):
        ConfidenceScorer(scale=0.0)
    with pytest.raises(ConfigError, match="signal"):
        ConfidenceScorer(signal="lowest")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="window"):
        GroupConfidence(window=0)
    with pytest.raises(ConfigError, match="keep"):
        WarmupThreshold(warmup=2, keep=0.0)


# ------------------------------------------------------------------ WarmupThreshold


def view(branches: list[tuple[BranchStatus, float | None, int | None]]) -> RequestView:
    views = tuple(
        BranchView(
            index=i,
            status=s,
            num_tokens=10,
            reward=r,
            text="",
            end_step=e,
            scored_at=None if r is None else 10,  # scored at its current length
        )
        for i, (s, r, e) in enumerate(branches)
    )
    return RequestView(
        request_id="r",
        n=len(views),
        phase=Phase.EXPLORE,
        limits=Limits(threshold=None, max_num_pruned=len(views) - 1),
        num_completed=sum(b.is_completed for b in views),
        num_pruned=0,
        branches=views,
    )


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 10) == pytest.approx(1.3)
    assert percentile([5.0], 90) == 5.0


def test_warmup_threshold_prunes_below_the_warmup_percentile() -> None:
    done, run = BranchStatus.FINISHED, BranchStatus.RUNNING
    rule = WarmupThreshold(warmup=2, keep=50.0)
    rule.validate(6)
    # Only one warm-up branch has completed: nothing is pruned yet.
    assert list(rule.choose(view([(done, 0.6, 1), (run, 0.1, None), (run, 0.9, None)]))) == []
    # Warm-up = the first two to complete (0.6 at step 1, 0.8 at step 2): threshold 0.7.
    # A later completion (0.2 at step 3) does not move it.
    request = view(
        [
            (done, 0.6, 1),
            (done, 0.8, 2),
            (done, 0.2, 3),
            (run, 0.69, None),
            (run, 0.5, None),
            (run, 0.71, None),
        ]
    )
    assert rule.threshold(request) == pytest.approx(0.7)
    assert list(rule.choose(request)) == [4, 3]  # lowest first
    # Overlapped checks: a warm-up branch's reward is of a prefix until its final
    # score comes (scored at 6 of its 10 tokens): no threshold, nothing pruned yet.
    early = attrs.evolve(request.branches[1], scored_at=6)
    first, _, *rest = request.branches
    provisional = attrs.evolve(request, branches=(first, early, *rest))
    assert rule.threshold(provisional) is None and list(rule.choose(provisional)) == []


def test_warmup_must_leave_branches_to_prune() -> None:
    with pytest.raises(ConfigError, match="warmup"):
        WarmupThreshold(warmup=4).validate(4)
