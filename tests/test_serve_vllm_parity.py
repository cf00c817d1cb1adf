"""``sart serve`` as a drop-in for ``vllm serve``: the same requests, with the official
``openai`` client and raw ``httpx``, to ``vllm serve`` itself, to ``sart serve``'s app
on vLLM's engine (as ``--engine vllm`` runs it) and to the gateway in front of that
``vllm serve`` (``--engine openai``, its own process), compared field by field.

Both sart servers run the ``vanilla`` method (one branch, seeded with the request's
``seed``), which is what a plain OpenAI request means to ``vllm serve``: with
``temperature=0`` or a seed, all three give the same text. What must match: every
field vLLM sends but those listed in ``VLLM_ONLY`` (left out, and typed optional in
the ``openai`` client) with the same JSON types; ``finish_reason``, ``stop_reason``,
``usage``; the endpoints; the error status codes, their ``{"error": {message, type,
param, code}}`` bodies and the exception the ``openai`` client raises; the
``logprobs`` of the answer. What differs by design (``n`` > 1, the prompt's
log-probabilities, ``/version``'s number, the ``sart`` field, ``sart:`` metrics) is
asserted as documented in ``docs/reference/api.md``.

Runs where vLLM is installed (CI's vLLM stage); module-scoped servers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from adapters import fresh_vllm  # noqa: E402
from sart.serve import Backend, ServeConfig, create_app  # noqa: E402
from serving import Served, Server  # noqa: E402

VLLM_ONLY = frozenset(
    {
        # top level: vLLM's own fields, for features sart does not serve
        "service_tier",
        "system_fingerprint",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
        "prompt_text",
        "prompt_token_ids",
        "prompt_logprobs",
        # a choice: MoE routing; a chat message: OpenAI's fields vLLM leaves null
        "routed_experts",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        # usage
        "prompt_tokens_details",
        "completion_tokens_details",
    }
)
"""Fields ``vllm serve`` sends that sart's answers leave out: null in vLLM's answers
here, and optional in the ``openai`` client's types (``choice.refusal`` reads ``None``)."""

PROMPT = "Step 1: add 3 and 4."
MESSAGES = [{"role": "user", "content": "add 3 and 4"}]


@pytest.fixture(scope="module")
def servers(vllm_server: str, vllm_engine: Any, demo_models: dict[str, Path]) -> Iterator[dict]:
    """``{"vllm": URL, "sart": URL, "gateway": URL}``: ``vllm serve`` (the session's),
    the app on this process's vLLM engine, and the gateway in front of ``vllm serve``."""
    engine = fresh_vllm(vllm_engine)
    config = ServeConfig(
        models=("demo",), method="vanilla", max_tokens=16, max_tokens_limit=1000, root="demo"
    )
    app = create_app(config, Backend(engine, None))
    gateway = Server(
        "--engine", "openai", "--upstream", vllm_server, "--method", "vanilla",
        "--tokenizer", str(demo_models["policy"]), "--max-tokens", "16",
        "--max-tokens-limit", "1000",
    )  # fmt: skip
    try:  # the gateway's process is stopped whatever fails
        with Served(app, engine) as served:
            yield {"vllm": vllm_server, "sart": served.url, "gateway": gateway.url}
    finally:
        code, log = gateway.stop()
    assert code == 0, log


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def each(servers: dict, path: str, body: dict) -> dict[str, httpx.Response]:
    return {name: post(url, path, body) for name, url in servers.items()}


