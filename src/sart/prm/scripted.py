"""``ScriptedPRM``: rewards read from branch scripts, for tests and tutorials.

Give it the same script as the ``FakeEngine`` and every branch gets the reward
trajectory its ``BranchScript`` describes. It can inject failures: raise for
chosen branches, or return NaN for them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sart.engines.scripts import ScriptLike, as_script
from sart.errors import PRMError, config_check
from sart.prm.base import ScoreItem
from sart.types import BranchId


class ScriptedPRM:
    """Scores each item with its branch script's ``reward_at(num_tokens, every, final)``.

    ``every`` is the token interval the script's ``rewards`` are given at;
    set it to the policy's ``interval``. ``fail_on`` branches make the whole
    call raise (``PRMError`` naming the request if ``attribute_failures``,
    else a ``RuntimeError`` the driver must isolate); ``nan_for`` branches get
    NaN.
    """

    def __init__(
        self,
        script: ScriptLike = None,
        *,
        every: int = 400,
        fail_on: Collection[BranchId] = (),
        nan_for: Collection[BranchId] = (),
        attribute_failures: bool = False,
    ) -> None:
        config_check(isinstance(every, int) and every >= 1, "every", every, ">= 1")
        self.script = as_script(script)
        self.every = every
        self.fail_on = set(fail_on)
        self.nan_for = set(nan_for)
        self.attribute_failures = attribute_failures
        self.calls = 0
        self.items_scored = 0
        self.released: list[str] = []

    def score(self, items: Sequence[ScoreItem]) -> list[float]:
        self.calls += 1
        bad = [item.branch for item in items if item.branch in self.fail_on]
        if bad:
            message = f"injected PRM failure for {', '.join(map(str, bad))}"
            if self.attribute_failures:
                raise PRMError(message, {b.request_id for b in bad})
            raise RuntimeError(message)
        self.items_scored += len(items)
        return [
            float("nan")
            if item.branch in self.nan_for
            else self.script(item.branch).reward_at(item.num_tokens, self.every, item.final)
            for item in items
        ]

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
