"""``sart serve`` in this process, on scripted engines: policies from request fields,
disconnects, the bounded queue, limits and failures.

A server runs on 127.0.0.1 in a thread (uvicorn, the real app); clients are the
official ``openai`` client and ``httpx``. The engines are sart's public
``FakeEngine`` made slow (a wall-clock sleep per decode step), so that a request
is still running when its client leaves. The testbed model behind the
``sart serve`` command is in ``tests/test_serve_testbed.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from importlib.util import find_spec

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

import sart  # noqa: E402
from sart.engines.streaming import Chunk, StreamingEngine  # noqa: E402
from sart.engines.sync_bridge import SyncBridge  # noqa: E402
from sart.errors import ConfigError, EngineError  # noqa: E402
from sart.serve import Backend, ServeConfig, create_app, register_method  # noqa: E402
from sart.serve.engine import ServingEngine  # noqa: E402
from sart.serve.methods import PolicyFields, build_policy  # noqa: E402
from sart.serve.metrics import SavedTokens  # noqa: E402
from sart.serve.protocol import CompletionRequest, Refused, parse, policy_fields  # noqa: E402
from sart.testing import (  # noqa: E402
    BranchScript,
    FakeEngine,
    FakeStreamingEngine,
    check_engine,
)
from serving import Served, scripted_apps  # noqa: E402

MODEL = "fake"


class SlowEngine(FakeEngine):
    """``FakeEngine`` whose decode steps take wall-clock time; a prompt's first word sets
    its branches' length (``"long"``: more than any test waits for), ``"boom"`` fails
    the prefill."""

    def __init__(self, seconds_per_step: float = 0.002) -> None:
        super().__init__(self._script)
        self.seconds_per_step = seconds_per_step
        self.prompts: dict[str, object] = {}
        self.prefilled: list[str] = []
        self.aborted: list[sart.BranchId] = []

    def _script(self, branch: sart.BranchId) -> BranchScript:
        prompt = self.prompts[branch.request_id]
        length = 10**6 if str(prompt).startswith("long") else 12 + branch.index
        return BranchScript(length=length, answer=str(branch.index % 2), rewards=(0.9,))

    def prefill(self, request_id, prompt, sampling):  # type: ignore[no-untyped-def]
        if prompt == "boom":
            raise EngineError("the engine refused this prompt", request_ids=[request_id])
        self.prompts[request_id] = prompt
        self.prefilled.append(request_id)
        return super().prefill(request_id, prompt, sampling)

    def step(self, max_steps, until_first_end=False):  # type: ignore[no-untyped-def]
        output = super().step(min(max_steps, 4), until_first_end)
        time.sleep(self.seconds_per_step * output.steps)
        return output

    def abort(self, branch_ids):  # type: ignore[no-untyped-def]
        self.aborted.extend(branch_ids)
        super().abort(branch_ids)


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    with scripted_apps(MODEL) as start:

        def slow(engine: SlowEngine | None = None, **settings: object) -> Served:
            return start(engine or SlowEngine(), **settings)

        yield slow


def body(prompt: str = "short", **fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, **fields}


def stream_long(served: Served, timeout: float) -> contextlib.AbstractContextManager:
    """A streamed SART request of 3 branches that outlast any test, opened with httpx."""
    return httpx.stream(
        "POST",
        f"{served.url}/v1/completions",
        json={**body("long", method="sart", n=3), "stream": True},
        headers={"Authorization": "Bearer key"},
        timeout=timeout,
    )


def leave_after(served: Served, seconds: float) -> None:
    """A client that sends a long request and leaves after ``seconds``."""
    with pytest.raises(httpx.ReadTimeout):
        served.post("/v1/completions", body("long", method="vanilla"), timeout=seconds)


# ------------------------------------------------------------------ policies from fields


def test_a_method_and_its_fields_build_the_policy() -> None:
    def policy(**fields: object) -> tuple[str, sart.Policy]:
        return build_policy(
            PolicyFields(**fields),  # type: ignore[arg-type]
            method="sart",
            n=8,
            max_n=16,
            interval=16,
        )

    name, p = policy()
    assert (name, p.n, p.interval, p.name) == ("sart", 8, 16, "sart(n=8,m=4)")
    name, p = policy(method="sart", n=6, m=2, alpha=0.3, beta=1, interval=5)
    assert (p.n, p.interval, p.stop.m, p.prune.alpha, p.prune.beta) == (6, 5, 2, 0.3, 1)
    assert policy(method="vanilla")[1].n == 1  # the server's default n does not apply
    name, p = policy(method="sart-adaptive", n=8, m=2)
    assert (name, p.n, p.name) == ("sart-adaptive", 8, "sart-adaptive(n=2..8)")
    assert isinstance(p.admit, sart.BranchByLoad)  # its n is a ceiling, settled by load
    name, p = policy(method="sc", n=4, selector="weighted")
    assert isinstance(p.select, sart.WeightedVote) and p.name.endswith("select=weighted")
    refusals = {
        "method='best'": dict(method="best"),
        "n=17 must be <= 16": dict(n=17),
        "n=2 must be 1: method 'vanilla'": dict(method="vanilla", n=2),
        "alpha=0.2 does not apply to method 'sc'": dict(method="sc", alpha=0.2),
        "m=9 must be <= n=8": dict(m=9),
        "selector='best' must be one of": dict(selector="best"),
        "selector='majority' does not apply": dict(method="vanilla", selector="majority"),
    }
    for message, fields in refusals.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            policy(**fields)


def test_a_registered_method_is_served_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # A copy of the registry, so the method does not outlive the test.
    monkeypatch.setattr(sart.methods, "_METHODS", dict(sart.methods._METHODS))
    register_method("wide-sc", lambda n, interval: sart.self_consistency(2 * n, interval))
    _, p = build_policy(
        PolicyFields(method="wide-sc", n=3), method="sart", n=8, max_n=16, interval=4
    )
    assert p.n == 6


@pytest.mark.parametrize(
    ("fields", "branches"),
    [
        ({}, None),
        ({"n": 1}, None),
        ({"best_of": 4}, 4),
        ({"n": 1, "best_of": 3}, 3),
        ({"method": "sart", "n": 4}, 4),
        ({"method": "sart", "n": 4, "best_of": 4}, 4),
    ],
)
def test_n_is_branches_only_where_the_method_is_named(fields: dict, branches: int) -> None:
    request = parse(CompletionRequest, httpx.Request("POST", "/", json=body(**fields)).content)
    assert policy_fields(request).n == branches


def test_n_above_one_without_a_method_is_refused_not_reinterpreted() -> None:
    for fields, message in [
        ({"n": 3}, "n=3 asks for 3 choices"),
        ({"n": 3, "best_of": 3}, "n=3 asks for 3 choices"),
        ({"method": "sc", "n": 3, "best_of": 4}, "n=3 and best_of=4 disagree"),
    ]:
        request = parse(CompletionRequest, httpx.Request("POST", "/", json=body(**fields)).content)
        with pytest.raises(Refused, match=message):
            policy_fields(request)


def test_server_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="n=9 must be <= max_n=8"):
        ServeConfig(models=("m",), n=9, max_n=8)
    with pytest.raises(ConfigError, match="max_tokens=10 must be <= max_tokens_limit=5"):
        ServeConfig(models=("m",), max_tokens=10, max_tokens_limit=5)
    with pytest.raises(ConfigError, match="models"):
        ServeConfig(models=())
    # Refused where it is set, under its own name, not when the service starts.
    with pytest.raises(ConfigError, match="aging=-1 must be None or a finite number > 0"):
        ServeConfig(models=("m",), aging=-1)
    assert ServeConfig(models=("m",), aging=None).aging is None
    # The same words as a request's own sampling settings (one validator for both),
    # and a bool is no count.
    with pytest.raises(ConfigError, match=r"^temperature=-1 must be a number >= 0$"):
        ServeConfig(models=("m",), temperature=-1)
    with pytest.raises(ConfigError, match=r"^top_p=0 must be a number in \(0, 1\]$"):
        ServeConfig(models=("m",), top_p=0)
    with pytest.raises(ConfigError, match=r"^batch_size=True must be an int >= 1$"):
        ServeConfig(models=("m",), batch_size=True)
    assert "secret" not in repr(ServeConfig(models=("m",), api_key="secret"))


# ------------------------------------------------------------------ the engine and metrics


@pytest.mark.parametrize("inner", [FakeEngine, FakeStreamingEngine])
def test_the_serving_engine_keeps_the_engine_contract(inner: type) -> None:
    check_engine(lambda: SyncBridge(ServingEngine(inner())))


def test_a_cancelled_request_is_refused_by_its_next_engine_call_only() -> None:
    async def main() -> None:
        engine = ServingEngine(FakeEngine(lambda b: BranchScript(length=50)))
        sampling = sart.SamplingSettings(max_tokens=100)
        for rid in ("a", "b"):
            await engine.prefill(rid, "p", sampling)
            await engine.start_branches(rid, [sart.BranchSpec(0, 0), sart.BranchSpec(1, 1)])
        engine.cancel("a")
        engine.cancel("later")
        with pytest.raises(EngineError) as refused:
            await engine.step(4)
        assert refused.value.request_ids == {"a"}  # "later" holds nothing: not refused
        with pytest.raises(EngineError):
            await engine.prefill("later", "p", sampling)
        await engine.abort([sart.BranchId("a", 0), sart.BranchId("a", 1)])
        await engine.release_prefix("a")
        output = await engine.step(4)  # "b" decodes on
        assert {bid.request_id for bid in output.deltas} == {"b"}
        assert engine.stats().live_branches == 2
        engine.close()

    asyncio.run(main())


def test_a_cancelled_requests_refusal_says_why_it_was_cancelled() -> None:
    # Before: a request the shutdown cancelled between two engine calls failed with
    # "the client disconnected" (a CI run's SIGTERM test caught it in a stream's error).
    async def main() -> None:
        engine = ServingEngine(FakeEngine(lambda b: BranchScript(length=50)))
        sampling = sart.SamplingSettings(max_tokens=100)
        for rid in ("a", "b", "c"):
            await engine.prefill(rid, "p", sampling)
        await engine.start_branches("a", [sart.BranchSpec(0, 0)])
        await engine.start_branches("b", [sart.BranchSpec(0, 0)])
        engine.cancel("a", "the server is shutting down")
        engine.cancel("a")  # a later cause does not replace the first
        engine.cancel("b")
        engine.cancel("c", "the server is shutting down")
        with pytest.raises(EngineError, match=r"^the server is shutting down$"):
            await engine.start_branches("c", [sart.BranchSpec(0, 0)])
        with pytest.raises(EngineError, match=r"^the server is shutting down$") as one:
            await engine.step(4)
        assert one.value.request_ids == {"a"}  # one reason per call: b fails at the next
        await engine.abort([sart.BranchId("a", 0)])
        with pytest.raises(EngineError, match=r"^the client disconnected$") as other:
            await engine.step(4)
        assert other.value.request_ids == {"b"}
        engine.close()

    asyncio.run(main())


def test_an_arrival_for_a_free_slot_ends_a_streaming_step_at_once() -> None:
    # Requests on a streaming engine advance independently under the server, and one
    # that arrives while a slot is free does not wait for the step in flight.
    async def main() -> None:
        inner = StallingEngine()
        engine = ServingEngine(inner)
        assert inner.per_request_steps
        sampling = sart.SamplingSettings(max_tokens=100)
        await engine.prefill("a", "a", sampling)
        await engine.start_branches("a", [sart.BranchSpec(0, 0)])
        step = asyncio.ensure_future(engine.step(50))
        await asyncio.sleep(0.05)
        assert not step.done()  # a's stream stalls after one token: nothing to report
        assert engine.live_branches() == 1
        engine.arrived()
        output = await asyncio.wait_for(step, 1)
        assert output.request_steps == {"a": 1}  # what it made, not 50
        await engine.abort([sart.BranchId("a", 0)])
        await engine.release_prefix("a")
        engine.close()

    asyncio.run(main())


def test_a_step_engine_under_the_server_keeps_its_lockstep() -> None:
    bridge = SyncBridge(FakeStreamingEngine())
    ServingEngine(bridge)
    assert not bridge.engine.per_request_steps  # its own loop: not interrupted from ours


class StallingEngine(StreamingEngine):
    """Streams of request ``a`` make one token then stall until aborted; the others make
    ten tokens, slowly, then stop."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled: list[sart.BranchId] = []

    async def _open(self, start):  # type: ignore[no-untyped-def]
        if start.branch.request_id == "a":
            yield Chunk(token_ids=(1,), text="x")
            await asyncio.Event().wait()  # until cancelled
        for _ in range(9):
            await asyncio.sleep(0.01)
            yield Chunk(token_ids=(2,), text="y")
        yield Chunk(token_ids=(3,), text="z", finish=sart.FinishReason.STOP)

    async def _cancel(self, branch: sart.BranchId) -> None:
        self.cancelled.append(branch)


