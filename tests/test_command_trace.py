"""The scheduler's commands over a fixed set of simulator runs, pinned by a digest.

Refactoring the scheduler, the drivers or the method registry must not change
one command Algorithm 1 emits: every method, at N = 4 and 8, overlapped and
blocking, on the same 40-request gaokao trace, emits exactly the commands it
emitted when this digest was recorded (at 46d571b, before the loader, the
registry and K checks in flight). A change that means to alter scheduling
re-records it and says why in its commit.

Re-recorded once since, for a change of the workload, not of scheduling: the
simulator's forks now sample their own continuation (``TraceScript.fork``),
which changes what Rebase's children do. The other methods' 5,742 commands
were checked identical before and after that change. Re-recorded again for the
same reason when the forks' continuations were drawn from the ``ForkModel``
fitted to a real PRM's forks (``sart.bench.traces``; the other methods' 5,742
commands again identical, digest ``f31c4c4f...``), and back to this one when
the generated presets left that model for their requests' own answers
(``Trace.fork_model``): the digest is the one before the fitted model. The runs use gaokao as
it was recorded (``RECORDED_GAOKAO``), so refitting the preset changes nothing
here.
"""

from __future__ import annotations

import hashlib
import re

import attrs
import pytest

import sart.scheduler
from sart.bench import workloads
from sart.bench.runner import BenchConfig, run_method, traces
from sart.types import EXTRA_SAMPLING

COMMANDS = 10374
DIGEST = "ce6ec75adb2692d16c16f3200fddcf10bb701f93a45753d186c7f489c5612cf0"

#: The gaokao preset when the digest was recorded: lognormal lengths independent of
#: correctness, no loops.
RECORDED_GAOKAO = attrs.evolve(
    workloads.GAOKAO, branch_sigma=0.55, sigma_spread=0.0, overthink=0.0, loop_share=0.0
)


def test_the_simulators_command_trace_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    emit = sart.scheduler.Scheduler.next_commands

    def recorded(self: sart.scheduler.Scheduler, now: float) -> list:
        commands = emit(self, now)
        log.extend(f"{now:.6f} {command!r}" for command in commands)
        return commands

    monkeypatch.setattr(sart.scheduler.Scheduler, "next_commands", recorded)
    monkeypatch.setitem(workloads.WORKLOADS, "gaokao", RECORDED_GAOKAO)
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
    # (the runs never set them): vLLM's extra sampling fields, RequestResult.refused and
    # refused_field, Policy.admit, Policy.rebranch, BranchOutcome.stop_reason,
    # Request.keep_logprobs, RequestResult.logprobs; and the fork
    # fields of BranchOutcome (parent, inherited), which Rebase's children set: new outcome
    # fields, not new commands.
    defaults = ", ".join(f"{k}={v!r}" for k, v in EXTRA_SAMPLING.items())
    text = "\n".join(
        re.sub(r", parent=(None|\d+), inherited=\d+", "", re.sub(r" at 0x[0-9a-f]+", "", line))
        .replace(", " + defaults, "")
        .replace(", rebranch=RebranchRule()", "")
        .replace(" refused=False,", "")
        .replace(" refused_field=None,", "")
        .replace(", admit=AdmitRule()", "")
        .replace(", stop_reason=None", "")
        .replace(", keep_logprobs=False", "")
        for line in (re.sub(r"(prm_wait_seconds=[^,)]*), logprobs=None\)", r"\1)", x) for x in log)
    )
    assert (len(log), hashlib.sha256(text.encode()).hexdigest()) == (COMMANDS, DIGEST)
