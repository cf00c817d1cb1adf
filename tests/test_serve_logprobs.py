"""``logprobs`` from ``sart serve``: tokens named as vLLM names them
(``sart.serve.logprobs``), and the chosen branch's tokens in ``vllm serve``'s shapes, on
the testbed served as a user starts it, read with the official ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

import httpx
import openai

from sart import testbed as tb
from sart.messages import TokenLogprobs
from sart.serve.logprobs import TokenNames, chat_logprobs, completion_logprobs
from serving import KEY, Server

QUESTION = tb.testbed("testbed").questions(3, 1)[0].prompt
MESSAGES = [{"role": "user", "content": QUESTION}]


# ------------------------------------------------------------------- naming tokens


def byte_tokenizer() -> Any:
    """A byte-level tokenizer of single bytes: "é" is two tokens, each half a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_half_a_character_is_named_where_the_character_completes() -> None:
    # As vLLM: the first byte of "é" is "", the second the whole character.
    tokenizer = byte_tokenizer()
    ids = tokenizer("é!").input_ids
    assert [tokenizer.decode([i]) for i in ids] == ["\ufffd", "\ufffd", "!"]
    names = TokenNames(tokenizer)
    assert [names.at(t, ids[:j]) for j, t in enumerate(ids)] == ["", "é", "!"]
    assert names.with_bytes(ids[1], ids[:1]) == ("é", list("é".encode()))


def test_a_sentencepiece_tokens_leading_space_is_kept() -> None:
    # decode() strips a Metaspace tokenizer's leading "▁" from a lone token.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"▁hello": 0, "▁world": 1, "x": 2, "[UNK]": 3}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Metaspace()
    words.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words)
    assert tokenizer.decode([1]) == "world"
    names = TokenNames(tokenizer)
    assert [names.alone(t) for t in (0, 1, 2)] == [" hello", " world", "x"]


class Words:
    """Token ``t`` is `` w{t}``."""

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(f" w{t}" for t in ids)


def test_vllms_order_the_sampled_token_first_each_token_once() -> None:
    names = TokenNames(Words())
    outside = TokenLogprobs(-3.0, (-0.5, -1.0), 9, (4, 5))  # sampled outside the top 2
    inside = TokenLogprobs(-1.0, (-0.5, -1.0), 5, (4, 5))  # sampled the 2nd likeliest
    floor = TokenLogprobs(float("-inf"), (-0.1,), 7, (4,))
    chat = chat_logprobs(names, [outside, inside, floor], 2)["content"]
    assert [[t["token"] for t in c["top_logprobs"]] for c in chat] == [
        [" w9", " w4"],  # chat: the first k of vLLM's list
        [" w5", " w4"],
        [" w7", " w4"],
    ]
    assert chat[2]["logprob"] == -9999.0 and chat[0]["bytes"] == list(b" w9")
    assert list(chat[0]) == ["token", "logprob", "bytes", "top_logprobs"]
    completion = completion_logprobs(names, [outside, inside], 2)
    assert completion["top_logprobs"] == [
        {" w9": -3.0, " w4": -0.5, " w5": -1.0},  # the sampled token and the k likeliest
        {" w5": -1.0, " w4": -0.5},
    ]
    assert completion["tokens"] == [" w9", " w5"] and completion["text_offset"] == [0, 3]
    assert completion["token_logprobs"] == [-3.0, -1.0]


def test_return_tokens_as_token_ids_names_them_as_vllm_does() -> None:
    names = TokenNames(Words())
    outside = TokenLogprobs(-3.0, (-0.5, -1.0), 9, (4, 5))
    (chat,) = chat_logprobs(names, [outside], 2, as_ids=True)["content"]
    # vLLM's: the sampled token's bytes are still its text's; its list's, their names'.
    assert (chat["token"], chat["bytes"]) == ("token_id:9", list(b" w9"))
    assert [(t["token"], t["bytes"]) for t in chat["top_logprobs"]] == [
        ("token_id:9", list(b"token_id:9")),
        ("token_id:4", list(b"token_id:4")),
    ]
    completion = completion_logprobs(None, [outside, outside], 1, as_ids=True)
    assert completion["tokens"] == ["token_id:9"] * 2 and completion["text_offset"] == [0, 10]
    assert completion["top_logprobs"][0] == {"token_id:9": -3.0, "token_id:4": -0.5}


# ------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    served = Server("--api-key", KEY, "--max-tokens", "48")
    yield served
    code, log = served.stop()
    assert code == 0, log
    assert "Traceback" not in log and "ERROR" not in log, log


