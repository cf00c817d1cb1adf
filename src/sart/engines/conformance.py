"""``check_engine``: the conformance suite every engine adapter must pass.

Like Gymnasium's ``check_env``: call it from your adapter's tests with a
factory that builds a fresh engine. It drives the engine through the contract
in ``sart.engines.base`` and raises ``AssertionError`` with a message saying
which rule broke.

Besides the life of well-behaved requests (prefill, branches, steps, aborts,
release, determinism, forks), it checks misuse: every call out of contract
(a second prefill, starting an index twice, aborting a branch that is not
live, releasing an unknown prefix, ...) must be refused -- with an
``EngineError`` naming only the request involved, or ``EngineMisuse`` from a
strict test engine -- must change nothing, and must leave the engine serving
its other requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sart.engines.base import BranchSpec, Engine, StepOutput, supports_fork
from sart.errors import EngineError, EngineMisuse
from sart.types import BranchId, FinishReason, Prompt, SamplingSettings


def check_engine(
    factory: Callable[[], Engine],
    *,
    prompts: Sequence[Prompt] = ("What is 2 + 2?", "Name a prime number larger than ten."),
    max_tokens: int = 8,
    num_branches: int = 3,
) -> None:
    """Check the engine contract on engines made by ``factory`` (called up to three times).

    ``prompts`` must hold two prompts of different lengths, so that batching
    across requests with different prefixes is exercised.
    """
    if len(prompts) < 2:
        raise ValueError("check_engine needs two prompts")
    if num_branches < 2:
        raise ValueError("check_engine needs num_branches >= 2")
    sampling = SamplingSettings(temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=1234)
    texts = _check_lifecycle(factory(), prompts, sampling, num_branches)
    again = _check_lifecycle(factory(), prompts, sampling, num_branches)
    _require(texts == again, "same prompts and seeds must give the same text on a fresh engine")
    _check_until_first_end(factory(), prompts[0], sampling, num_branches)
    _check_misuse(factory(), prompts[0], sampling)
    engine = factory()
    if supports_fork(engine):
        _check_fork(engine, prompts[0], sampling)


def _require(ok: bool, rule: str) -> None:
    if not ok:
        raise AssertionError(f"engine contract: {rule}")


def _check_step(
    out: StepOutput,
    max_steps: int,
    live: set[BranchId],
    max_tokens: int,
    tokens: dict[BranchId, int],
) -> set[BranchId]:
    """Check one step's output against the live set; return the branches it ended."""
    _require(isinstance(out, StepOutput), f"step() must return a StepOutput, got {out!r}")
    _require(0 <= out.steps <= max_steps, f"step({max_steps}) ran {out.steps} steps")
    advanced = out.request_steps  # requests that advance independently (per_request_steps)
    if advanced is not None:
        _require(
            out.steps == max(advanced.values(), default=0),
            f"step() ran {out.steps} steps, not its requests' most: {dict(advanced)}",
        )
    ended: set[BranchId] = set()
    for bid, delta in out.deltas.items():
        _require(bid in live, f"step() reported branch {bid}, which is not live")
        steps = out.steps if advanced is None else advanced.get(bid.request_id, 0)
        _require(
            0 <= delta.new_tokens <= steps,
            f"branch {bid} made {delta.new_tokens} tokens in {steps} steps",
        )
        tokens[bid] = tokens.get(bid, 0) + delta.new_tokens
        _require(tokens[bid] <= max_tokens, f"branch {bid} exceeded max_tokens={max_tokens}")
        if delta.finish is not None:
            _require(
                delta.end_offset is not None and 1 <= delta.end_offset <= steps,
                f"branch {bid} ended with end_offset={delta.end_offset} in {steps} steps",
            )
            if delta.finish is FinishReason.LENGTH:
                _require(
                    tokens[bid] == max_tokens,
                    f"branch {bid} truncated at {tokens[bid]} tokens, not max_tokens",
                )
            ended.add(bid)
    still = live - ended
    if still and not ended and advanced is None:  # independent requests may return sooner
        _require(
            out.steps == max_steps,
            f"step({max_steps}) returned after {out.steps} steps with no branch ended",
        )
    if not still:
        last = max((d.end_offset or 0) for d in out.deltas.values()) if out.deltas else 0
        _require(out.steps == last, "step() must return as soon as every branch has ended")
    return ended


