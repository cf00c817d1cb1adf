"""What ``sart.engines.base`` gives step engines: ``StepInterrupt`` and ``StepDeltas``'
watchers (the engines' own use of them is in ``test_engines_scenarios.py``)."""

from __future__ import annotations

import sart
from sart.engines.base import StepDeltas, StepInterrupt, watches_steps
from sart.testing import FakeEngine


def decode_steps_until_taken(interrupt: StepInterrupt, most: int = 100) -> int | None:
    """The decode steps a step loop would run before ``interrupt`` says return."""
    for step in range(1, most + 1):
        if interrupt.taken():
            return step
    return None


def test_an_interrupt_is_taken_after_the_decode_step_in_flight_and_once() -> None:
    interrupt = StepInterrupt()
    assert decode_steps_until_taken(interrupt) is None
    interrupt()
    assert decode_steps_until_taken(interrupt) == 1
    assert decode_steps_until_taken(interrupt) is None


def test_an_interrupt_within_k_steps_is_taken_after_k_and_the_soonest_wins() -> None:
    interrupt = StepInterrupt()
    interrupt(16)
    assert decode_steps_until_taken(interrupt) == 16
    interrupt(16)
    interrupt(3)  # sooner
    interrupt(8)  # later: changes nothing
    assert decode_steps_until_taken(interrupt) == 3


def test_step_deltas_hand_a_watched_requests_pieces_and_end_to_its_watcher() -> None:
    heard: list[tuple[sart.BranchId, sart.BranchDelta]] = []
    deltas = StepDeltas({"a": lambda bid, piece: heard.append((bid, piece))})
    a, b = sart.BranchId("a", 0), sart.BranchId("b", 0)
    deltas.add(a, (5,), "x")
    deltas.add(b, (6,), "y")
    deltas.add(a, (7,), "z")
    deltas.end(a, sart.FinishReason.STOP, 2, stop_reason="z")
    assert [(bid, p.token_ids, p.text, p.finish) for bid, p in heard] == [
        (a, (5,), "x", None),
        (a, (7,), "z", None),
        (a, (), "", sart.FinishReason.STOP),
    ]
    assert (heard[-1][1].end_offset, heard[-1][1].stop_reason) == (2, "z")
    whole = deltas.output(2).deltas[a]  # the step's own output is unchanged
    assert (whole.token_ids, whole.text, whole.finish) == ((5, 7), "xz", sart.FinishReason.STOP)


def test_an_engine_watches_steps_only_with_a_watchers_dict() -> None:
    assert watches_steps(FakeEngine(watch=True))
    assert not watches_steps(FakeEngine())