@pytest.fixture(scope="module")
def names() -> Any:
    """The testbed's tokens' texts, each id decoded alone (as vLLM names them)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tb.testbed("testbed").policy_path)

    def named(text: str, finish: str | None) -> list[str]:
        # A branch that ended at EOS has its token too (not in the text), as vLLM's.
        eos = [tokenizer.eos_token] if finish == "stop" else []
        return [tokenizer.decode([i]) for i in tokenizer(text).input_ids] + eos

    return named


def _chosen_tokens(reply: Any) -> int:
    extension = reply.model_extra["sart"]
    return int(extension["branches"][extension["chosen"]]["tokens"])


def _chat(server: Server, top_logprobs: int, **sampling: Any) -> Any:
    """The testbed's answer to the question, with ``top_logprobs``."""
    return server.client().chat.completions.create(
        model="testbed",
        messages=MESSAGES,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=top_logprobs,
        **sampling,
    )


@pytest.mark.parametrize("method", ["vanilla", "sart", "rebase"])
def test_chat_logprobs_name_the_chosen_branchs_tokens(
    server: Server, names: Any, method: str
) -> None:
    # rebase: the chosen branch may be a fork, whose first tokens its parent made.
    n = 1 if method == "vanilla" else 4
    reply = _chat(server, 3, seed=7, extra_body={"method": method, "n": n})
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == _chosen_tokens(reply) > 0
    assert [t.token for t in content] == names(choice.message.content, choice.finish_reason)
    for token in content:
        assert token.bytes == list(token.token.encode())
        assert len(token.top_logprobs) == 3
        # vLLM's list: the sampled token first, then the likeliest others, each once.
        first = token.top_logprobs[0]
        assert (first.token, first.logprob) == (token.token, token.logprob)
        others = [t.logprob for t in token.top_logprobs[1:]]
        assert others == sorted(others, reverse=True) and all(v <= 0 for v in others)
        assert len({t.token for t in token.top_logprobs}) == 3


def test_greedy_tokens_are_the_likeliest(server: Server) -> None:
    reply = _chat(server, 2, temperature=0.0, extra_body={"method": "vanilla"})
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content
    for token in content:
        assert token.logprob >= max(t.logprob for t in token.top_logprobs) - 1e-5


def test_completion_logprobs_in_vllms_completions_shape(server: Server, names: Any) -> None:
    reply = server.client().completions.create(
        model="testbed", prompt=QUESTION, logprobs=2, seed=3, extra_body={"method": "sc", "n": 2}
    )
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == _chosen_tokens(reply) > 0
    assert logprobs.tokens == names(choice.text, choice.finish_reason)
    assert logprobs.text_offset is not None and logprobs.top_logprobs is not None
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs or [], logprobs.top_logprobs, strict=True
    ):
        # The sampled token and the two likeliest: 2 or 3 entries.
        assert top[token] == value and len(top) in (2, 3)


def test_a_stream_carries_the_logprobs_of_its_answer(server: Server) -> None:
    ask = {"model": "testbed", "messages": MESSAGES, "logprobs": True, "top_logprobs": 1}
    ask["seed"] = 11
    ask["extra_body"] = {"method": "vanilla"}
    whole = server.client().chat.completions.create(**ask)  # type: ignore[call-overload]
    streamed = []
    for chunk in server.client().chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert streamed == whole.choices[0].logprobs.content


@pytest.mark.parametrize(
    ("path", "body", "param", "said"),
    [
        (
            "chat/completions",
            {"messages": MESSAGES, "top_logprobs": 2},
            "top_logprobs",
            "top_logprobs=2 needs logprobs=true",
        ),
        (
            "chat/completions",
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "top_logprobs=21 must be in [0, 20] (the server's --max-logprobs)",
        ),
        ("completions", {"prompt": QUESTION, "logprobs": -1}, "logprobs", "logprobs=-1 must be"),
        (
            "completions",
            {"prompt": QUESTION, "logprobs": 1, "echo": True},
            "echo",
            "the prompt's log-probabilities too",
        ),
    ],
)
def test_what_cannot_be_answered_is_refused_naming_the_field(
    server: Server, path: str, body: dict, param: str, said: str
) -> None:
    reply = httpx.post(
        f"{server.url}/v1/{path}",
        json={"model": "testbed", **body},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and said in error["message"]


def test_models_allow_logprobs(server: Server) -> None:
    (model,) = server.client().models.list().data
    assert model.model_extra["permission"][0]["allow_logprobs"] is True
    assert isinstance(server.client(), openai.OpenAI)