def test_a_cancel_aborts_an_async_engines_branches_during_its_step() -> None:
    async def main() -> None:
        inner = StallingEngine()
        engine = ServingEngine(inner)
        sampling = sart.SamplingSettings(max_tokens=100)
        for rid, width in (("a", 2), ("b", 1)):
            await engine.prefill(rid, "p", sampling)
            await engine.start_branches(rid, [sart.BranchSpec(j, j) for j in range(width)])
        step = asyncio.ensure_future(engine.step(50))
        await asyncio.sleep(0.02)
        assert not step.done()  # a's branches stall it
        engine.cancel("a")
        output = await asyncio.wait_for(step, 5)  # a's branches were aborted meanwhile
        assert sorted(inner.cancelled) == [sart.BranchId("a", 0), sart.BranchId("a", 1)]
        assert {bid.request_id for bid in output.deltas} == {"b"}
        with pytest.raises(EngineError) as refused:
            await engine.step(4)
        assert refused.value.request_ids == {"a"}
        # The driver's abort: already done in the engine, not asked twice.
        await engine.abort([sart.BranchId("a", 0), sart.BranchId("a", 1)])
        await engine.release_prefix("a")
        await engine.release_prefix("b")
        assert inner.stats().live_branches == 0

    asyncio.run(main())


