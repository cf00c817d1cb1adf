"""The SART scheduler: Algorithm 1 of the paper as a pure, deterministic state machine.

It decides and never acts: ``Scheduler.next_commands(now)`` returns the
commands a driver must carry out (prefill, start branches, decode, score,
pause, abort, release a prefix, finish a request) and ``handle(events, now)``
takes one event per command. It performs no I/O and imports no engine, so the
same code runs under the fake engine in property tests and under vLLM in
production.

One cycle, for a batch budget ``B`` (branches)::

    admit   fill free slots from the branch queue, then prefill the next
            request, whose ``n`` branches join the branch queue
    decode  every running branch, for up to ``T`` steps
    score   (if a policy needs it) completed branches, and running branches
            of requests whose check is due
    check   per request: phase change at the first completion, count
            completions, prune, and finish the request when its stop rule
            says so or when no branch is left; finishing stops the rest
            of its branches, releases their KV and then the shared prefix.

With ``Admission.TOKEN`` a decode returns as soon as any branch ends, so its
slot is refilled at the next step; pruning still happens every ``T`` steps.

The package, one job per module:

``algorithm``
    The per-request part of Algorithm 1 -- a request's check (phase change,
    completions, prune, fork, stop) and its answer -- readable next to the paper.
``core``
    ``Scheduler``: intake, ``next_commands`` / ``handle``, and the wiring of the rest.
``waiting``
    The request and branch queues and the one admission order: FCFS with one
    priority level, most urgent first (priority with aging) with several, and
    how many branches to pause for more urgent work.
``checks``
    The check queue: snapshots, what each check scores, and blocking vs
    overlapped scoring (up to ``max_scores`` ``Score`` commands in flight).
``slots``
    The batch budget: running, reserved and unaborted branches; abort retries.
``cancels``
    Cancels asked for and deadlines come due.
``hooks``
    Policy hooks called safely: a broken rule fails its request alone.
``config``
    ``SchedulerConfig`` and ``SchedulerStats``.
"""

from sart.scheduler.config import SchedulerConfig, SchedulerStats
from sart.scheduler.core import Scheduler

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats"]
