"""Benchmarks on a real engine and PRM: prompts from a file, the wall clock, the same report.

The prompt file is JSONL, one request per line: ``{"prompt": "...", "answer": "..."}``
(``answer`` and ``id`` are optional; without answers accuracy is not reported).
Requests arrive as a Poisson process at the given rate in real seconds; every
method serves the same prompts with the same arrival times, one after the
other, on the same loaded engine and PRM.

``record_trace`` turns a real run into the simulator's trace format: every
branch runs to its end (no pruning, no early stop) while the PRM scores it
every ``T`` tokens, so the trace holds each branch's length, answer,
per-check rewards and final reward.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from sart.answers import extract_answer
from sart.bench.runner import METHODS, BenchConfig, RunRecord, method_scoring, plan, serve
from sart.bench.traces import Trace, TraceRequest
from sart.driver import SyncDriver
from sart.engines.base import Engine
from sart.engines.scripts import BranchScript
from sart.errors import ConfigError
from sart.policies.base import Policy, PruneRule
from sart.policies.select import BestReward
from sart.policies.stop import AllDone
from sart.prm.base import PRM
from sart.request import Request
from sart.results import RequestResult
from sart.types import SamplingSettings, Scoring
from sart.views import RequestView

#: ``(method, n) -> Policy``: how a run builds each method's policy.
PolicyFactory = Callable[[str, int], Policy]


@attrs.frozen
class PromptItem:
    id: str
    prompt: str
    answer: str | None = None


def load_prompts(path: str | Path) -> list[PromptItem]:
    """Read a JSONL prompt file (see the module docstring)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"prompts={str(path)!r}: {exc.strerror}") from exc
    items = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
            prompt = line["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{number}: needs a JSON object with 'prompt'") from exc
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"{path}:{number}: 'prompt' must be a non-empty string")
        answer = line.get("answer")
        items.append(
            PromptItem(
                str(line.get("id", f"p{len(items)}")),
                prompt,
                None if answer is None else str(answer),
            )
        )
    if not items:
        raise ConfigError(f"prompts={str(path)!r} holds no prompts")
    return items


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds) for ``count`` requests at ``rate`` per second."""
    rng = random.Random(f"arrivals/{seed}/{rate}")
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


#: Requests served (all at once, results dropped) with every method before the
#: measured runs: the first calls of an engine or a PRM pay one-off costs (vLLM's
#: first steps, torch's first kernels) that would otherwise land on whichever
#: method happens to run first.
WARMUP_REQUESTS = 4


def run_real(
    items: Sequence[PromptItem],
    engine: Engine,
    prm: PRM | None,
    config: BenchConfig,
    sampling: SamplingSettings,
    on_run: Callable[[RunRecord], object] | None = None,
    policy_for: PolicyFactory | None = None,
) -> list[RunRecord]:
    """Every (method, n) of ``config`` at every rate, on ``engine`` and ``prm``, after
    a warm-up of ``WARMUP_REQUESTS`` requests per method. ``policy_for(method, n)``
    builds each method's policy (default: ``METHODS[method](n, config.interval)``)."""
    gold = {item.id: item.answer for item in items if item.answer is not None}
    policy_for = policy_for or (lambda method, n: METHODS[method](n, config.interval))
    warmup = items[:WARMUP_REQUESTS]
    for method, n in plan(config):
        policy = policy_for(method, n)
        times = [0.0] * len(warmup)
        _serve(warmup, times, method, policy, None, engine, prm, config, sampling, gold)
    records = []
    for rate in config.rates:
        times = arrivals(len(items), rate, config.seed)
        for method, n in plan(config):
            policy = policy_for(method, n)
            record = _serve(items, times, method, policy, rate, engine, prm, config, sampling, gold)
            records.append(record)
            if on_run is not None:
                on_run(record)
    return records


def _serve(
    items: Sequence[PromptItem],
    times: Sequence[float],
    method: str,
    policy: Policy,
    rate: float | None,
    engine: Engine,
    prm: PRM | None,
    config: BenchConfig,
    sampling: SamplingSettings,
    gold: dict[str, str],
) -> RunRecord:
    requests = [
        Request(item.id, item.prompt, policy, sampling=sampling, arrival=t)
        for item, t in zip(items, times)
    ]
    driver = SyncDriver(
        engine,
        prm,
        batch_size=config.batch_size or 16,
        admission=config.admission,
        scoring=method_scoring(method, config),
        poll_steps=config.poll_steps,
    )
    return serve(driver, requests, gold, method, policy.n, rate)


class _ScoreEveryCheck(PruneRule):
    """Prunes nothing but asks for every running branch's reward at every check."""

    def choose(self, request: RequestView) -> list[int]:
        return []


def recording_policy(
    n: int, interval: int, extract: Callable[[str], str] = extract_answer
) -> Policy:
    """The policy of a recorded pass: ``n`` branches, each run to its end (no pruning, no
    early stop), every running branch scored every ``interval`` tokens; a branch's
    answer is ``extract(text)``."""
    return Policy(
        n=n,
        stop=AllDone(),
        prune=_ScoreEveryCheck(),
        select=BestReward(),
        interval=interval,
        extract=extract,
        name="record",
    )


def recording_driver(engine: Engine, prm: PRM, batch_size: int, **kwargs: Any) -> SyncDriver:
    """A driver for a recorded pass. Blocking checks: each check then scores the branches
    at exactly ``k * interval`` tokens, where a trace's rewards are read back (an
    overlapped check may come later)."""
    return SyncDriver(engine, prm, batch_size=batch_size, scoring=Scoring.BLOCKING, **kwargs)


def trace_request(
    item: PromptItem, result: RequestResult, engine: Engine, interval: int, arrival: float
) -> TraceRequest:
    """One recorded request as a trace line (``ConfigError`` if it failed)."""
    if not result.ok:
        raise ConfigError(f"recording failed for {item.id!r}: {result.reason}")
    branches = tuple(
        BranchScript(
            length=b.num_tokens,
            answer=b.answer if b.answer is not None else extract_answer(""),
            rewards=tuple(r for tokens, r in b.reward_history if tokens < b.num_tokens),
            final_reward=b.reward,
            filler="",
        )
        for b in result.branches
    )
    return TraceRequest(
        id=item.id,
        arrival=round(arrival, 6),
        answer=item.answer or "",
        branches=branches,
        prompt_tokens=_prompt_tokens(engine, item.prompt),
        interval=interval,
    )


def record_trace(
    items: Sequence[PromptItem],
    engine: Engine,
    prm: PRM,
    n: int,
    interval: int,
    sampling: SamplingSettings,
    rate: float,
    seed: int = 0,
) -> Trace:
    """Serve every prompt with ``n`` branches run to their end, scored every ``interval``
    tokens, and return what happened as a trace (see the module docstring)."""
    policy = recording_policy(n, interval)
    times = arrivals(len(items), rate, seed)
    requests = [
        Request(item.id, item.prompt, policy, sampling=sampling, arrival=t)
        for item, t in zip(items, times)
    ]
    results = recording_driver(engine, prm, max(n, 1) * 2).run(requests)
    return Trace.of(
        trace_request(item, result, engine, interval, t)
        for item, t, result in zip(items, times, results)
    )


def _prompt_tokens(engine: Engine, prompt: str) -> int:
    tokenizer = getattr(engine, "tokenizer", None)
    return len(tokenizer(prompt)["input_ids"]) if tokenizer is not None else len(prompt.split())
