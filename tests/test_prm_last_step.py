"""What the cached and the remote PRM share (``sart.prm.last_step``): the jobs of a
call, the reward of a pair of logits, and each branch's memory of its rated steps."""

from __future__ import annotations

import math

import pytest

from sart.errors import PRMError
from sart.prm.base import ScoreItem
from sart.prm.last_step import StepMemory, last_step_jobs, two_way_reward
from sart.prm.window import Encoded
from sart.types import BranchId


def item(rid: str, index: int = 0, final: bool = False) -> ScoreItem:
    return ScoreItem(BranchId(rid, index), "q", "text", 4, final)


def test_a_job_sends_the_input_up_to_its_last_steps_rating_token() -> None:
    # prefix (1, 2); step segments each end at their rating token (the last one here).
    encoded = [
        Encoded(prefix=(1, 2), segments=((3, 9), (4, 5, 9)), rating=(1, 2), first_step=0),
        Encoded(prefix=(1, 2), segments=(), rating=(), first_step=0),  # no step yet
        Encoded(prefix=(1,), segments=((7, 9, 8),), rating=(1,), first_step=5),  # windowed
    ]
    jobs = last_step_jobs(encoded)
    assert [(j.position, j.ids, j.step) for j in jobs] == [
        (0, [1, 2, 3, 9, 4, 5, 9], 1),
        (2, [1, 7, 9], 5),
    ]


@pytest.mark.parametrize("pair", [(0.0, 0.0), (0.0, 1.0), (3.0, -2.0), (800.0, 799.0)])
def test_a_pairs_reward_is_its_softmaxs_good_column(pair: tuple[float, float]) -> None:
    bad, good = pair
    want = 1 / (1 + math.exp(bad - good))
    assert two_way_reward(pair) == pytest.approx(want, rel=1e-12)


def test_memory_keeps_each_steps_latest_reward_until_the_final_check() -> None:
    memory = StepMemory()
    a, b = item("r"), item("r", 1)
    memory.record(a.branch, 0, 0.9)
    memory.record(a.branch, 2, 0.4)
    memory.record(a.branch, 2, 0.5)  # step 2 rated again: the later reward stands
    memory.record(b.branch, 0, 0.1)
    assert memory.collect([a, b]) == [[0.9, 0.5], [0.1]]
    assert memory.collect([item("r", 0, final=True)]) == [[0.9, 0.5]]
    assert memory.collect([a]) == [[]]  # forgotten after its final check
    memory.release("r")
    assert len(memory) == 0


def test_a_non_finite_reward_names_its_request_and_is_still_forgotten_when_final() -> None:
    memory = StepMemory()
    memory.record(BranchId("bad", 0), 0, float("nan"))
    memory.record(BranchId("good", 0), 0, 0.5)
    with pytest.raises(PRMError) as caught:
        memory.collect([item("bad", final=True), item("good")])
    assert caught.value.request_ids == frozenset({"bad"})
    assert len(memory) == 1  # the final branch is gone, the other kept
