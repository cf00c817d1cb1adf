"""Stop rules: when a request has enough completed branches."""

from __future__ import annotations

import attrs

from sart.errors import config_check, int_at_least
from sart.policies.base import StopRule
from sart.policies.equivalence import Equivalence, ExactMatch, check_equivalence, group_answers
from sart.types import BranchStatus
from sart.views import RequestView


@attrs.frozen
class FirstM(StopRule):
    """Finish the request once ``m`` branches have completed (the paper's early stop)."""

    m: int = attrs.field(validator=int_at_least(1))

    needs_rewards = False

    def validate(self, n: int) -> None:
        config_check(self.m <= n, "m", self.m, f"<= n={n}")

    def should_stop(self, request: RequestView) -> bool:
        return request.num_completed >= self.m


@attrs.frozen
class Agreement(StopRule):
    """Finish once ``k`` finished branches agree on the answer, or ``m`` have completed.

    ``FirstM(m)`` with a shortcut: when the first branches to finish already agree,
    waiting for more of them buys little and costs the slowest branch's time. Only
    branches that finished (EOS or a stop string) count toward agreement: one cut at
    ``max_tokens`` wrote no conclusion. Answers are the policy's ``extract`` of each
    branch and count together when ``equivalence`` says they are the same (default:
    equal strings). With ``k = m`` it stops exactly when ``FirstM(m)`` does.
    """

    m: int = attrs.field(validator=int_at_least(1))
    """Completed branches that finish the request whatever they say."""
    k: int = attrs.field(default=2, validator=int_at_least(2))
    """Finished branches with one answer that finish it sooner."""
    equivalence: Equivalence = attrs.field(
        factory=ExactMatch, validator=check_equivalence, kw_only=True
    )
    """Which answers are one answer (default ``ExactMatch()``)."""

    needs_answers = True
    needs_rewards = False

    def validate(self, n: int) -> None:
        config_check(self.m <= n, "m", self.m, f"<= n={n}")
        config_check(self.k <= self.m, "k", self.k, f"<= m={self.m}")

    def should_stop(self, request: RequestView) -> bool:
        if request.num_completed >= self.m:
            return True
        finished = [b for b in request.branches if b.status is BranchStatus.FINISHED and b.answer]
        if len(finished) < self.k:
            return False
        groups = group_answers(finished, [b.answer or "" for b in finished], self.equivalence)
        return max(len(group) for group in groups) >= self.k


@attrs.frozen
class AllDone(StopRule):
    """Wait until no branch is running or waiting (Self-Consistency, Vanilla)."""

    needs_rewards = False
