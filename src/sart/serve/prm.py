"""``ServedPRM``: the PRM as the server calls it — timed, and shown chat questions as text.

A chat request reaches the engine as token ids (the policy's chat template
rendered by the server), but a PRM formats its own input around the
*question*, as text (Qwen2.5-Math-PRM wraps it in its own template). So for
a chat request the server registers the question — the last user message —
and the PRM sees that text as the item's prompt. Completion prompts pass as
they are. A question is forgotten when the PRM is told to release its
request (the driver holds releases back while a check is in flight for a
one-worker PRM; a PRM with several workers releases at once, and a check of a
request that has ended is ignored anyway).

Each call's duration goes to ``sart:prm_latency_seconds``. A stopping server
cancels the calls in flight (``cancel``), where the PRM can.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs

from sart.prm.base import PRM, ScoreItem


class ServedPRM:
    """Wraps ``prm``; ``observe(seconds, items)`` is called after every call."""

    def __init__(self, prm: PRM, observe: Callable[[float, int], None]) -> None:
        self.prm = prm
        self._observe = observe
        self._questions: dict[str, str] = {}

    @property
    def workers(self) -> int:
        """The wrapped PRM's workers (a pool, PRM servers): the driver keeps as many
        checks in flight."""
        from sart.rewards import prm_workers

        return prm_workers(self.prm)

    def ask(self, request_id: str, question: str) -> None:
        """Show the PRM ``question`` as the prompt of ``request_id``'s items."""
        self._questions[request_id] = question

    def forget(self, request_id: str) -> None:
        self._questions.pop(request_id, None)

    def score(self, items: Sequence[ScoreItem]) -> Sequence[float]:
        questions = self._questions
        items = [
            attrs.evolve(item, prompt=questions[rid])
            if (rid := item.branch.request_id) in questions
            else item
            for item in items
        ]
        start = time.perf_counter()
        try:
            return self.prm.score(items)
        finally:
            self._observe(time.perf_counter() - start, len(items))

    def cancel(self) -> None:
        """Cut the wrapped PRM's calls in flight short, where it can (an optional
        ``cancel()``, as ``RemotePRM``'s: a hung PRM server's checks would otherwise
        hold a stopping server for its ``--prm-timeout``)."""
        cancel = getattr(self.prm, "cancel", None)
        if cancel is not None:
            cancel()

    def release(self, request_id: str) -> None:
        self.forget(request_id)
        release = getattr(self.prm, "release", None)
        if release is not None:
            release(request_id)