def test_tokens_saved_count_what_longer_completed_branches_ran_past_the_cut() -> None:
    saved = SavedTokens()

    def result(*branches: tuple[sart.BranchStatus, int]) -> sart.RequestResult:
        outcomes = tuple(
            sart.BranchOutcome(i, status, tokens, None, None, None)
            for i, (status, tokens) in enumerate(branches)
        )
        return sart.RequestResult(
            "r", sart.RequestStatus.COMPLETED, 0, "", "", outcomes, sart.Timings(0, 0, 1)
        )

    done, cut = sart.BranchStatus.FINISHED, sart.BranchStatus.PRUNED
    assert saved.add(result((done, 10), (done, 30)), max_tokens=100) == 0  # nothing cut
    # Cut at 20: completed lengths above 20 are 30 and 50, mean 40: 20 more tokens.
    assert saved.add(result((done, 50), (cut, 20)), max_tokens=100) == 20
    # Cut at 60: nothing completed ran longer; nothing is claimed.
    assert saved.add(result((done, 10), (sart.BranchStatus.STOPPED, 60)), max_tokens=100) == 0
    # Lengths count at most to the request's max_tokens: min(50, 40) - 35 = 5.
    assert saved.add(result((done, 10), (cut, 35)), max_tokens=40) == 5


