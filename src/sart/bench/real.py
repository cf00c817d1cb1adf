"""Benchmarks on a real engine and PRM: prompts from a file, the wall clock, the same report.

The prompt file is JSONL, one request per line: ``{"prompt": "...", "answer": "..."}``
(``answer`` and ``id`` are optional; without answers accuracy is not reported).
Requests arrive as a Poisson process at the given rate in real seconds; every
method serves the same prompts with the same arrival times, one after the
other, on the same loaded engine and PRM.

``record_trace`` turns a real run into the simulator's trace format: every
branch runs to its end (no pruning, no early stop) while the PRM scores it
every ``T`` tokens, so the trace holds each branch's length, answer,
per-check rewards and final reward. When the run samples with
``SamplingSettings(logprobs=k)`` and the engine delivers them, it also holds,
per segment of ``logprob_every`` tokens (default ``RECORD_LOGPROB_EVERY`` =
16), the mean logprob of the sampled tokens and their mean token confidence
(DeepConf's ``C_i``: minus the mean of token ``i``'s top-``k`` logprobs;
``k >= 1`` is needed for it), so that the simulator can replay
confidence-based methods (``BranchScript.logprobs`` and ``confidences``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import attrs

from sart.answers import extract_answer
from sart.bench.runner import BenchConfig, RunRecord, method_policy, method_scoring, plan, serve
from sart.bench.trace_lines import MAX_CONFIDENCE, MIN_LOGPROB
from sart.bench.traces import Trace, TraceRequest
from sart.engines.base import BranchDelta, BranchSpec, Engine, EngineStats, StepOutput
from sart.engines.scripts import BranchScript
from sart.errors import ConfigError
from sart.policies.base import Policy, PruneRule
from sart.policies.select import BestReward
from sart.policies.stop import AllDone
from sart.prm.base import PRM
from sart.request import Request
from sart.results import RequestResult
from sart.sync_driver import SyncDriver
from sart.types import BranchId, Prompt, SamplingSettings, Scoring
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
    except UnicodeDecodeError as exc:  # a ValueError: it ended in a traceback
        line = Path(path).read_bytes()[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text") from None
    items: list[PromptItem] = []
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
    done: Collection[tuple[float | None, str, int]] = (),
) -> list[RunRecord]:
    """Every (method, n) of ``config`` at every rate, on ``engine`` and ``prm``, after
    a warm-up of ``WARMUP_REQUESTS`` requests per method. ``policy_for(method, n)``
    builds each method's policy (default: ``method_policy(method, n, config.interval)``).
    The runs in ``done`` (``(rate, method, n)``: finished before, ``sart bench
    --resume``) are left out, and so is the warm-up of a method with none left."""
    assert config.rates is not None  # a real engine's benchmark always has its rates
    gold = {item.id: item.answer for item in items if item.answer is not None}
    policy_for = policy_for or (lambda method, n: method_policy(method, n, config.interval))
    warmup = items[:WARMUP_REQUESTS]
    for method, n in plan(config):
        if all((rate, method, n) in done for rate in config.rates):
            continue
        policy = policy_for(method, n)
        times = [0.0] * len(warmup)
        _serve(warmup, times, method, policy, None, engine, prm, config, sampling, gold)
    records = []
    for rate in config.rates:
        times = arrivals(len(items), rate, config.seed)
        for method, n in plan(config):
            if (rate, method, n) in done:
                continue
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
    return serve(real_driver(engine, prm, config, method), requests, gold, method, policy.n, rate)


def real_driver(engine: Engine, prm: PRM | None, config: BenchConfig, method: str) -> SyncDriver:
    """A driver for one run on a real engine: ``config``'s B (16 if unset), admission and
    polling, and the scoring ``method`` runs with."""
    return SyncDriver(
        engine,
        prm,
        batch_size=config.batch_size or 16,
        admission=config.admission,
        scoring=method_scoring(method, config),
        poll_steps=config.poll_steps,
    )


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


#: Tokens per segment of the log-probabilities a recording keeps.
RECORD_LOGPROB_EVERY = 16
#: Top log-probabilities a recording asks for per token (DeepConf's k).
RECORD_TOP_LOGPROBS = 20


def recording_sampling(sampling: SamplingSettings) -> SamplingSettings:
    """``sampling`` for a recorded pass: with the policy's top-``RECORD_TOP_LOGPROBS``
    log-probabilities unless it asks for some already, so that the recording replays
    the confidence methods too (their cost falls on that one pass)."""
    if sampling.logprobs is not None:
        return sampling
    return attrs.evolve(sampling, logprobs=RECORD_TOP_LOGPROBS)


class _Segments:
    """One branch's log-probabilities so far, as per-segment sums."""

    __slots__ = ("complete", "confidences", "logprobs", "tokens", "with_top")

    def __init__(self) -> None:
        self.tokens = 0
        self.logprobs: list[float] = []
        self.confidences: list[float] = []
        self.complete = True  # every token came with its logprobs
        self.with_top = True  # ... and with top-k values (k >= 1)


