"""``SimEngine``: the fake engine's scripted branches on a modelled accelerator's clock.

Branch behaviour (lengths, answers, and through ``ScriptedPRM`` the rewards)
comes from a script: a generated workload or a replayed trace
(``sart.bench``). Time comes from a ``CostModel`` (``sart.engines.costs``):
each decode call advances the virtual clock by the modelled time of its
steps, each prefill by the modelled prefill time. It keeps the fake engine's
strict contract checks, and additionally reports KV capacity and the peak KV
in use.

Preemption (``preemption=True``, the default). A decode call whose live
branches would need more KV than the cost model's ``kv_capacity_tokens`` is
priced as vLLM V1 runs it (``vllm/v1/core/sched/scheduler.py``, 0.32: when a
step cannot allocate KV blocks for a running request, the scheduler preempts
the request at the end of its running queue, the most recently scheduled,
frees its blocks and puts it at the front of the waiting queue; it is
recomputed, its prompt and output prefilled again, when blocks free up).
Here the call is simulated step by step in start order: before each step,
while the KV the stepping branches need exceeds the capacity, the last
running branch with tokens left is preempted (its own KV freed; the prompt's,
shared by the request's branches and kept in the prefix cache, stays);
preempted branches resume first in, first out, as soon as they fit, paying a
prefill of their generated tokens; a branch still preempted when the call ends
(it had made its tokens) stays preempted into the next call. Only time changes: every branch still
makes exactly the tokens the call reports (the scheduler does not see
preemption, as with a real vLLM). A call that fits, or a model without a
capacity, takes the one-formula path (bit-identical to ``preemption=False``).
``preemptions`` and ``recomputed_tokens`` count what happened.
"""

from __future__ import annotations

from collections import deque

from sart.engines.base import EngineStats
from sart.engines.costs import CostModel, cost_model
from sart.engines.fake import FakeEngine
from sart.engines.scripts import ScriptLike
from sart.types import BranchId


class SimEngine(FakeEngine):
    """A ``FakeEngine`` whose clock follows ``cost`` (a ``CostModel`` or a preset name:
    ``"h100-14b"``, ``"h200-14b"``, ``"8xh100-70b"``, ``"steps"``)."""

    def __init__(
        self,
        script: ScriptLike = None,
        cost: CostModel | str = "h100-14b",
        *,
        preemption: bool = True,
        **kwargs: object,
    ) -> None:
        super().__init__(script, **kwargs)  # type: ignore[arg-type]
        self.cost = cost_model(cost)
        self.preemption = preemption
        self.peak_kv_tokens = 0
        self.preemptions = 0
        """Branches preempted (each time one is)."""
        self.recomputed_tokens = 0
        """Generated tokens prefilled again when preempted branches resumed."""
        self._waiting: list[BranchId] = []  # preempted at the end of the last call, FIFO

    def _prefill_time(self, prompt_tokens: int) -> float:
        return self.cost.prefill_time(prompt_tokens)

    def _decode_time(self, steps: int) -> float:
        bids, contexts, active, positions, finishing = [], [], [], [], []
        for bid, live in self._live.items():
            bids.append(bid)
            contexts.append(self._prefixes[bid.request_id].tokens + live.pos)
            active.append(min(steps, live.end - live.pos))
            positions.append(live.pos)
            finishing.append(live.pos + active[-1] == live.end)
        prefixes = self._kv_tokens - sum(positions)
        self._waiting = [bid for bid in self._waiting if bid in self._live]
        capacity = self.cost.kv_capacity_tokens
        if not self._waiting:
            peak = _peak(prefixes, active, positions)
            if not self.preemption or capacity is None or peak <= capacity:
                self.peak_kv_tokens = max(self.peak_kv_tokens, peak)
                return self.cost.decode_time(contexts, active)
        assert capacity is not None  # branches wait only where there is a capacity
        index = {bid: i for i, bid in enumerate(bids)}
        waiting = deque(index[bid] for bid in self._waiting)
        total, still = self._decode_preempting(
            prefixes, contexts, active, positions, finishing, capacity, waiting
        )
        self._waiting = [bids[i] for i in still]
        return total

    def _decode_preempting(
        self,
        prefixes: int,
        contexts: list[int],
        active: list[int],
        positions: list[int],
        finishing: list[bool],
        capacity: int,
        waiting: deque[int],
    ) -> tuple[float, deque[int]]:
        """The call's time when its branches do not all fit, step by step as the module
        docstring says; also the branches still preempted at its end."""
        pos, left = list(positions), list(active)
        running = [i for i in range(len(active)) if i not in waiting]  # newest last
        kv = prefixes + sum(pos[i] for i in running)
        total = 0.0
        while any(left):
            stepping = sum(1 for i in running if left[i])
            # Resume, first in first out, the preempted branches this call still needs
            # that fit (one anyway if nothing else could step).
            while True:
                i = next((i for i in waiting if left[i]), None)
                if i is None or (kv + pos[i] + stepping + 1 > capacity and stepping):
                    break
                waiting.remove(i)
                kv += pos[i]
                total += self.cost.prefill_time(pos[i])
                self.recomputed_tokens += pos[i]
                running.append(i)
                stepping += 1
            # Preempt the newest until the step fits, keeping one branch stepping.
            while kv + stepping > capacity:
                victim = next(
                    (i for i in reversed(running) if not (left[i] and stepping == 1)), None
                )
                if victim is None:
                    break  # one branch alone does not fit: it runs, over capacity
                running.remove(victim)
                waiting.append(victim)
                kv -= pos[victim]
                stepping -= 1 if left[victim] else 0
                self.preemptions += 1
            now = [i for i in running if left[i]]
            total += self.cost.decode_time(
                [contexts[i] + pos[i] - positions[i] for i in now], [1] * len(now)
            )
            for i in now:
                pos[i] += 1
                left[i] -= 1
            kv += len(now)
            self.peak_kv_tokens = max(self.peak_kv_tokens, kv)
            for i in now:
                if not left[i] and finishing[i]:  # it ends: its KV is freed
                    running.remove(i)
                    kv -= pos[i]
        return total, waiting

    def stats(self) -> EngineStats:
        """KV in use: what the resident branches hold (a preempted branch's own KV is
        freed until it resumes)."""
        waiting = sum(self._live[bid].pos for bid in self._waiting if bid in self._live)
        return EngineStats(
            live_branches=len(self._live),
            kv_tokens=self._kv_tokens - waiting,
            kv_capacity=self.cost.kv_capacity_tokens,
        )


def _peak(prefixes: int, active: list[int], positions: list[int]) -> int:
    """The most KV a decode call uses with every branch resident: it peaks at the end
    of a step ``e`` at which some branch ends (just before it is freed): the prefixes
    plus, for every branch still live at ``e``, its position + ``e``. Checked at every
    such ``e`` with running sums."""
    peak = 0
    order = sorted(range(len(active)), key=active.__getitem__)
    live, pos_sum = len(order), sum(positions)
    for i in order:  # ascending end steps; the branches before i have ended
        peak = max(peak, prefixes + pos_sum + live * active[i])
        live -= 1
        pos_sum -= positions[i]
    return peak
