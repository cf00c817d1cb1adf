"""``Request.keep_logprobs``: the chosen branch's log-probabilities come back with its
result (``RequestResult.logprobs``), a fork's first ones its parent's."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest

import sart
from sart.errors import ConfigError
from sart.policies.base import Selector
from sart.testing import BranchScript, FakeEngine, ScriptedPRM, ScriptTable
from sart.types import BranchStatus as S


@attrs.frozen
class LastBranch(Selector):
    """Selects the completed branch of the highest index (a fork, in the test below)."""

    def choose(self, branches: Sequence[sart.BranchView], answers: Sequence[str]) -> int:
        return max(b.index for b in branches)


def test_a_forks_logprobs_start_with_its_parents() -> None:
    parent = BranchScript(
        length=30, answer="4", rewards=(0.9,), logprobs=(-0.1, -0.2, -0.3), logprob_every=10
    )
    other = BranchScript(length=30, answer="5", rewards=(0.1,), logprobs=(-2.0,))
    script = ScriptTable({"q": [parent, other, other]})
    policy = attrs.evolve(sart.rebase(3, temperature=0.1, interval=10), select=LastBranch())
    sampling = sart.SamplingSettings(logprobs=0, max_tokens=64)
    request = sart.Request("q", "p", policy, sampling, keep_logprobs=True)
    engine = FakeEngine(script, max_branches=3)
    (result,) = sart.run([request], engine, ScriptedPRM(script, every=10), batch_size=3)
    assert [b.status for b in result.branches][3:] == [S.FINISHED, S.FINISHED]
    assert result.chosen == 4 and result.branches[4].inherited == 10
    assert result.logprobs is not None
    # Ten tokens of its parent's, twenty of its own (which follow its parent's script).
    assert [lp.logprob for lp in result.logprobs] == [-0.1] * 10 + [-0.2] * 10 + [-0.3] * 10


def test_without_keep_logprobs_none_are_kept() -> None:
    script = {"q": [BranchScript(length=12, answer="1")] * 2}
    sampling = sart.SamplingSettings(logprobs=2)
    (result,) = sart.run(
        [sart.Request("q", "p", sart.self_consistency(2), sampling)], FakeEngine(script)
    )
    assert result.ok and result.logprobs is None


def test_the_result_has_the_requests_k_where_a_confidence_source_asked_for_more() -> None:
    script = {"q": [BranchScript(length=40, answer="1")] * 2}
    sampling = sart.SamplingSettings(logprobs=1)
    request = sart.Request("q", "p", sart.sart_confidence(2), sampling, keep_logprobs=True)
    engine = FakeEngine(script)
    (result,) = sart.run([request], engine)
    assert result.ok and result.logprobs is not None
    assert len(result.logprobs) == result.branches[result.chosen].num_tokens
    assert {len(lp.top) for lp in result.logprobs} == {1}


def test_keep_logprobs_needs_sampling_logprobs() -> None:
    with pytest.raises(ConfigError, match=r"keep_logprobs=True needs sampling\.logprobs"):
        sart.Request("q", "p", sart.vanilla(), keep_logprobs=True)
