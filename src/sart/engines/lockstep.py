"""How far a step of a streaming engine may go: the lockstep rules, pure.

Streams produce tokens at their own pace; a step engine advances every branch
together. ``StreamingEngine`` (``sart.engines.streaming``) reports a step only as
far as these rules allow, so the scheduler sees what a step engine would show it.
Each takes the buffered tokens of the streams (``pending``) and whether they ended
(``finish``), and never waits itself: ``None`` (or not done) tells the caller to.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from sart.types import FinishReason


class Buffered(Protocol):
    """What the rules read of a stream: its tokens not reported yet, and its end."""

    @property
    def pending(self) -> list: ...

    @property
    def finish(self) -> FinishReason | None: ...


def horizon(streams: Iterable[Buffered], max_steps: int, until_first_end: bool) -> int | None:
    """The steps a call over ``streams`` can report now, or ``None`` to wait for more.

    A step engine advances every branch in lockstep, so the call may end at
    step ``s`` only once every branch has produced ``s`` tokens or ended:
    ``s = max_steps`` (or, if every branch ends sooner, the last end); with
    ``until_first_end``, ``s`` = the first end, and no slower branch may
    still end before it.
    """
    streams = list(streams)
    ends = [len(s.pending) for s in streams if s.finish is not None and len(s.pending) <= max_steps]
    target = min(ends) if until_first_end and ends else max_steps
    if any(s.finish is None and len(s.pending) < target for s in streams):
        return None
    if len(ends) == len(streams):  # every branch ends within this call
        return min(ends) if until_first_end else max(ends)
    return target


def request_reach(
    streams: Iterable[Buffered], max_steps: int, until_first_end: bool
) -> tuple[int, bool]:
    """The steps one request's branches can report together now, and whether the
    request is at a point the scheduler must see: its chunk's end (``max_steps``),
    every branch of it ended, or (``until_first_end``) one of them ended.

    ``horizon``'s rule applied to one request (``per_request_steps``), except that
    it never waits: a branch still in its prefill makes the request report 0 steps."""
    ends: list[int] = []
    running: list[int] = []
    for s in streams:
        if s.finish is not None and len(s.pending) <= max_steps:
            ends.append(len(s.pending))
        else:
            running.append(len(s.pending))
    reach = min([max_steps, *running])
    if ends and until_first_end and min(ends) <= reach:
        return min(ends), True
    if not running:  # every branch ends within the chunk
        return max(ends), True
    if reach >= max_steps:  # the chunk's end, with the ends within it at their offsets
        return reach, True
    # Part of the chunk: up to just before its first end, which is reported with the
    # chunk's end, when the scheduler checks the request (as on a step engine).
    return (min(reach, min(ends) - 1) if ends else reach), False