def test_tokens_saved_take_off_what_forks_generated() -> None:
    # rebase, particle, sart-rebranch: a cut branch is replaced by a fork of a better
    # one, whose own tokens running every branch to its end would not have made.
    saved = SavedTokens()
    done, cut = sart.BranchStatus.FINISHED, sart.BranchStatus.PRUNED
    outcomes = (
        sart.BranchOutcome(0, done, 50, None, None, None),
        sart.BranchOutcome(1, cut, 20, None, None, None),  # would have run 30 more
        # Forked from 0 at 20 tokens, when 1 was cut; it generated 30 of its 50.
        sart.BranchOutcome(2, done, 50, None, None, None, parent=0, inherited=20),
        # Forked from 2 and cut in turn, after 5 of its own: it saves nothing of the
        # first branches' run, and costs its 5.
        sart.BranchOutcome(3, cut, 25, None, None, None, parent=2, inherited=20),
    )

    def result(*branches: sart.BranchOutcome) -> sart.RequestResult:
        return sart.RequestResult(
            "r", sart.RequestStatus.COMPLETED, 0, "", "", branches, sart.Timings(0, 0, 1)
        )

    assert saved.add(result(*outcomes), max_tokens=100) == 0  # 30 saved, 30 + 5 forked
    # The same cut with a fork that made 10 tokens: 30 - 10.
    short_fork = sart.BranchOutcome(2, cut, 30, None, None, None, parent=0, inherited=20)
    assert saved.add(result(*outcomes[:2], short_fork), max_tokens=100) == 20


# ------------------------------------------------------------------ serving


def test_the_openai_client_gets_the_chosen_branch_and_every_branchs_outcome(serve) -> None:
    served = serve()
    reply = served.openai().completions.create(
        model=MODEL, prompt="short", extra_body={"method": "sc", "n": 3}
    )
    extension = reply.model_extra["sart"]
    assert [b["status"] for b in extension["branches"]] == ["finished"] * 3
    assert [b["tokens"] for b in extension["branches"]] == [12, 13, 14]
    assert reply.usage.completion_tokens == 12 + 13 + 14  # every branch is paid for
    assert extension["answer"] == "0"  # majority: branches 0 and 2 answer "0"
    assert reply.choices[0].text.endswith("\\boxed{0}")
    assert reply.choices[0].finish_reason == "stop"
    capped = served.openai().completions.create(model=MODEL, prompt="short", max_tokens=5)
    assert capped.choices[0].finish_reason == "length"
    assert {b["status"] for b in capped.model_extra["sart"]["branches"]} <= {
        "truncated",
        "pruned",
        "stopped",
    }


