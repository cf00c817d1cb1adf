"""``check_engine`` itself: it passes a correct engine and catches each kind of misuse
an adapter can let through."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from sart.engines.base import BranchSpec
from sart.errors import EngineError
from sart.testing import EngineMisuse, FakeEngine, check_engine
from sart.types import BranchId, Prompt, SamplingSettings


class AcceptsSecondPrefill(FakeEngine):
    def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        if request_id in self.prefixes:
            return 1  # silently ignored: the caller's bug goes unnoticed
        return super().prefill(request_id, prompt, sampling)


class BlamesEveryone(FakeEngine):
    def abort(self, branch_ids: Sequence[BranchId]) -> None:
        try:
            super().abort(branch_ids)
        except EngineMisuse as exc:
            raise EngineError(str(exc)) from None  # no request_ids: fails every request


class StartsSomeBeforeRefusing(FakeEngine):
    def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        indices = [b.index for b in branches]
        if len(set(indices)) != len(indices):
            super().start_branches(request_id, branches[:1])  # half-done, then refused
            raise EngineError("twice", [request_id])
        super().start_branches(request_id, branches)


class CrashesOnUnknownRelease(FakeEngine):
    def release_prefix(self, request_id: str) -> None:
        if request_id not in self.prefixes:
            raise KeyError(request_id)
        super().release_prefix(request_id)


def test_a_correct_engine_passes() -> None:
    check_engine(FakeEngine)


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (AcceptsSecondPrefill, "a second prefill of a held prefix must be refused"),
        (BlamesEveryone, "must fail only request 'conf-m', not []"),
        (StartsSomeBeforeRefusing, "a refused start_branches of one index twice in one call"),
        (CrashesOnUnknownRelease, "must raise EngineError naming 'conf-none', not KeyError"),
    ],
)
def test_misuse_that_an_adapter_lets_through_is_caught(engine: type, message: str) -> None:
    with pytest.raises(AssertionError, match="engine contract") as info:
        check_engine(engine)
    assert message in str(info.value)
