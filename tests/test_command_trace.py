"""The scheduler's commands over a fixed set of simulator runs, pinned by a digest.

Refactoring the scheduler, the drivers or the method registry must not change
one command Algorithm 1 emits: every method, at N = 4 and 8, overlapped and
blocking, on the same 40-request gaokao trace, emits exactly the commands it
emitted when this digest was recorded (at 46d571b, before the loader, the
registry and K checks in flight). A change that means to alter scheduling
re-records it and says why in its commit.
"""

from __future__ import annotations

import hashlib
import re

import pytest

import sart.scheduler
from sart.bench.runner import BenchConfig, run_method, traces
from sart.types import EXTRA_SAMPLING

COMMANDS = 10223
DIGEST = "c7fcb3bf0350ae6fd4ed7e73ff1b06de27f4e78b73e1c20bee3646071b763b55"


def test_the_simulators_command_trace_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    emit = sart.scheduler.Scheduler.next_commands

    def recorded(self: sart.scheduler.Scheduler, now: float) -> list:
        commands = emit(self, now)
        log.extend(f"{now:.6f} {command!r}" for command in commands)
        return commands

    monkeypatch.setattr(sart.scheduler.Scheduler, "next_commands", recorded)
    for scoring in ("overlapped", "blocking"):
        config = BenchConfig(
            workload="gaokao",
            ns=(4, 8),
            rates=(4.0,),
            num_requests=40,
            scoring=scoring,
            methods=("vanilla", "sc", "rebase", "sart-no-prune", "sart"),
        )
        for rate, trace in traces(config):
            for method in config.methods:
                for n in config.ns:
                    run_method(trace, method, n, config, rate)
    # Function reprs carry addresses, which differ from run to run. Fields added to
    # the values after the recording are left out of their reprs at their defaults
    # (the runs never set them): vLLM's extra sampling fields, RequestResult.refused.
    defaults = ", ".join(f"{k}={v!r}" for k, v in EXTRA_SAMPLING.items())
    text = "\n".join(
        re.sub(r" at 0x[0-9a-f]+", "", line)
        .replace(", " + defaults, "")
        .replace(" refused=False,", "")
        for line in log
    )
    assert (len(log), hashlib.sha256(text.encode()).hexdigest()) == (COMMANDS, DIGEST)