def test_a_clients_request_id_names_its_answer_as_vllms_does(serve) -> None:
    # Before: every answer was cmpl-<random hex> and X-Request-Id was ignored, so a
    # request could not be followed from a client's or a proxy's logs to sart's.
    served = serve()
    client = served.openai()
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="short", extra_headers={"X-Request-Id": "trace-7"}
    )
    assert raw.parse().id == "cmpl-trace-7" and raw.headers["x-request-id"] == "trace-7"
    by_body = client.completions.create(
        model=MODEL, prompt="short", extra_body={"request_id": "b1"}
    )
    assert by_body.id == "cmpl-b1"
    unnamed = client.completions.with_raw_response.create(model=MODEL, prompt="short")
    assert unnamed.parse().id == f"cmpl-{unnamed.headers['x-request-id']}"
    # A client that retries under its id while the first try runs: both are served.
    same = {"X-Request-Id": "again"}
    with httpx.stream(
        "POST",
        f"{served.url}/v1/completions",
        json={**body("long", method="sart", n=2), "stream": True},
        headers={"Authorization": "Bearer key", **same},
        timeout=30,
    ) as first:
        assert first.status_code == 200
        second = client.completions.create(model=MODEL, prompt="short", extra_headers=same)
        assert second.id == "cmpl-again"


def test_a_disconnected_client_has_every_branch_aborted(serve) -> None:
    served = serve()
    engine = served.engine
    with pytest.raises(httpx.ReadTimeout):
        served.post("/v1/completions", body("long", method="sc", n=4), timeout=0.5)
    served.wait_for(lambda: served.metric("sart:requests_total", '{status="cancelled"}') == 1)
    assert engine.stats().live_branches == 0 and not engine.prefixes
    (rid,) = engine.prefilled
    assert sorted(b.index for b in engine.aborted if b.request_id == rid) == [0, 1, 2, 3]
    assert served.metric("sart:branches_failed_total", '{cause="cancelled"}') == 4
    assert served.metric("sart:engine_live_branches") == 0
    # Nothing else is disturbed: the server serves on.
    reply = served.openai().completions.create(model=MODEL, prompt="short")
    assert reply.model_extra["sart"]["answer"] is not None


def test_a_request_past_its_timeout_is_aborted_and_answered_504(serve) -> None:
    served = serve()
    engine = served.engine
    client = served.openai()
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(
            model=MODEL, prompt="long", extra_body={"method": "sc", "n": 3, "timeout": 0.3}
        )
    assert info.value.status_code == 504
    assert "timed out: not finished within timeout=0.3" in str(info.value)
    assert engine.stats().live_branches == 0 and not engine.prefixes
    assert served.metric("sart:requests_total", '{status="timeout"}') == 1
    assert served.metric("sart:branches_failed_total", '{cause="timeout"}') == 3
    # Streamed: the error event after the keep-alives.
    stream = client.completions.create(
        model=MODEL, prompt="long", stream=True, extra_body={"method": "sc", "timeout": 0.3}
    )
    with pytest.raises(openai.APIError, match="timed out"):
        list(stream)
    served.wait_for(lambda: served.metric("sart:requests_total", '{status="timeout"}') == 2)
    # A request that finishes in time is not touched by its timeout.
    reply = client.completions.create(model=MODEL, prompt="short", extra_body={"timeout": 60})
    assert reply.model_extra["sart"]["answer"] is not None
    for bad in (0, -1, "soon"):
        with pytest.raises(openai.BadRequestError, match="timeout"):
            client.completions.create(model=MODEL, prompt="short", extra_body={"timeout": bad})


def test_a_disconnected_stream_has_every_branch_aborted(serve) -> None:
    served = serve(keepalive=0.05)
    engine = served.engine
    with stream_long(served, timeout=10) as stream:
        lines = stream.iter_lines()
        assert next(lines) == ": keep-alive"  # undecided: the stream is kept alive
    served.wait_for(lambda: served.metric("sart:requests_total", '{status="cancelled"}') == 1)
    assert engine.stats().live_branches == 0
    assert len(engine.aborted) == 3


