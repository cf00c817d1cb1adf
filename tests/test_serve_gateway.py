"""The gateway (``sart serve --engine openai``): sart in front of OpenAI-compatible servers.

Here the upstreams are stand-in servers on real sockets
(``openai_standin.SocketServer``), the app runs in a thread (``serving.Served``)
and the client is the official ``openai`` client: request affinity and a
client's disconnect reaching the upstreams (the command's flags are checked with
the others in ``test_serve.py``). In front
of two real ``vllm serve`` it runs in ``test_serve_vllm.py``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import http.server
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import sart  # noqa: E402
from adapters import free_port, loopback_http  # noqa: E402
from openai_standin import SocketServer  # noqa: E402
from sart.engines.openai import OpenAIEngine  # noqa: E402
from sart.serve import Backend, ServeConfig, create_app  # noqa: E402
from sart.testing import BranchScript, ScriptedPRM  # noqa: E402
from serving import Served  # noqa: E402

MODEL = "stand-in"


@pytest.fixture
def upstreams() -> Iterator[Callable[..., list[SocketServer]]]:
    started: list[SocketServer] = []

    def start(count: int = 2, **kwargs: object) -> list[SocketServer]:
        servers = [SocketServer(**kwargs) for _ in range(count)]  # type: ignore[arg-type]
        started.extend(servers)
        return servers

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def gateway() -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(servers: list[SocketServer], **engine_kwargs: object) -> Served:
        engine = OpenAIEngine([s.url for s in servers], MODEL, **engine_kwargs)  # type: ignore[arg-type]
        config = ServeConfig(models=(MODEL,), max_tokens=64, max_tokens_limit=64)
        prm = ScriptedPRM(lambda branch: BranchScript(rewards=(0.9,)), every=4)
        served = Served(create_app(config, Backend(engine, prm, engine.aclose)), engine)
        started.append(served.__enter__())
        return served

    yield start
    for served in started:
        served.__exit__()


def by_request(servers: list[SocketServer]) -> dict[str, set[str]]:
    """Each sart request id -> the upstreams its branches streamed from (the stand-in
    records ``X-Request-Id: {index}_{request id}-{hex}``)."""
    homes: dict[str, set[str]] = collections.defaultdict(set)
    for server in servers:
        for request in server.requests:
            rid = request["id"].split("_", 1)[1].rsplit("-", 1)[0]
            homes[rid].add(server.url)
    return homes


@pytest.mark.parametrize("placement", ["request", "branch"])
def test_the_branches_of_a_request_stream_from_one_upstream(
    upstreams, gateway, placement: str
) -> None:
    servers = upstreams(token_delay=0.002)
    served = gateway(servers, affinity=placement == "request")
    client = served.openai()

    def ask(i: int) -> str:
        reply = client.completions.create(
            model=MODEL, prompt=f"question {i}", extra_body={"method": "sc", "n": 4}
        )
        assert reply.usage.completion_tokens > 0
        return reply.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(16)))
    assert len(answers) == 16
    homes = by_request(servers)
    assert len(homes) == 16
    assert all(len(s.requests) >= 8 for s in servers)  # both upstreams took work
    if placement == "request":
        assert all(len(urls) == 1 for urls in homes.values())
    else:
        assert any(len(urls) == 2 for urls in homes.values())


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_has_its_branches_aborted_upstream(
    upstreams, gateway, stream: bool
) -> None:
    servers = upstreams(token_delay=0.5, abort_endpoint=True)
    served = gateway(servers, explicit_abort=True)
    client = served.openai()

    def leave() -> None:
        with pytest.raises((openai.APITimeoutError, openai.APIConnectionError)):
            reply = client.with_options(timeout=1.5).completions.create(
                model=MODEL,
                prompt="long question",
                stream=stream,
                extra_body={"method": "sc", "n": 3},
            )
            for _ in reply if stream else ():
                pass

    thread = threading.Thread(target=leave)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    deadline = time.monotonic() + 10
    while any(s.running for s in servers):
        assert time.monotonic() < deadline, "the upstream streams were not closed"
        time.sleep(0.02)
    sent = [r["id"] for s in servers for r in s.requests]
    assert len(sent) == 3
    # Every branch was cut short upstream, and asked to abort explicitly.
    assert sorted(r for s in servers for r in s.disconnected) == sorted(sent)

    # The abort calls go out beside the streams' closing, and may land after it (seen
    # on a loaded CI machine: one of three had landed when the streams had closed).
    def asked() -> list[str]:
        return sorted(rid for s in servers for call in s.abort_calls for rid in call)

    served.wait_for(lambda: len(asked()) >= len(sent), timeout=10)
    assert asked() == sorted(f"cmpl-{rid}-0" for rid in sent)
    served.wait_for(lambda: served.metric("sart:num_requests_running") == 0)


def test_the_upstreams_are_checked_before_the_gateway_serves(
    upstreams, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a gateway started in front of an upstream serving another model (or of
    # none at all) said /health 200 and failed every request with a 500.
    from sart.errors import ConfigError
    from sart.serve.upstream_check import check_upstreams

    (server,) = upstreams(count=1)
    dead = f"http://127.0.0.1:{free_port()}"
    check_upstreams([server.url], None, MODEL)
    with pytest.raises(ConfigError) as info:
        check_upstreams([server.url], None, "Qwen/Qwen2.5-7B")
    assert str(info.value).startswith(
        f"--upstream {server.url}: serves ['stand-in'], not 'Qwen/Qwen2.5-7B': give --model"
    )
    check_upstreams([dead, server.url], None, MODEL)  # one down: the other serves
    assert f"warning: --upstream {dead}: nothing answers there" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=f"^no --upstream answers: --upstream {dead}: "):
        check_upstreams([dead], None, MODEL)
    # Before: httpx's two-line 404 message with its MDN link; an SSL error as "nothing
    # answers there".
    with pytest.raises(ConfigError, match=r": HTTP 404 to /v1/models; is it an OpenAI-"):
        check_upstreams([server.url + "/completions"], None, MODEL)
    # A plain HTTP server (the stand-in waits for a request's end, which a TLS hello
    # never sends; the standard library's answers it at once, as uvicorn does).
    with loopback_http(http.server.BaseHTTPRequestHandler) as plain:
        where = plain.removeprefix("http://")
        with pytest.raises(
            ConfigError, match=rf"does not speak TLS .*; give it as http://{where}$"
        ):
            check_upstreams([f"https://{where}"], None, MODEL)


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (200, b"<html>models</html>", "its /v1/models is no model list (not JSON: '<html>"),
        (200, b'{"object": "list"}', "its /v1/models is no model list (no 'data' list)"),
        (200, b'{"data": [{"object": "model"}]}', "is no model list (a model without an 'id')"),
        (200, b'{"data": []}', "its /v1/models lists no model"),
        (200, b'{"data": [{"id": "other"}]}', f"serves ['other'], not '{MODEL}'"),
        (401, b"{}", "HTTP 401 to /v1/models: it refuses the API key"),
        (500, b"oops", "HTTP 500 to /v1/models"),
    ],
)
def test_the_start_up_check_and_health_word_a_bad_model_list_alike(
    status: int, body: bytes, said: str
) -> None:
    # Before: each parsed /v1/models with words of its own ("its /v1/models answered HTTP
    # 401" at start, "HTTP 401 to /v1/models" in /health; an empty list "lists no model"
    # at start, "serves [], not 'stand-in'" in /health), and neither said what was wrong
    # with a list it could not read. Now both say one helper's words after the URL.
    from sart.errors import ConfigError
    from sart.serve.upstream_check import check_upstreams

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # /health: 404, not asked; /v1/models: the answer
            code, content = (status, body) if self.path == "/v1/models" else (404, b"")
            self.send_response(code)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        def log_message(self, *args: object) -> None:
            pass

    with loopback_http(Models) as url:
        with pytest.raises(ConfigError) as at_start:
            check_upstreams([url], None, MODEL)
        engine = OpenAIEngine([url], MODEL)
        try:
            with pytest.raises(sart.EngineError) as in_health:
                asyncio.run(engine.check_health())
        finally:
            engine.close()
    health = str(in_health.value)
    fault = health.removeprefix(f"no upstream can serve the model: {url}: ")
    assert fault != health and said in fault
    # The same words at start, then what to do about it.
    assert str(at_start.value).startswith(f"--upstream {url}: {fault}")


def test_an_upstream_gone_bad_is_worked_around_and_health_follows_the_upstreams(
    upstreams, gateway
) -> None:
    # Before: an upstream that revoked the gateway's key after start failed every
    # request homed there with a 500, and /health said 200 with every upstream down.
    good, revoked = upstreams(token_delay=0.001)
    served = gateway([good, revoked])
    client = served.openai()
    revoked.fail = 401
    for i in range(4):
        reply = client.completions.create(
            model=MODEL, prompt=f"question {i}", extra_body={"method": "sc", "n": 2}
        )
        assert reply.choices[0].text
    # One request's branches tried it, then it was passed over for its cooldown.
    assert len(by_request([revoked])) == 1
    health = httpx.get(f"{served.url}/health", timeout=10)
    assert health.status_code == 200, health.text
    good.health = revoked.health = 503
    answer = httpx.get(f"{served.url}/health", timeout=10)
    assert answer.status_code == 503
    message = answer.json()["error"]["message"]
    assert message == (
        f"no upstream can serve the model: {good.url}: HTTP 503 to a health check; "
        f"{revoked.url}: HTTP 503 to a health check"
    )
    good.health = 200
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200


def test_health_is_503_when_every_upstream_refuses_the_key_or_the_model(upstreams, gateway) -> None:
    # Before: /health asked only the upstreams' /health, which vLLM answers without
    # the key and whatever model it serves: upstreams restarted with another
    # --api-key or --served-model-name kept it at 200 while every request failed.
    rekeyed, renamed = upstreams(token_delay=0.001)
    served = gateway([rekeyed, renamed])
    rekeyed.api_key, renamed.model = "rotated", "renamed"
    answer = httpx.get(f"{served.url}/health", timeout=10)
    assert answer.status_code == 503
    assert answer.json()["error"]["message"] == (
        f"no upstream can serve the model: {rekeyed.url}: HTTP 401 to /v1/models: it refuses "
        f"the API key; {renamed.url}: serves ['renamed'], not '{MODEL}'"
    )
    renamed.model = MODEL  # back as it was
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    reply = served.openai().completions.create(
        model=MODEL, prompt="question", extra_body={"method": "sc", "n": 2}
    )
    assert reply.choices[0].text
    assert rekeyed.completions() == []  # passed over: its probe failed


class WordTokenizer:
    """The stand-in's tokens as text: id ``t`` is `` w{t}``, 0 its EOS (no text)."""

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join("" if t == 0 else f" w{t}" for t in ids)

    def encode(self, text: str) -> list[int]:
        return [int(word[1:]) for word in text.split()] or [1]