def _check_lifecycle(
    engine: Engine, prompts: Sequence[Prompt], sampling: SamplingSettings, k: int
) -> dict[BranchId, str]:
    base = engine.stats()
    _require(base.live_branches == 0, "a fresh engine has no live branches")
    rids = ["conf-a", "conf-b"]
    for rid, prompt in zip(rids, prompts):
        n = engine.prefill(rid, prompt, sampling)
        _require(isinstance(n, int) and n >= 1, f"prefill must return the prompt length, got {n!r}")
    seed = sampling.seed or 0
    engine.start_branches(rids[0], [BranchSpec(j, seed + j) for j in range(k)])
    engine.start_branches(rids[1], [BranchSpec(j, seed + 100 + j) for j in range(k)])
    live = {BranchId(r, j) for r in rids for j in range(k)}
    _require(
        engine.stats().live_branches == len(live),
        f"stats().live_branches should be {len(live)} after starting them",
    )
    texts = {bid: "" for bid in live}
    tokens: dict[BranchId, int] = {}

    out = engine.step(1)
    live -= _check_step(out, 1, live, sampling.max_tokens, tokens)
    for bid, delta in out.deltas.items():
        texts[bid] += delta.text
    _require(engine.stats().kv_tokens > base.kv_tokens, "KV tokens must grow while decoding")

    victim = BranchId(rids[0], 0)
    if victim in live:
        before = engine.stats().live_branches
        engine.abort([victim])
        live.discard(victim)
        _require(engine.stats().live_branches == before - 1, "abort() must free the branch now")

    for _ in range(sampling.max_tokens + 1):
        if not live:
            break
        out = engine.step(3)
        for bid, delta in out.deltas.items():
            texts[bid] += delta.text
        live -= _check_step(out, 3, live, sampling.max_tokens, tokens)
    _require(not live, f"branches {sorted(live)} never ended within max_tokens")
    _require(engine.stats().live_branches == 0, "ended branches must not stay live")
    for rid in rids:
        engine.release_prefix(rid)
    end = engine.stats()
    _require(
        end.kv_tokens == base.kv_tokens,
        f"KV tokens should return to {base.kv_tokens} after release, got {end.kv_tokens}",
    )
    texts.pop(victim, None)
    return texts


def _check_until_first_end(
    engine: Engine, prompt: Prompt, sampling: SamplingSettings, k: int
) -> None:
    engine.prefill("conf-c", prompt, sampling)
    engine.start_branches("conf-c", [BranchSpec(j, (sampling.seed or 0) + j) for j in range(k)])
    live = {BranchId("conf-c", j) for j in range(k)}
    tokens: dict[BranchId, int] = {}
    while live:
        out = engine.step(sampling.max_tokens + 1, until_first_end=True)
        ended = _check_step(out, sampling.max_tokens + 1, live, sampling.max_tokens, tokens)
        _require(bool(ended), "step(until_first_end=True) must run until a branch ends")
        _require(
            all(out.deltas[b].end_offset == out.steps for b in ended),
            "step(until_first_end=True) must return at the first end",
        )
        live -= ended
    engine.release_prefix("conf-c")
    _require(engine.stats().live_branches == 0, "no branch may stay live")


