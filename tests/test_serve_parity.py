"""What makes ``sart serve`` a drop-in for ``vllm serve`` (0.32), without vLLM: the
fields, endpoints and error statuses a client written for ``vllm serve`` reads, on
``sart serve --model testbed`` (its own process, the official ``openai`` client and
``httpx``) and on scripted engines. The differential against ``vllm serve`` itself
is ``tests/test_serve_vllm_parity.py`` (CI's vLLM stage)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from sart import testbed as tb  # noqa: E402
from sart.engines.openai_stream import Delta, parse_event  # noqa: E402
from sart.engines.sglang_wire import stop_reason as sglang_stop_reason  # noqa: E402
from sart.serve import Backend, ServeConfig, create_app  # noqa: E402
from sart.serve.service import context_length  # noqa: E402
from sart.testing import BranchScript, FakeEngine  # noqa: E402
from serving import KEY, Served, Server  # noqa: E402

QUESTION = tb.make_questions(3, 1)[0].prompt


def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tb.POLICY_PATH)


COMPLETION_CHOICE = {
    "index", "text", "logprobs", "finish_reason", "stop_reason",
    "token_ids", "prompt_logprobs", "prompt_token_ids",
}  # fmt: skip
"""The keys of a ``vllm serve`` completion choice (less MoE's ``routed_experts``)."""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    served = Server("--api-key", KEY, "--method", "vanilla", "--max-tokens", "64")
    yield served
    code, log = served.stop()
    assert code == 0, log
    assert "Traceback" not in log, log


def post(server: Server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def events(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ------------------------------------------------------------------ answers


def test_a_choice_has_vllms_fields_and_its_stop_reason(server: Server) -> None:
    ask = {"model": "testbed", "prompt": QUESTION, "seed": 0, "temperature": 0}
    body = post(server, "/v1/completions", {**ask, "stop": ["\n\n"]}).json()
    (choice,) = body["choices"]
    assert set(choice) == COMPLETION_CHOICE
    # The testbed writes its steps apart by a blank line: the stop string ends it.
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "\n\n")
    assert choice["token_ids"] is choice["prompt_logprobs"] is choice["prompt_token_ids"] is None
    cut = post(server, "/v1/completions", {**ask, "max_tokens": 2}).json()["choices"][0]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("length", None)
    reply = server.client().chat.completions.create(
        model="testbed", messages=[{"role": "user", "content": QUESTION}], stop=["\n\n"], seed=0
    )
    assert reply.choices[0].stop_reason == "\n\n"  # read as vllm serve's, by attribute
    assert reply.choices[0].message.model_extra == {"reasoning": None}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_ends_with_the_stop_reason_and_counts_usage_continuously(
    server: Server, chat: bool
) -> None:
    ask: dict[str, Any] = (
        {"messages": [{"role": "user", "content": QUESTION}]} if chat else {"prompt": QUESTION}
    )
    body = {
        **ask,
        "model": "testbed",
        "stop": ["\n\n"],
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    *answer, last = events(
        post(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    )
    assert answer[-1]["choices"][0]["stop_reason"] == "\n\n"
    assert answer[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" in chunk for chunk in answer)  # vLLM's continuous_usage_stats
    assert answer[-1]["usage"] == last["usage"] and last["choices"] == []
    prompt = last["usage"]["prompt_tokens"]
    assert prompt > 0 and all(c["usage"]["prompt_tokens"] == prompt for c in answer)
    if chat:  # the role chunk, sent before the answer is known: the prompt alone
        assert answer[0]["choices"][0]["delta"]["role"] == "assistant"
        assert answer[0]["usage"]["completion_tokens"] == 0
    # Without continuous_usage_stats, usage is in the last chunk only (as vLLM's).
    body["stream_options"] = {"include_usage": True}
    *answer, last = events(
        post(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    )
    assert "usage" in last and not any("usage" in chunk for chunk in answer)


def test_echo_puts_the_prompt_before_the_answer_as_vllm(server: Server) -> None:
    ask = {"model": "testbed", "prompt": QUESTION, "seed": 0, "max_tokens": 8}
    plain = post(server, "/v1/completions", ask).json()["choices"][0]["text"]
    echoed = post(server, "/v1/completions", {**ask, "echo": True}).json()["choices"][0]["text"]
    assert echoed == QUESTION + plain
    ids = tokenizer().encode(QUESTION)
    by_ids = post(server, "/v1/completions", {**ask, "prompt": ids, "echo": True}).json()
    assert by_ids["choices"][0]["text"].startswith(tokenizer().decode(ids))
    streamed = events(post(server, "/v1/completions", {**ask, "echo": True, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in streamed) == echoed
    # Chat: the last message's content, when it is the assistant's (continued).
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "p1"},
    ]
    chat = {
        "model": "testbed",
        "messages": messages,
        "seed": 0,
        "max_tokens": 8,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    plain = post(server, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**chat, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "p1" + plain
    messages.pop()  # the last message is the user's: nothing is echoed
    asked = {**chat, "echo": True, "continue_final_message": False, "add_generation_prompt": True}
    content = post(server, "/v1/chat/completions", asked).json()["choices"][0]["message"]
    assert not content["content"].startswith(QUESTION)


def test_a_streamed_prompt_the_engine_refuses_is_an_http_400_as_vllms(server: Server) -> None:
    # Refused at prefill (over the context): before the stream opens, so the status is
    # the refusal's, and the openai client raises BadRequestError from create().
    too_long = {"model": "testbed", "prompt": "Q 2 " * 5000, "stream": True}
    response = post(server, "/v1/completions", too_long)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model="testbed", prompt="Q 2 " * 5000, stream=True)


# ------------------------------------------------------------------ endpoints


def test_vllms_other_endpoints(server: Server) -> None:
    for method in ("GET", "POST"):  # SageMaker's ping, as vllm serve has it
        assert httpx.request(method, f"{server.url}/ping").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": __import__("sart").__version__}
    assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    tok = tokenizer()
    # Outside /v1, so open without the key, as vLLM's are.
    got = post(server, "/tokenize", {"prompt": QUESTION, "return_token_strs": True}, key=None)
    ids = tok.encode(QUESTION)
    (card,) = server.client().models.list().data
    assert got.json() == {
        "count": len(ids),
        "max_model_len": card.max_model_len,
        "tokens": ids,
        "token_strs": tok.convert_ids_to_tokens(ids),
    }
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": QUESTION}]})
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    assert chat.json()["tokens"] == tok.encode(rendered, add_special_tokens=False)
    back = post(server, "/detokenize", {"model": "testbed", "tokens": ids}).json()
    assert back == {"prompt": tok.decode(ids)}
    for path, body in [
        ("/tokenize", {"model": "nope", "prompt": "x"}),
        ("/detokenize", {"model": "nope", "tokens": [1]}),
    ]:
        response = post(server, path, body)
        assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    assert post(server, "/tokenize", {"model": "testbed"}).status_code == 400  # nothing given


def test_model_cards_are_vllms(server: Server) -> None:
    (card,) = server.client().models.list().data
    assert (card.id, card.owned_by, card.root, card.parent) == ("testbed", "sart", "testbed", None)
    config = json.loads((tb.POLICY_PATH / "config.json").read_text())
    assert card.max_model_len == config["max_position_embeddings"]
    (permission,) = card.permission
    assert permission["object"] == "model_permission" and permission["allow_logprobs"] is True


# ------------------------------------------------------------------ scripted engines


def test_without_a_tokenizer_tokenize_says_so_and_cards_leave_the_context_unsaid() -> None:
    engine = FakeEngine(lambda b: BranchScript(length=3))
    config = ServeConfig(models=("fake",), method="vanilla", max_tokens=8)
    with Served(create_app(config, Backend(engine, None)), engine) as served:
        response = served.post("/tokenize", {"prompt": "x"})
        assert response.status_code == 501, response.text
        assert "--tokenizer" in response.json()["error"]["message"]
        assert served.post("/detokenize", {"tokens": [1]}).status_code == 501
        (card,) = served.openai().models.list().data
        assert card.max_model_len is None and card.root == "fake"


def test_a_stream_opens_once_prefilled_or_at_the_first_keepalive() -> None:
    # A prefill that takes long (a queue, a slow engine): the stream's headers wait for
    # it, but no longer than --keepalive, so a proxy still sees a live connection.
    class SlowPrefill(FakeEngine):
        def prefill(self, request_id, prompt, sampling):  # type: ignore[no-untyped-def]
            import time

            time.sleep(1.5)
            return super().prefill(request_id, prompt, sampling)

    engine = SlowPrefill(lambda b: BranchScript(length=3))
    config = ServeConfig(models=("fake",), method="vanilla", max_tokens=8, keepalive=0.2)
    with Served(create_app(config, Backend(engine, None)), engine) as served:
        body = {"model": "fake", "prompt": "q", "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
    assert lines[0] == ": keep-alive" and lines[-1] == "data: [DONE]"


def test_stop_reasons_from_the_wire() -> None:
    # vLLM's stream (the gateway reads it), and SGLang's finish_reason: a stop string,
    # a stop token of the request's (SGLang names EOS's id too: not a stop_reason).
    event = parse_event('{"choices": [{"text": "", "finish_reason": "stop", "stop_reason": 7}]}')
    assert isinstance(event, Delta) and event.stop_reason == 7
    assert parse_event('{"choices": [{"text": "", "stop_reason": true}]}').stop_reason is None
    assert sglang_stop_reason({"type": "stop", "matched": "\n\n"}, ()) == "\n\n"
    assert sglang_stop_reason({"type": "stop", "matched": 7}, (7,)) == 7
    assert sglang_stop_reason({"type": "stop", "matched": 2}, (7,)) is None  # EOS
    assert sglang_stop_reason({"type": "length", "length": 8}, (7,)) is None


def test_context_length_asks_what_each_engine_has() -> None:
    class Vllm:
        max_model_len = 4096

    class Hf:
        context_len = 512

    class Gateway:
        async def context_length(self) -> int:
            return 2048

    class Bridge:
        loop = None
        engine = Vllm()

    engines = (Vllm(), Hf(), Gateway(), Bridge(), object())
    lengths = [asyncio.run(context_length(e)) for e in engines]
    assert lengths == [4096, 512, 2048, 4096, None]