def test_logprobs_through_the_gateway_name_the_upstreams_token_ids(upstreams, gateway) -> None:
    from openai_standin import StandInServer

    servers = upstreams(1, token_ids=True)
    served = gateway(servers, tokenizer=WordTokenizer())
    reply = served.openai().completions.create(
        model=MODEL, prompt="w5 w6", logprobs=2, seed=3, extra_body={"method": "vanilla"}
    )
    (body,) = [r["body"] for r in servers[0].requests]
    assert body["return_tokens_as_token_ids"] is True and body["logprobs"] == 2
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    tokens = StandInServer.tokens(servers[0].requests[0]["body"]["prompt"], body["seed"])
    assert logprobs.tokens == [WordTokenizer().decode([t]) for t in tokens]
    assert "".join(logprobs.tokens) == reply.choices[0].text
    for token, value, top in zip(tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        sampled, likeliest = StandInServer.logprobs(token, 2)
        assert value == sampled
        named = {WordTokenizer().decode([t]): v for t, v in likeliest}
        assert top == {WordTokenizer().decode([token]): sampled, **named}


def test_logprobs_need_the_gateways_tokenizer(upstreams, gateway) -> None:
    served = gateway(upstreams(1, token_ids=True))
    with pytest.raises(openai.BadRequestError, match="logprobs need a tokenizer") as caught:
        served.openai().completions.create(model=MODEL, prompt="w5", logprobs=1)
    assert caught.value.body["param"] == "logprobs"  # type: ignore[index]
    # Named by their ids, as vLLM's return_tokens_as_token_ids names them: no tokenizer.
    reply = served.openai().completions.create(
        model=MODEL, prompt="w5", logprobs=1, extra_body={"return_tokens_as_token_ids": True}
    )
    tokens = reply.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tokens and all(t.startswith("token_id:") for t in tokens)


def test_logprobs_an_upstream_keys_by_text_fail_saying_so(upstreams, gateway) -> None:
    # SGLang's server keys them by text (it ignores return_tokens_as_token_ids).
    served = gateway(upstreams(1, token_ids=False), tokenizer=WordTokenizer())
    with pytest.raises(openai.InternalServerError, match="without token ids"):
        served.openai().completions.create(model=MODEL, prompt="w5", logprobs=1)
    # The same request without logprobs is served.
    assert served.openai().completions.create(model=MODEL, prompt="w5").choices[0].text