def shape(value: Any) -> Any:
    """A JSON value's skeleton: objects' keys (less ``VLLM_ONLY`` and ``sart``) with
    their values' skeletons, a list's first item's, a scalar's JSON type."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items() if k not in VLLM_ONLY | {"sart"}}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def same_shape(answers: dict[str, Any]) -> None:
    want = shape(answers["vllm"])
    for name, got in answers.items():
        assert shape(got) == want, name


def events(response: httpx.Response) -> list[dict]:
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ------------------------------------------------------------------ answers


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [" 48"]},
        {
            "prompt": PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "stop": [" 48"],
            "include_stop_str_in_output": True,
        },
        {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True},
        {"prompt": [274, 260, 29, 291], "max_tokens": 6, "temperature": 0, "echo": True},
        {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 7, "top_p": 0.9},
        {
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "min_tokens": 4,
            "skip_special_tokens": False,
            "stop_token_ids": [2],
        },
    ],
    ids=["stop", "include-stop", "echo", "echo-ids", "seed", "vllm-fields"],
)
def test_completions_match_vllm_serve(servers: dict, body: dict) -> None:
    answers = {
        k: r.json() for k, r in each(servers, "/v1/completions", {"model": "demo", **body}).items()
    }
    same_shape(answers)
    want = answers["vllm"]
    for name, got in answers.items():
        assert got["object"] == "text_completion" and got["model"] == "demo", name
        assert got["id"].startswith("cmpl-") and isinstance(got["created"], int), name
        for field in ("text", "finish_reason", "stop_reason", "logprobs", "index"):
            assert got["choices"][0][field] == want["choices"][0][field], (name, field)
        assert {
            k: got["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        } == {
            k: want["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        }, name
    if body.get("stop") and not body.get("include_stop_str_in_output"):
        assert want["choices"][0]["stop_reason"] == " 48"  # the case is the one it means


def test_chat_completions_match_vllm_serve(servers: dict) -> None:
    bodies = [
        {"messages": MESSAGES, "max_completion_tokens": 8, "temperature": 0},
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "Step 1:"}],
            "max_tokens": 6,
            "temperature": 0,
            "echo": True,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ]
    for body in bodies:
        answers = {
            k: r.json()
            for k, r in each(servers, "/v1/chat/completions", {"model": "demo", **body}).items()
        }
        same_shape(answers)
        want = answers["vllm"]["choices"][0]
        for name, got in answers.items():
            assert got["object"] == "chat.completion" and got["id"].startswith("chatcmpl-")
            choice = got["choices"][0]
            assert choice["message"]["role"] == "assistant"
            assert choice["message"]["content"] == want["message"]["content"], name
            assert (choice["finish_reason"], choice["stop_reason"]) == (
                want["finish_reason"],
                want["stop_reason"],
            ), name
            assert got["usage"]["prompt_tokens"] == answers["vllm"]["usage"]["prompt_tokens"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streams_match_vllm_serve(servers: dict, chat: bool) -> None:
    # A vanilla request's one branch is its answer: sart streams it as it is made, as
    # vLLM does (docs/tutorials/serve.md), in chunks of vLLM's shape, with the same
    # text, end and usage; on vLLM's engine in process, token by token as vllm serve's
    # pieces (a gateway sends what its upstream sent since its last report: the same
    # pieces, or several in one chunk where the upstream outran it).
    ask = {"messages": MESSAGES} if chat else {"prompt": PROMPT, "stop": [" 48"]}
    body = {
        "model": "demo",
        **ask,
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    path = "/v1/chat/completions" if chat else "/v1/completions"
    streams = {name: events(r) for name, r in each(servers, path, body).items()}
    want = streams["vllm"]
    for name, chunks in streams.items():
        *answer, usage = chunks
        assert usage["choices"] == [] and usage["usage"] == want[-1]["usage"], name
        assert all("usage" in c for c in answer), name  # continuous_usage_stats
        assert {c["object"] for c in chunks} == {want[0]["object"]}, name
        assert len({c["id"] for c in chunks}) == 1, name
        for chunk in answer:
            keys = set(chunk["choices"][0]) | set(chunk)
            vllm_keys = set().union(*(set(c["choices"][0]) | set(c) for c in want[:-1]))
            assert keys - {"sart"} <= vllm_keys, (name, keys - vllm_keys)
        text = "".join(
            (c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"]
            for c in answer
        )
        want_text = "".join(
            (c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"]
            for c in want[:-1]
        )
        assert text == want_text, name
        if name == "sart":
            assert pieces(chunks, chat) == pieces(want, chat)
        last = answer[-1]["choices"][0]
        assert (last["finish_reason"], last["stop_reason"]) == (
            want[-2]["choices"][0]["finish_reason"],
            want[-2]["choices"][0]["stop_reason"],
        ), name
        if chat:
            assert answer[0]["choices"][0]["delta"]["role"] == "assistant"


def pieces(chunks: list[dict], chat: bool) -> list[str]:
    """The texts of a stream's chunks that carry some."""
    texts = [
        (c["choices"][0]["delta"].get("content") if chat else c["choices"][0]["text"])
        for c in chunks
        if c["choices"]
    ]
    return [t for t in texts if t]


def test_the_openai_client_reads_each_the_same(servers: dict) -> None:
    for name, url in servers.items():
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(
            model="demo", prompt=PROMPT, max_tokens=12, temperature=0, stop=[" 48"]
        )
        assert reply.choices[0].stop_reason == " 48", name  # vLLM's field, read as vLLM's
        assert reply.choices[0].finish_reason == "stop", name
        chat = client.chat.completions.create(
            model="demo", messages=MESSAGES, max_completion_tokens=4, temperature=0
        )
        assert chat.choices[0].message.refusal is None, name
        assert chat.choices[0].stop_reason is None and chat.choices[0].finish_reason == "length"
        [card] = client.models.list().data
        assert card.id == "demo" and isinstance(card.max_model_len, int), name
        assert card.parent is None and card.permission[0]["object"] == "model_permission"


# ------------------------------------------------------------------ endpoints


