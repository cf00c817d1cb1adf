"""Stop rules: when a request has enough completed branches."""

from __future__ import annotations

import attrs

from sart.errors import config_check, int_at_least
from sart.policies.base import StopRule
from sart.views import RequestView


@attrs.frozen
class FirstM(StopRule):
    """Finish the request once ``m`` branches have completed (the paper's early stop)."""

    m: int = attrs.field(validator=int_at_least(1))

    def validate(self, n: int) -> None:
        config_check(self.m <= n, "m", self.m, f"<= n={n}")

    def should_stop(self, request: RequestView) -> bool:
        return request.num_completed >= self.m


@attrs.frozen
class AllDone(StopRule):
    """Wait until no branch is running or waiting (Self-Consistency, Vanilla)."""
