"""``SimEngine``: the fake engine's scripted branches on a modelled accelerator's clock.

Branch behaviour (lengths, answers, and through ``ScriptedPRM`` the rewards)
comes from a script: a generated workload or a replayed trace
(``sart.bench``). Time comes from a ``CostModel`` (``sart.engines.costs``):
each decode call advances the virtual clock by the modelled time of its
steps, each prefill by the modelled prefill time. It keeps the fake engine's
strict contract checks, and additionally reports KV capacity and the peak KV
in use, so a run that would not fit in memory is visible.
"""

from __future__ import annotations

from sart.engines.base import EngineStats
from sart.engines.costs import CostModel, cost_model
from sart.engines.fake import FakeEngine
from sart.engines.scripts import ScriptLike


class SimEngine(FakeEngine):
    """A ``FakeEngine`` whose clock follows ``cost`` (a ``CostModel`` or a preset name:
    ``"h100-14b"``, ``"h200-14b"``, ``"8xh100-70b"``, ``"steps"``)."""

    def __init__(
        self, script: ScriptLike = None, cost: CostModel | str = "h100-14b", **kwargs: object
    ) -> None:
        super().__init__(script, **kwargs)  # type: ignore[arg-type]
        self.cost = cost_model(cost)
        self.peak_kv_tokens = 0

    def _prefill_time(self, prompt_tokens: int) -> float:
        return self.cost.prefill_time(prompt_tokens)

    def _decode_time(self, steps: int) -> float:
        contexts, active, positions = [], [], []
        for bid, live in self._live.items():
            contexts.append(self._prefixes[bid.request_id].tokens + live.pos)
            active.append(min(steps, live.end - live.pos))
            positions.append(live.pos)
        self._track_peak(active, positions)
        return self.cost.decode_time(contexts, active)

    def _track_peak(self, active: list[int], positions: list[int]) -> None:
        """KV in use peaks at the end of a step ``e`` at which some branch ends (just
        before it is freed): the prefixes plus, for every branch still live at
        ``e``, its position + ``e``. Checked at every such ``e`` with running sums."""
        prefixes = self._kv_tokens - sum(positions)
        order = sorted(range(len(active)), key=active.__getitem__)
        live, pos_sum = len(order), sum(positions)
        for i in order:  # ascending end steps; the branches before i have ended
            self.peak_kv_tokens = max(self.peak_kv_tokens, prefixes + pos_sum + live * active[i])
            live -= 1
            pos_sum -= positions[i]

    def stats(self) -> EngineStats:
        return EngineStats(
            live_branches=len(self._live),
            kv_tokens=self._kv_tokens,
            kv_capacity=self.cost.kv_capacity_tokens,
        )