def test_the_other_endpoints_match_vllm_serve(servers: dict) -> None:
    for name, url in servers.items():
        for method in ("GET", "POST"):  # SageMaker's ping
            assert httpx.request(method, url + "/ping", timeout=10).status_code == 200, name
        assert httpx.get(url + "/health", timeout=10).status_code == 200, name
        assert set(httpx.get(url + "/version", timeout=10).json()) == {"version"}, name
        assert set(httpx.get(url + "/load", timeout=10).json()) == {"server_load"}, name
        metrics = httpx.get(url + "/metrics", timeout=10)
        assert metrics.status_code == 200 and "# TYPE" in metrics.text, name
    for body in (
        {"model": "demo", "prompt": PROMPT, "return_token_strs": True},
        {"messages": MESSAGES},
    ):
        answers = {k: r.json() for k, r in each(servers, "/tokenize", body).items()}
        want = answers["vllm"]
        for name, got in answers.items():
            assert {k: got[k] for k in ("count", "tokens", "token_strs")} == {
                k: want[k] for k in ("count", "tokens", "token_strs")
            }, name
            assert isinstance(got["max_model_len"], int) and got["max_model_len"] > 0
    answers = each(servers, "/detokenize", {"model": "demo", "tokens": [274, 260, 29]})
    assert {k: r.json() for k, r in answers.items()} == {k: {"prompt": "Step 1:"} for k in servers}
    cards = {k: httpx.get(u + "/v1/models", timeout=10).json() for k, u in servers.items()}
    same_shape(cards)


# ------------------------------------------------------------------ errors


ERRORS = [
    ("/v1/completions", {"model": "nope", "prompt": PROMPT}, 404, openai.NotFoundError),
    ("/v1/completions", {"model": "demo", "prompt": PROMPT, "temperature": "hot"}, 400, None),
    ("/v1/completions", {"model": "demo", "prompt": PROMPT, "max_tokens": -1}, 400, None),
    ("/v1/completions", {"model": "demo", "prompt": PROMPT, "top_p": 0}, 400, None),
    ("/v1/completions", {"model": "demo"}, 400, None),
    ("/v1/completions", {"model": "demo", "prompt": "add " * 5000}, 400, openai.BadRequestError),
    ("/v1/completions", {"model": "demo", "prompt": "add " * 5000, "stream": True}, 400, None),
    (
        "/v1/completions",
        {"model": "demo", "prompt": PROMPT, "stream_options": {"include_usage": True}},
        400,
        None,
    ),
    ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}, 404, openai.NotFoundError),
    ("/tokenize", {"model": "nope", "prompt": PROMPT}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "raises"), ERRORS)
def test_errors_match_vllm_serve(
    servers: dict, path: str, body: dict, status: int, raises: type | None
) -> None:
    for name, response in each(servers, path, body).items():
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert error["code"] == status and error["message"], name
        kind = "NotFoundError" if status == 404 else "BadRequestError"
        # vLLM types its pydantic validation errors by the status phrase ("Bad Request").
        assert error["type"] in ({kind, "Bad Request"} if name == "vllm" else {kind}), name
    if raises is None:
        return
    for url in servers.values():  # the openai client raises the same class
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        create = client.chat.completions.create if "chat" in path else client.completions.create
        with pytest.raises(raises):
            create(**{"max_tokens": 4, **body})
        if "stream" not in body and path == "/v1/completions" and body.get("prompt"):
            with pytest.raises(raises):  # streamed: raised by create(), not mid-stream
                create(**{"max_tokens": 4, **body, "stream": True})


def _close(got: Any, want: Any, where: str) -> None:
    """``got`` equals ``want`` but for floats, within 1e-5 (the same engine's values,
    through JSON or not); ``where`` names the place in a failure."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-5), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            _close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 0},
        {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 3},
        {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 5, "logprobs": 4},
        {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "logprobs": True},
        {
            "messages": MESSAGES,
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 5,
            "logprobs": True,
            "top_logprobs": 3,
        },
        {
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 2,
            "return_tokens_as_token_ids": True,
        },
        {
            "messages": MESSAGES,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "return_tokens_as_token_ids": True,
        },
    ],
    ids=[
        "completions-0",
        "completions-3",
        "completions-seed",
        "chat-0",
        "chat-seed-3",
        "completions-ids",
        "chat-ids",
    ],
)
def test_logprobs_match_vllm_serve(servers: dict, body: dict) -> None:
    # The chosen branch's tokens, named and ordered as vLLM names and orders them (the
    # sampled token first in each token's list): tokens, values, bytes, offsets.
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    answers = {k: r.json() for k, r in each(servers, path, {"model": "demo", **body}).items()}
    same_shape(answers)
    want = answers["vllm"]["choices"][0]["logprobs"]
    assert want is not None
    for name, got in answers.items():
        _close(got["choices"][0]["logprobs"], want, name)


def test_what_sart_refuses_by_design_is_a_clear_400(servers: dict) -> None:
    # vllm serve answers these; sart serve returns one chosen branch, and keeps no
    # log-probabilities of the prompt: a 400 naming the field (docs/reference/api.md).
    refused = [
        ({"prompt": PROMPT, "n": 2}, "n"),
        ({"prompt": PROMPT, "logprobs": 2, "echo": True}, "echo"),
    ]
    for body, field in refused:
        answers = each(servers, "/v1/completions", {"model": "demo", "max_tokens": 4, **body})
        assert answers.pop("vllm").status_code == 200
        for name, response in answers.items():
            assert response.status_code == 400, name
            assert response.json()["error"]["param"] == field, name