def test_a_request_cut_by_the_shutdown_is_counted_as_such_not_as_a_leaver(serve) -> None:
    # Before: counted cancelled, whose help says the client disconnected.
    served = serve(keepalive=0.05)
    service = served.server.config.app.state.service
    with stream_long(served, timeout=10) as stream:
        lines = stream.iter_lines()
        assert next(lines) == ": keep-alive"  # it runs
        loop = service._task.get_loop()
        asyncio.run_coroutine_threadsafe(service.drain(0.0), loop).result(10)
        assert "the server is shutting down" in "".join(lines)
    served.wait_for(lambda: served.metric("sart:requests_total", '{status="shutdown"}') == 1)
    assert served.metric("sart:requests_total", '{status="cancelled"}') == 0
    assert served.metric("sart:branches_failed_total", '{cause="shutdown"}') == 3
    assert served.engine.stats().live_branches == 0


def test_by_default_a_stream_sends_no_keep_alive_and_a_leaver_is_still_noticed(serve) -> None:
    # No comments unless asked (vLLM's own bench client loses the event after one).
    assert ServeConfig(models=(MODEL,)).keepalive is None
    served = serve()
    with stream_long(served, timeout=0.5) as stream:
        with pytest.raises(httpx.ReadTimeout):  # undecided: nothing is sent, not a comment
            next(stream.iter_lines())
    served.wait_for(lambda: served.metric("sart:requests_total", '{status="cancelled"}') == 1)
    assert served.engine.stats().live_branches == 0
    assert len(served.engine.aborted) == 3


def test_a_request_cancelled_while_queued_never_reaches_the_engine(serve) -> None:
    served = serve(batch_size=1)
    blocker = threading.Thread(target=leave_after, args=(served, 1.5))
    blocker.start()
    served.wait_for(lambda: served.metric("sart:num_requests_running") == 1)
    with pytest.raises(httpx.ReadTimeout):  # waits behind the blocker, then leaves
        served.post("/v1/completions", body("short", method="vanilla"), timeout=0.3)
    # It leaves the queue at once, not when the blocker's slot frees.
    served.wait_for(lambda: served.metric("sart:requests_total", '{status="cancelled"}') == 1)
    assert blocker.is_alive() and served.metric("sart:num_requests_waiting") == 0
    blocker.join()
    served.wait_for(lambda: served.metric("sart:requests_total", '{status="cancelled"}') == 2)
    assert len(served.engine.prefilled) == 1  # only the blocker was ever prefilled
    assert served.engine.stats().live_branches == 0


def test_past_the_queue_limit_requests_get_429_at_once(serve) -> None:
    served = serve(batch_size=1, max_queue=1)
    clients = [threading.Thread(target=leave_after, args=(served, 1.5)) for _ in range(2)]
    clients[0].start()
    served.wait_for(lambda: served.metric("sart:num_requests_running") == 1)
    clients[1].start()
    served.wait_for(lambda: served.metric("sart:num_requests_waiting") == 1)
    start = time.monotonic()
    with pytest.raises(openai.RateLimitError, match="max-queue"):
        served.openai().completions.create(model=MODEL, prompt="short")
    assert time.monotonic() - start < 1.0
    for client in clients:
        client.join()
    assert served.metric("sart:requests_rejected_total", '{code="429"}') == 1


def test_an_engine_failure_fails_its_request_only(serve, caplog) -> None:
    served = serve()
    with pytest.raises(openai.InternalServerError, match="the engine refused this prompt"):
        served.openai().completions.create(model=MODEL, prompt="boom")
    assert served.openai().completions.create(model=MODEL, prompt="short").choices[0].text
    assert served.metric("sart:requests_total", '{status="failed"}') == 1
    # The reason is logged too: a streaming client may never read the error event.
    failed = [r for r in caplog.records if r.name == "sart.serve"]
    assert len(failed) == 1 and failed[0].levelname == "WARNING"
    assert "the engine refused this prompt" in failed[0].getMessage()
    assert "(HTTP 500)" in failed[0].getMessage()
    # Typed as vLLM types it (once "InternalServerErrorError").
    error = served.post("/v1/completions", body("boom")).json()["error"]
    assert (error["type"], error["code"]) == ("InternalServerError", 500)