class LogprobRecorder:
    """An engine that passes every call to ``engine`` and keeps, from the deltas of its
    ``step`` calls, each branch's per-segment sums of the sampled tokens' logprobs and
    of their token confidences (minus the mean of the top-``k`` logprobs).

    Logprobs are clamped to the trace's range, [``MIN_LOGPROB``, 0], before they are
    summed: a token given probability 0 reports ``-inf``, which counts as
    ``MIN_LOGPROB`` (and so does a NaN)."""

    def __init__(self, engine: Engine, every: int = RECORD_LOGPROB_EVERY) -> None:
        if not (isinstance(every, int) and every >= 1):
            raise ConfigError(f"logprob_every={every!r} must be >= 1")
        self.engine = engine
        self.every = every
        self._branches: dict[BranchId, _Segments] = {}

    def __getattr__(self, name: str) -> Any:
        # Optional capabilities and attributes: clock, supports_fork, prefixes, usage...
        if name == "engine":  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        return self.engine.prefill(request_id, prompt, sampling)

    def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        self.engine.start_branches(request_id, branches)

    def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        output = self.engine.step(max_steps, until_first_end)
        for bid, delta in output.deltas.items():
            self._add(self._branches.setdefault(bid, _Segments()), delta)
        return output

    def abort(self, branch_ids: Sequence[BranchId]) -> None:
        self.engine.abort(branch_ids)

    def release_prefix(self, request_id: str) -> None:
        self.engine.release_prefix(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _add(self, seg: _Segments, delta: BranchDelta) -> None:
        logprobs, new_tokens = delta.logprobs, delta.new_tokens
        if len(logprobs) != new_tokens:
            seg.complete = False
        if not seg.complete:
            seg.tokens += new_tokens
            return
        every, lps, confs = self.every, seg.logprobs, seg.confidences
        for pos, token in enumerate(logprobs, seg.tokens):
            j = pos // every
            if j == len(lps):
                lps.append(0.0)
                confs.append(0.0)
            lp = token.logprob
            lps[j] += lp if MIN_LOGPROB <= lp <= 0.0 else _clamp(lp)
            top = token.top
            if not top:
                seg.with_top = False
                continue
            total = sum(top)
            if not len(top) * MIN_LOGPROB <= total <= 0.0:  # -inf, NaN or > 0 among them
                total = sum(_clamp(v) for v in top)
            confs[j] -= total / len(top)
        seg.tokens += new_tokens

    def fields(self, branch: BranchId, num_tokens: int) -> dict[str, Any]:
        """``BranchScript`` fields for ``branch`` (``logprobs``, ``confidences``,
        ``logprob_every``): the per-segment means, rounded to 4 decimals. Empty if
        some token of its ``num_tokens`` came without logprobs; no confidences if
        some came without top values."""
        seg = self._branches.get(branch)
        if seg is None or not seg.complete or seg.tokens != num_tokens or not num_tokens:
            return {}
        full = len(seg.logprobs) - 1  # segments of `every` tokens; the last may be shorter
        sizes = [self.every] * full + [num_tokens - self.every * full]
        out: dict[str, Any] = {
            "logprobs": tuple(min(0.0, round(s / n, 4)) for s, n in zip(seg.logprobs, sizes)),
            "logprob_every": self.every,
        }
        if seg.with_top:
            out["confidences"] = tuple(
                min(MAX_CONFIDENCE, max(0.0, round(s / n, 4)))
                for s, n in zip(seg.confidences, sizes)
            )
        return out


def _clamp(logprob: float) -> float:
    """A logprob in [``MIN_LOGPROB``, 0]; NaN counts as ``-inf``."""
    return 0.0 if logprob > 0.0 else logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def trace_request(
    item: PromptItem,
    result: RequestResult,
    engine: Engine,
    interval: int,
    arrival: float,
    logprobs: LogprobRecorder | None = None,
    max_tokens: int | None = None,
) -> TraceRequest:
    """One recorded request as a trace line (``ConfigError`` if it failed); with the
    branches' per-segment log-probabilities that ``logprobs`` recorded, if given, and
    the token cap they were generated under."""
    if not result.ok:
        raise ConfigError(f"recording failed for {item.id!r}: {result.reason}")
    branches = tuple(
        BranchScript(
            length=b.num_tokens,
            answer=b.answer if b.answer is not None else extract_answer(""),
            rewards=tuple(r for tokens, r in b.reward_history if tokens < b.num_tokens),
            final_reward=b.reward,
            filler="",
            **(logprobs.fields(BranchId(item.id, b.index), b.num_tokens) if logprobs else {}),
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
        max_tokens=max_tokens,
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
    *,
    logprob_every: int = RECORD_LOGPROB_EVERY,
) -> Trace:
    """Serve every prompt with ``n`` branches run to their end, scored every ``interval``
    tokens, and return what happened as a trace (see the module docstring). With
    ``sampling.logprobs`` set, each branch's log-probabilities are recorded per segment
    of ``logprob_every`` tokens."""
    policy = recording_policy(n, interval)
    times = arrivals(len(items), rate, seed)
    requests = [
        Request(item.id, item.prompt, policy, sampling=sampling, arrival=t)
        for item, t in zip(items, times)
    ]
    recorder = LogprobRecorder(engine, logprob_every) if sampling.logprobs is not None else None
    results = recording_driver(recorder or engine, prm, max(n, 1) * 2).run(requests)
    return Trace.of(
        trace_request(item, result, engine, interval, t, recorder, sampling.max_tokens)
        for item, t, result in zip(items, times, results)
    )


def _prompt_tokens(engine: Engine, prompt: str) -> int:
    tokenizer = getattr(engine, "tokenizer", None)
    return len(tokenizer(prompt)["input_ids"]) if tokenizer is not None else len(prompt.split())
