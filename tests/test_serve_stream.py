"""Streams of requests whose one branch is their answer (``vanilla``): sent as the engine
makes them, as ``vllm serve`` streams (``sart.serve.events``), on a streaming engine (the
server's early reports, ``StreamingEngine.report_every``), on a step engine that hands
over each decode step's tokens (``watchers``, as the transformers and vLLM engines do),
and on one that does not (the request's decode chunks shortened to ``--stream-interval``).

Servers run in this process on 127.0.0.1 (uvicorn, the real app) on sart's public
scripted engines; clients are the official ``openai`` client and ``httpx``. The testbed
model's streams are in ``test_serve_testbed.py`` and ``test_serve_logprobs.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

import sart  # noqa: E402
from sart.engines.streaming import Chunk, StreamingEngine  # noqa: E402
from sart.serve.engine import ServingEngine  # noqa: E402
from sart.testing import BranchScript, FakeEngine, FakeStreamingEngine  # noqa: E402
from serving import Served, scripted_apps  # noqa: E402

MODEL = "fake"
LENGTH = 40


def script(branch: sart.BranchId) -> BranchScript:
    return BranchScript(length=LENGTH + branch.index, answer=str(branch.index))


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    with scripted_apps(MODEL) as start:
        yield start


def streamed(served: Served, **body: Any) -> list[dict[str, Any]]:
    """The data events of a streamed completion, ``[DONE]`` left out."""
    ask = {"model": MODEL, "prompt": "q", "stream": True, **body}
    headers = {"Authorization": "Bearer key"}
    with httpx.stream(
        "POST", f"{served.url}/v1/completions", json=ask, headers=headers, timeout=30
    ) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def texts(chunks: list[dict[str, Any]]) -> list[str]:
    """The texts of the chunks that carry some (the answer's pieces)."""
    return [c["choices"][0]["text"] for c in chunks if c.get("choices") and c["choices"][0]["text"]]


class PacedStreamingEngine(FakeStreamingEngine):
    """``FakeStreamingEngine`` one token at a time, ``pace`` seconds apart (the fake
    makes a whole answer between two of the driver's steps)."""

    def __init__(self, script: Any, pace: float = 0.01, **options: Any) -> None:
        super().__init__(script, burst=1, **options)
        self.pace = pace

    async def _open(self, start):  # type: ignore[no-untyped-def]
        async for chunk in super()._open(start):
            yield chunk
            await asyncio.sleep(self.pace)


def watching_fake(script: Any) -> FakeEngine:
    return FakeEngine(script, watch=True)


ENGINES = {"streaming": PacedStreamingEngine, "stepping": FakeEngine, "watching": watching_fake}


@pytest.mark.parametrize("kind", ENGINES)
def test_a_one_branch_request_streams_its_tokens_as_they_are_made(serve, kind: str) -> None:
    engine = ENGINES[kind](script)
    served = serve(engine, interval=400)
    whole = served.post("/v1/completions", {"model": MODEL, "prompt": "q", "method": "vanilla"})
    answer = whole.json()["choices"][0]["text"]
    log = getattr(engine, "log", [])
    log.clear()
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = streamed(served, method="vanilla", stream_options=options)
    pieces = texts(chunks)
    # In pieces, though the server's decode chunk (T = 400) outlasts the answer.
    assert "".join(pieces) == answer and len(pieces) > 1
    made = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert made == sorted(made) and made[-1] == LENGTH
    if kind != "streaming":  # every token in a chunk of its own (--stream-interval 1)
        assert len(pieces) == LENGTH and made[:LENGTH] == list(range(1, LENGTH + 1))
    if kind == "watching":  # in decode chunks of T: the engine hands each step's token over
        assert {call[1] for call in log if call[0] == "step"} == {400}
    elif kind == "stepping":  # in decode chunks of one token
        assert {call[1] for call in log if call[0] == "step"} == {1}
    finish = chunks[-2]["choices"][0]
    assert (finish["text"], finish["finish_reason"]) == ("", "stop")
    assert chunks[-1]["usage"]["completion_tokens"] == LENGTH


@pytest.mark.parametrize("kind", ENGINES)
def test_the_stream_interval_bounds_the_tokens_of_a_chunk(serve, kind: str) -> None:
    served = serve(ENGINES[kind](script), stream_interval=8)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = [c for c in streamed(served, method="vanilla", stream_options=options) if c["choices"]]
    made = [0] + [c["usage"]["completion_tokens"] for c in chunks if c["choices"][0]["text"]]
    steps = [b - a for a, b in itertools.pairwise(made)]
    assert sum(steps) == LENGTH and len(steps) > 1
    if kind == "stepping":  # a step engine reports exactly the decode chunks it was given
        assert steps == [8] * (LENGTH // 8)
    elif kind == "watching":  # the first token at once, then 8 at a time, as vLLM does
        assert steps == [1, 8, 8, 8, 8, 7]
    else:  # a streaming engine reports the first at once, then once 8 are made, and the end
        assert min(steps[1:-1]) >= 8


def test_a_request_of_several_branches_still_sends_its_chosen_answer_in_one_chunk(
    serve,
) -> None:
    served = serve(FakeStreamingEngine(script))
    chunks = streamed(served, method="sc", n=3)
    (answer,) = texts(chunks)
    assert answer.endswith("\\boxed{0}") or "boxed" in answer
    best_of = streamed(served, best_of=2)  # a method of its own, with branches: the same
    assert len(texts(best_of)) == 1


def test_echo_comes_first_in_a_live_stream(serve) -> None:
    served = serve(FakeEngine(script))
    ask = {"model": MODEL, "prompt": "q", "method": "vanilla", "echo": True}
    answer = served.post("/v1/completions", ask).json()["choices"][0]["text"]
    pieces = texts(streamed(served, method="vanilla", echo=True))
    assert pieces[0].startswith("q") and "".join(pieces) == answer


def test_a_stream_that_fails_midway_ends_with_an_error_event(serve) -> None:
    failing = PacedStreamingEngine(script, fail_stream={sart.BranchId("cmpl-x", 0): 20})
    served = serve(failing)
    chunks = streamed(served, method="vanilla", request_id="x")
    pieces = texts(chunks)
    assert 0 < len("".join(pieces)) and len(pieces) < 20
    assert "injected stream failure" in chunks[-1]["error"]["message"]
    # The official client raises it, after the tokens it read.
    client = served.openai()
    read = []
    with pytest.raises(openai.APIError, match="injected stream failure"):
        for chunk in client.completions.create(
            model=MODEL,
            prompt="q",
            stream=True,
            extra_body={"method": "vanilla", "request_id": "x"},
        ):
            read.append(chunk.choices[0].text)
    assert read


def test_a_client_that_leaves_a_live_stream_has_its_branch_aborted(serve) -> None:
    long = PacedStreamingEngine(lambda branch: BranchScript(length=10**6))
    served = serve(long)
    ask = {"model": MODEL, "prompt": "q", "method": "vanilla", "stream": True}
    headers = {"Authorization": "Bearer key"}
    with httpx.stream(
        "POST", f"{served.url}/v1/completions", json=ask, headers=headers, timeout=30
    ) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                break  # the answer's first piece: the stream is live
    served.wait_for(lambda: served.metric("sart:requests_total", '{status="cancelled"}') == 1)
    assert served.metric("sart:engine_live_branches") == 0
    assert [b.index for b in long.cancelled] == [0]


class StallingEngine(StreamingEngine):
    """One token, then nothing until cancelled."""

    async def _open(self, start):  # type: ignore[no-untyped-def]
        yield Chunk(token_ids=(1,), text="x")
        await asyncio.Event().wait()

    async def _cancel(self, branch: sart.BranchId) -> None:
        pass


def test_a_listened_request_is_reported_as_soon_as_it_has_made_its_tokens() -> None:
    async def main() -> None:
        inner = StallingEngine()
        engine = ServingEngine(inner)
        assert engine.streams_tokens
        heard: list[sart.BranchDelta] = []
        engine.listen("a", heard.append, every=8)
        sampling = sart.SamplingSettings(max_tokens=100)
        await engine.prefill("a", "a", sampling)
        await engine.start_branches("a", [sart.BranchSpec(0, 0)])
        # No arrival interrupts it: the first token is reported at once because "a" is
        # listened to (as vLLM's stream_interval), the next ones 8 at a time.
        output = await asyncio.wait_for(engine.step(50), 5)
        assert output.request_steps == {"a": 1}
        assert [(d.new_tokens, d.text) for d in heard] == [(1, "x")]
        assert inner.report_every == {"a": 8}
        engine.forget("a")
        assert not inner.report_every
        await engine.abort([sart.BranchId("a", 0)])
        await engine.release_prefix("a")
        engine.close()

    asyncio.run(main())


def test_a_stream_opens_once_prefilled_on_an_engine_that_prefills_at_once(serve) -> None:
    # The prompt was taken before the handler waited for it: the stream still opens
    # then, not when the request ends (minutes from now).
    long = PacedStreamingEngine(lambda branch: BranchScript(length=10**6))
    served = serve(long)
    ask = {"model": MODEL, "prompt": "q", "stream": True, "method": "sart", "n": 2}
    headers = {"Authorization": "Bearer key"}
    with httpx.stream(
        "POST", f"{served.url}/v1/completions", json=ask, headers=headers, timeout=10
    ) as reply:
        assert reply.status_code == 200
        assert served.metric("sart:num_requests_running") == 1  # still undecided


def test_a_watched_step_engine_reports_the_first_token_then_every_k_across_steps() -> None:
    async def main() -> None:
        inner = FakeEngine(lambda branch: BranchScript(length=12), watch=True)
        engine = ServingEngine(inner)
        assert engine.streams_tokens
        heard: list[sart.BranchDelta] = []
        engine.listen("a", heard.append, every=3)
        await engine.prefill("a", "a", sart.SamplingSettings(max_tokens=100))
        await engine.start_branches("a", [sart.BranchSpec(0, 0)])
        outputs = [await engine.step(5) for _ in range(3)]
        # What is held at a step's end waits for the next (tokens 5, then 11-12 with the end).
        assert [d.new_tokens for d in heard] == [1, 3, 3, 3, 2]
        assert [d.finish for d in heard] == [None] * 4 + [sart.FinishReason.STOP]
        whole = "".join(o.deltas[sart.BranchId("a", 0)].text for o in outputs)
        assert "".join(d.text for d in heard) == whole
        engine.forget("a")
        assert inner.watchers == {}
        await engine.release_prefix("a")

    asyncio.run(main())


def test_a_step_engine_without_watchers_is_not_watched() -> None:
    assert not ServingEngine(FakeEngine()).streams_tokens
    assert ServingEngine(FakeEngine(watch=True)).streams_tokens


def test_a_listened_request_that_ends_ends_a_step_engines_decode_chunk(demo_models) -> None:
    """Its answer goes out then, not when the rest of the batch's decode chunk is done."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from sart.engines.hf import HFEngine

    async def main() -> None:
        inner = HFEngine.from_pretrained(str(demo_models["policy"]), dtype=torch.float32)
        engine = ServingEngine(inner)
        heard: list[sart.BranchDelta] = []
        engine.listen("short", heard.append, every=1)
        for rid, tokens in (("short", 3), ("long", 50)):
            sampling = sart.SamplingSettings(max_tokens=tokens, ignore_eos=True)
            await engine.prefill(rid, "a", sampling)
            await engine.start_branches(rid, [sart.BranchSpec(0, 0)])
        output = await engine.step(40)
        assert output.steps == 3  # the short one's last decode step
        assert output.deltas[sart.BranchId("short", 0)].finish is sart.FinishReason.LENGTH
        assert [d.new_tokens for d in heard] == [1, 1, 1, 0]
        assert heard[-1].finish is sart.FinishReason.LENGTH
        assert (await engine.step(40)).steps == 40  # the long one alone: its whole chunk
        engine.forget("short")
        await engine.release_prefix("short")
        await engine.release_prefix("long")
        engine.close()

    asyncio.run(main())