def test_chat_without_a_tokenizer_says_what_the_server_lacks(serve) -> None:
    # Before: "this server's model has no chat template", of a gateway whose model
    # had one, started without --tokenizer.
    reply = serve().post(
        "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("BadRequestError", "messages")
    assert error["message"].startswith("this server has no tokenizer to render chat with")
    assert "--tokenizer" in error["message"]


def test_vllms_sampling_fields_are_served_where_the_engine_honours_them(serve) -> None:
    # What vLLM's own benchmark client sends with every request, and more.
    fields = {"repetition_penalty": 1.0, "logprobs": None, "ignore_eos": True, "top_k": 20}
    fields |= {"min_p": 0.05, "min_tokens": 2, "stop_token_ids": [7], "presence_penalty": 0.5}
    reply = serve().post("/v1/completions", body(**fields))
    assert reply.status_code == 200, reply.text


def test_a_sampling_field_the_engine_does_not_honour_is_a_400_naming_both(serve) -> None:
    class Plain(SlowEngine):
        sampling_fields = frozenset({"top_k"})

    served = serve(Plain())
    assert served.post("/v1/completions", body(top_k=5)).status_code == 200
    assert served.post("/v1/completions", body(repetition_penalty=1.0)).status_code == 200
    reply = served.post("/v1/completions", body(min_p=0.1))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "min_p"
    assert error["message"].startswith("min_p=0.1 is not honoured by Plain")
    bad = served.post("/v1/completions", body(repetition_penalty=0))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_penalty"


def test_the_body_size_is_limited(serve) -> None:
    served = serve(max_body_bytes=300)
    response = served.post("/v1/completions", body("x" * 400))
    assert response.status_code == 413 and "--max-body-bytes" in response.json()["error"]["message"]
    assert served.post("/v1/completions", body("short")).status_code == 200


def test_without_a_prm_methods_that_need_rewards_are_refused() -> None:
    engine = SlowEngine()
    config = ServeConfig(models=(MODEL,), method="sc")
    with Served(create_app(config, Backend(engine)), engine) as served:
        response = served.post("/v1/completions", body("short", method="sart", n=2))
        assert response.status_code == 400 and "has no PRM" in response.json()["error"]["message"]
        assert served.post("/v1/completions", body("short")).status_code == 200


GATEWAY_FLAGS = ["--engine", "openai", "--upstream", "http://127.0.0.1:9", "--model", "m"]
"""A gateway whose upstream is never asked for its model (nothing listens there)."""


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--n", "0"], "--n 0 must be >= 1"),
        (["--n", "40"], "--n 40 must be <= max_n=32"),
        (["--method", "best"], "--method='best' must be one of"),
        (["--model", "./no/such/model"], "--model './no/such/model': no such file or directory"),
        (["--max-tokens", "300", "--max-tokens-limit", "200"], "--max-tokens 300 must be <="),
        (["--device", "cuda:0", "--engine", "vllm"], "--device has no effect with --engine vllm"),
        (["--vllm-arg", "dtype=half"], "--vllm-arg has no effect with --engine hf"),
        (["--engine", "sglang", "--model", "m", "--sglang-arg", "tp"], "--sglang-arg='tp' must be"),
        (["--engine", "openai"], "--engine openai needs --upstream URL"),
        (
            [*GATEWAY_FLAGS, "--upstream-stream-interval", "-2"],
            "--upstream-stream-interval -2 must be >= 1",
        ),
        (["--upstream", "http://127.0.0.1:9"], "--upstream is for --engine openai"),
        (["--upstream-stream-interval", "8"], "--upstream-stream-interval is for --engine openai"),
        ([*GATEWAY_FLAGS, "--upstream-timeout", "0"], "--upstream-timeout 0.0 must be a finite"),
        (["--upstream-timeout", "5"], "--upstream-timeout is for --engine openai"),
        (
            ["--engine", "openai", "--upstream", "http://127.0.0.1:9"],
            "--upstream http://127.0.0.1:9: nothing answers there",
        ),
        (
            ["--engine", "openai", "--upstream", "127.0.0.1:9"],
            "--upstream 127.0.0.1:9: give its scheme, as in http://127.0.0.1:9",
        ),
        (GATEWAY_FLAGS, "no --upstream answers: --upstream http://127.0.0.1:9: nothing answers"),
        (
            [*GATEWAY_FLAGS, "--tokenizer", "./no/such/dir"],
            "--tokenizer './no/such/dir': no such file or directory",
        ),
    ],
)
def test_sart_serve_refuses_bad_flags_before_loading_anything(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from sart.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", *flags])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_gateways_flags_reach_its_engine() -> None:
    # --upstream-timeout: a hung upstream held its requests for OpenAIEngine's fixed
    # 300 s read timeout, with no flag to change it.
    from sart.builders import gateway_engine
    from sart.cli import _parser
    from sart.serve.command import load_spec_of

    flags = ["--upstream-timeout", "20", "--placement", "branch", "--upstream-stream-interval", "4"]
    args = _parser().parse_args(["serve", *GATEWAY_FLAGS, *flags])
    engine = gateway_engine(load_spec_of(args))
    assert (engine.timeout, engine.affinity, engine.stream_interval) == (20.0, False, 4)
    assert [s.url for s in engine.servers] == ["http://127.0.0.1:9"] and engine.model == "m"
    defaults = gateway_engine(load_spec_of(_parser().parse_args(["serve", *GATEWAY_FLAGS])))
    assert (defaults.timeout, defaults.affinity, defaults.stream_interval) == (300.0, True, 1)


def test_sart_serve_on_sglang_without_sglang_says_what_to_install(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import importlib.util

    from sart.cli import main

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--engine", "sglang", "--model", "m"])
    assert info.value.code == 2
    assert "pip install -e '.[sglang]'" in capsys.readouterr().err


def test_an_async_engine_behind_a_bridge_is_served(serve) -> None:
    # A bridge's loop cannot run inside the server's: all its calls go to the worker
    # thread (as SGLang's and AsyncLLM's bridges are served).
    bridge = SyncBridge(FakeStreamingEngine(lambda branch: BranchScript(length=5 + branch.index)))
    served = serve(bridge)
    reply = served.openai().completions.create(
        model=MODEL, prompt="short", extra_body={"method": "sc", "n": 3}
    )
    assert len(reply.model_extra["sart"]["branches"]) == 3
    assert reply.usage.completion_tokens == 5 + 6 + 7


def test_an_urgent_request_is_served_before_waiting_bulk_ones(serve) -> None:
    # B = 2: a long bulk request holds both slots; two more bulk ones and then an urgent
    # one (priority -1) wait. The urgent one is admitted before b1 and b2, into a slot
    # that pausing one of b0's branches frees.
    engine = SlowEngine(seconds_per_step=0.025)
    served = serve(engine, batch_size=2, aging=None)
    client = served.openai()
    order: list[str] = []
    lock = threading.Lock()

    def ask(name: str, priority: int, delay: float) -> None:
        time.sleep(delay)
        client.completions.create(
            model=MODEL,
            prompt="short",
            extra_body={"method": "sc", "n": 2, "priority": priority},
        )
        with lock:
            order.append(name)

    jobs = [("b0", 0, 0.0), ("b1", 0, 0.05), ("b2", 0, 0.1), ("urgent", -1, 0.15)]
    threads = [threading.Thread(target=ask, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert order.index("urgent") < order.index("b1") < order.index("b2")
    # It did not wait for b0 to end: a bulk branch was paused for it, one at a time,
    # through the server's engine wrapper (a bulk request keeps its other branch).
    paused = [call[1] for call in engine.log if call[0] == "pause"]
    assert paused and all(len(p) == 1 for p in paused)


# ------------------------------------------------------------------ how votes group answers

HALVES = ("\\frac{1}{2}", "0.5", "3", "3", "\\dfrac12")


class HalvesEngine(SlowEngine):
    """Five branches: three write one half three ways, two write 3."""

    def _script(self, branch: sart.BranchId) -> BranchScript:
        return BranchScript(length=8 + branch.index, answer=HALVES[branch.index % 5])


@pytest.mark.skipif(find_spec("math_verify") is None, reason="math-verify is not installed")
def test_votes_group_answers_by_meaning_under_math_verify(
    serve: Callable[..., Served],
) -> None:
    from sart.eval import MathVerifyEquivalence

    def answer(served: Served) -> str:
        reply = served.openai().completions.create(
            model=MODEL, prompt="half", extra_body={"method": "sc", "n": 5}
        )
        return sart.extract_answer(reply.choices[0].text)

    # Exact strings: 3 has two votes, each half one. By meaning the halves have three.
    assert answer(serve(HalvesEngine())) == "3"
    served = serve(HalvesEngine(), equivalence=MathVerifyEquivalence())
    assert answer(served) in HALVES[:2] + HALVES[4:]
    (model,) = served.openai().models.list().data
    assert model.sart["equivalence"] == "math-verify"  # type: ignore[attr-defined]