def _check_fork(engine: Engine, prompt: Prompt, sampling: SamplingSettings) -> None:
    """A fork starts from its live parent's tokens and then runs on its own."""
    sampling = SamplingSettings(
        temperature=1.0, top_p=1.0, seed=7, max_tokens=max(sampling.max_tokens, 8)
    )
    engine.prefill("conf-f", prompt, sampling)
    engine.start_branches("conf-f", [BranchSpec(0, 7)])
    parent = BranchId("conf-f", 0)
    tokens: dict[BranchId, int] = {}
    out = engine.step(1)
    ended = _check_step(out, 1, {parent}, sampling.max_tokens, tokens)
    if ended:  # the parent ended at once: nothing left to fork from
        engine.release_prefix("conf-f")
        return
    before = engine.stats()
    engine.start_branches("conf-f", [BranchSpec(1, 8, parent=0)])
    child = BranchId("conf-f", 1)
    after = engine.stats()
    _require(after.live_branches == before.live_branches + 1, "a fork adds one live branch")
    tokens[child] = tokens[parent]  # the child owns its parent's tokens so far
    live = {parent, child}
    for _ in range(sampling.max_tokens + 1):
        if not live:
            break
        live -= _check_step(engine.step(2), 2, live, sampling.max_tokens, tokens)
    _require(not live, "forked branches must end within max_tokens")
    engine.release_prefix("conf-f")
    _require(engine.stats().live_branches == 0, "no branch may stay live after a fork")


def _check_misuse(engine: Engine, prompt: Prompt, sampling: SamplingSettings) -> None:
    """Calls out of contract are refused, change nothing, and the engine goes on."""
    idle = engine.step(4)
    _require(
        isinstance(idle, StepOutput) and idle.steps == 0 and not idle.deltas,
        f"step() with no live branch must return StepOutput(steps=0, deltas={{}}), got {idle!r}",
    )
    base = engine.stats()
    rid, other = "conf-m", "conf-none"
    engine.prefill(rid, prompt, sampling)
    engine.start_branches(rid, [BranchSpec(0, 11), BranchSpec(1, 12)])
    held = engine.stats()
    cases: list[tuple[str, str, Callable[[], object]]] = [
        ("a second prefill of a held prefix", rid, lambda: engine.prefill(rid, prompt, sampling)),
        (
            "start_branches for a request with no prefix",
            other,
            lambda: engine.start_branches(other, [BranchSpec(0, 1)]),
        ),
        (
            "start_branches of a branch index started before",
            rid,
            lambda: engine.start_branches(rid, [BranchSpec(1, 13)]),
        ),
        (
            "start_branches of one index twice in one call",
            rid,
            lambda: engine.start_branches(rid, [BranchSpec(2, 14), BranchSpec(2, 15)]),
        ),
        (
            "abort of a branch that was never started",
            rid,
            lambda: engine.abort([BranchId(rid, 7)]),
        ),
        (
            "abort of one branch twice in one call",
            rid,
            lambda: engine.abort([BranchId(rid, 0), BranchId(rid, 0)]),
        ),
        ("release_prefix of a request with no prefix", other, lambda: engine.release_prefix(other)),
    ]
    if supports_fork(engine):
        cases.append(
            (
                "a fork from a branch that is not live",
                rid,
                lambda: engine.start_branches(rid, [BranchSpec(3, 16, parent=7)]),
            )
        )
    for rule, request_id, call in cases:
        _require_refused(rule, request_id, call)
        _require(engine.stats() == held, f"a refused {rule} must change nothing")
    # Still serving: the request's branches run to their end and its prefix is freed.
    live = {BranchId(rid, 0), BranchId(rid, 1)}
    tokens: dict[BranchId, int] = {}
    for _ in range(sampling.max_tokens + 1):
        if not live:
            break
        live -= _check_step(engine.step(3), 3, live, sampling.max_tokens, tokens)
    _require(not live, "after refused calls, the request's branches must still run to their end")
    engine.release_prefix(rid)
    end = engine.stats()
    _require(
        (end.live_branches, end.kv_tokens) == (base.live_branches, base.kv_tokens),
        "after refused calls, releasing the request must free everything it held",
    )


def _require_refused(rule: str, request_id: str, call: Callable[[], object]) -> None:
    try:
        call()
    except EngineMisuse:  # a strict test engine: a bug in the caller
        return
    except EngineError as exc:
        _require(
            exc.request_ids == {request_id},
            f"{rule} must fail only request {request_id!r}, not {sorted(exc.request_ids)}",
        )
        return
    except Exception as exc:
        raise AssertionError(
            f"engine contract: {rule} must raise EngineError naming {request_id!r}, not {exc!r}"
        ) from exc
    raise AssertionError(f"engine contract: {rule} must be refused")
