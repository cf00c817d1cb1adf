"""``sart serve --model testbed``, as a user runs it: the command in its own process on
127.0.0.1, the shipped testbed model and PRM, the official ``openai`` client.

One server serves the whole module (it starts in a few seconds); each test
reads the metrics it checks as differences. The load test runs 64 concurrent
clients: a bounded version in the default suite, a longer one with ``--slow``.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

import sart  # noqa: E402
from sart import testbed as tb  # noqa: E402
from serving import KEY, Server  # noqa: E402

QUESTIONS = tb.make_questions(7, 40)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    served = Server("--api-key", KEY, "--batch-size", "32", "--keepalive", "0.2")
    yield served
    code, log = served.stop()
    assert code == 0, log
    assert "Traceback" not in log and "ERROR" not in log, log


CANCELLED = 'sart:requests_total{status="cancelled"}'
IDLE = (
    "sart:num_requests_running",
    "sart:num_requests_waiting",
    "sart:num_branches_running",
    "sart:engine_live_branches",
)


def idle(metrics: dict[str, float]) -> bool:
    return all(metrics[name] == 0 for name in IDLE)


# ------------------------------------------------------------------ the API


def test_health_and_metrics_are_open_models_need_the_key(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "sart:num_branches_running" in httpx.get(f"{server.url}/metrics").text
    (model,) = server.client().models.list().data
    assert model.id == "testbed"
    assert model.model_extra["sart"]["method"] == "sart"
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()


def test_a_completion_answers_with_the_chosen_branch(server: Server) -> None:
    question = QUESTIONS[0]
    reply = server.client().completions.create(model="testbed", prompt=question.prompt)
    extension = reply.model_extra["sart"]
    branches = extension["branches"]
    assert (extension["method"], extension["policy"], len(branches)) == ("sart", "sart(n=8,m=4)", 8)
    chosen = branches[extension["chosen"]]
    assert chosen["status"] in ("finished", "truncated")
    assert reply.choices[0].finish_reason == (
        "stop" if chosen["status"] == "finished" else "length"
    )
    assert extension["answer"] == chosen["answer"] == sart.extract_answer(reply.choices[0].text)
    assert reply.usage.completion_tokens == sum(b["tokens"] for b in branches)
    assert reply.usage.prompt_tokens == len(question.prompt.split())
    assert {b["status"] for b in branches} <= {"finished", "truncated", "pruned", "stopped"}
    assert all(b["reward"] is not None for b in branches if b["status"] == "finished")
    assert extension["queue_time"] >= 0 and extension["inference_time"] > 0


def test_a_prompt_of_token_ids_is_scored_by_the_prm_as_its_text(server: Server) -> None:
    # The PRM reads the question as text; given the ids, it failed the request after it
    # ran, with a 500 ("QwenMathPRM needs the question as text").
    from transformers import AutoTokenizer

    question = QUESTIONS[1]
    ids = AutoTokenizer.from_pretrained(tb.POLICY_PATH).encode(question.prompt)
    by_text, by_ids = (
        server.client().completions.create(
            model="testbed", prompt=prompt, seed=3, extra_body={"method": "sart", "n": 4}
        )
        for prompt in (question.prompt, ids)
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    rewards = [[b["reward"] for b in r.model_extra["sart"]["branches"]] for r in (by_text, by_ids)]
    assert rewards[0] == rewards[1]


def test_chat_uses_the_chat_template_and_extra_body_picks_the_policy(server: Server) -> None:
    question = QUESTIONS[1]
    reply = server.client().chat.completions.create(
        model="testbed",
        messages=[{"role": "user", "content": question.prompt}],
        extra_body={"method": "sc", "n": 4, "interval": 8},
        seed=3,
    )
    extension = reply.model_extra["sart"]
    assert (extension["policy"], len(extension["branches"])) == ("self-consistency(n=4)", 4)
    assert reply.choices[0].message.role == "assistant"
    assert tb.grade(question, reply.choices[0].message.content) == (
        extension["answer"] == question.answer
    )
    # The testbed's template is its prompt and a space: the same tokens as the prompt.
    assert reply.usage.prompt_tokens == len(question.prompt.split())
    again = server.client().chat.completions.create(
        model="testbed",
        messages=[{"role": "user", "content": question.prompt}],
        extra_body={"method": "sc", "n": 4, "interval": 8},
        seed=3,
    )
    assert again.model_extra["sart"]["branches"] == extension["branches"]  # seeded


def test_a_step_wise_client_continues_the_assistants_partial_answer(server: Server) -> None:
    # A search library's loop: each call sends the answer so far as the last assistant
    # message with vLLM's continue_final_message, and asks for one more stretch.
    question = QUESTIONS[2]
    client = server.client()
    partial = ""
    for step in range(3):
        messages = [{"role": "user", "content": question.prompt}]
        extra: dict[str, object] = {"method": "vanilla"}
        if partial:
            messages.append({"role": "assistant", "content": partial})
            extra.update(continue_final_message=True, add_generation_prompt=False)
        reply = client.chat.completions.create(
            model="testbed", messages=messages, max_tokens=6, seed=step, extra_body=extra
        )
        # The template joins contents by spaces; continued, it adds nothing after them.
        expected = question.prompt + (f" {partial}" if partial else " ")
        assert reply.usage.prompt_tokens == len(expected.split())
        # The same continuation as a plain completion of the rendered text.
        plain = client.completions.create(
            model="testbed",
            prompt=expected,
            max_tokens=6,
            seed=step,
            extra_body={"method": "vanilla"},
        )
        assert reply.choices[0].message.content == plain.choices[0].text
        partial += reply.choices[0].message.content
    assert len(partial.split()) >= 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"continue_final_message": True}, "cannot be used together"),
        (
            {"continue_final_message": True, "add_generation_prompt": False, "last": "user"},
            "must be the assistant's",
        ),
    ],
)
def test_continue_final_message_is_refused_where_vllm_refuses_it(
    server: Server, extra: dict[str, object], message: str
) -> None:
    last = extra.pop("last", "assistant")
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model="testbed",
            messages=[{"role": "user", "content": "Q"}, {"role": last, "content": "A"}],
            extra_body={"method": "vanilla", **extra},
        )
    assert info.value.body["param"] == "continue_final_message"
    assert message in info.value.body["message"]


def test_a_field_neither_api_knows_is_ignored_as_vllm_ignores_it(server: Server) -> None:
    reply = server.client().completions.create(
        model="testbed",
        prompt=QUESTIONS[3].prompt,
        max_tokens=4,
        extra_body={"method": "vanilla", "alpah": 0.3, "stream_options_x": 1},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_vanilla_and_the_other_methods_by_name(server: Server) -> None:
    client = server.client()
    prompt = QUESTIONS[2].prompt
    for method, policy in [
        ("vanilla", "vanilla"),
        ("sart-no-prune", "sart-no-prune(n=4,m=2)"),
        ("rebase", "rebase(n=4)"),
        ("sart", "sart(n=4,m=1)"),
    ]:
        extra = {"method": method} if method == "vanilla" else {"method": method, "n": 4}
        if method == "sart":
            extra.update(m=1, alpha=0.2, beta=1, selector="majority")
            policy += ",select=majority"
        reply = client.completions.create(model="testbed", prompt=prompt, extra_body=extra)
        assert reply.model_extra["sart"]["policy"] == policy
    reply = client.completions.create(model="testbed", prompt=prompt, best_of=3)
    assert len(reply.model_extra["sart"]["branches"]) == 3  # best_of: branches of the default


def test_usage_adds_up_from_the_branches_when_forks_share_a_prefix(server: Server) -> None:
    # rebase replaces a pruned branch by a fork of a better one: the fork's first tokens
    # are its parent's, generated (and counted in usage) once. The sart field says which.
    client = server.client()
    forks = 0
    for question in QUESTIONS[:12]:
        reply = client.completions.create(
            model="testbed", prompt=question.prompt, extra_body={"method": "rebase", "n": 4}
        )
        branches = reply.model_extra["sart"]["branches"]
        assert reply.usage.completion_tokens == sum(b["tokens"] - b["inherited"] for b in branches)
        for branch in branches:
            if branch["parent"] is None:
                assert branch["inherited"] == 0
                continue
            forks += 1
            parent = branches[branch["parent"]]
            assert 0 < branch["inherited"] <= min(branch["tokens"], parent["tokens"])
        if forks:
            break
    assert forks  # rebase(n=4) prunes, and forks, on about one testbed question in two


def test_confidence_methods_need_no_prm_and_report_rewards(server: Server) -> None:
    client = server.client()
    question = QUESTIONS[4]
    before = server.metrics()["sart:prm_items_total"]
    for method, policy in [
        ("deepconf", "deepconf-online(n=8,warmup=2,keep=90)"),
        ("sart-conf", "sart-confidence(n=8,m=4)"),
    ]:
        reply = client.completions.create(
            model="testbed",
            prompt=question.prompt,
            extra_body={"method": method, "n": 8, "interval": 8},
        )
        extension = reply.model_extra["sart"]
        assert extension["policy"] == policy
        done = [b for b in extension["branches"] if b["status"] in ("finished", "truncated")]
        assert done and all(0.0 < b["reward"] < 1.0 for b in done)
        assert extension["answer"] == sart.extract_answer(reply.choices[0].text)
    # Every reward came from the policy's own log-probabilities: the PRM scored nothing.
    # (The module's server runs one request at a time here: the other tests have ended.)
    assert server.metrics()["sart:prm_items_total"] == before


def test_streaming_with_the_openai_client(server: Server) -> None:
    question = QUESTIONS[3]
    chunks = list(
        server.client().chat.completions.create(
            model="testbed",
            messages=[{"role": "user", "content": question.prompt}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = next(c for c in reversed(chunks) if c.choices)
    assert last.choices[0].finish_reason in ("stop", "length")
    assert last.model_extra["sart"]["answer"] == sart.extract_answer(text)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(
        b["tokens"] for b in last.model_extra["sart"]["branches"]
    )
    pieces = list(
        server.client().completions.create(model="testbed", prompt=question.prompt, stream=True)
    )
    assert "".join(p.choices[0].text for p in pieces).endswith("}")


def test_a_stream_is_kept_alive_until_its_answer_is_decided(server: Server) -> None:
    # A prompt that is not a question: the testbed babbles until max_tokens.
    request = {"model": "testbed", "prompt": "hello world", "method": "sc", "n": 8, "seed": 1}
    request["stream"] = True  # seed 1: four of the branches run to max_tokens (about 1 s)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=request, headers=headers, timeout=30
    ) as stream:
        lines = [line for line in stream.iter_lines() if line]
    keepalives = [i for i, line in enumerate(lines) if line == ": keep-alive"]
    data = [i for i, line in enumerate(lines) if line.startswith("data: {")]
    assert keepalives and data and max(keepalives) < min(data)
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[data[-1]][len("data: ") :])
    assert final["choices"][0]["finish_reason"] in ("stop", "length")


# ------------------------------------------------------------------ refusals

BAD_INPUTS = [
    # (what, body or raw bytes, headers, status, param, message fragment)
    ("no key", {"model": "testbed", "prompt": "x"}, {}, 401, None, "API key"),
    (
        "wrong key",
        {"model": "testbed", "prompt": "x"},
        {"Authorization": "Bearer no"},
        401,
        None,
        "API key",
    ),
    ("malformed JSON", b'{"model": "testbed", "prompt": ', None, 400, None, "not valid JSON"),
    ("not an object", b"[1, 2]", None, 400, None, "JSON object"),
    ("missing prompt", {"model": "testbed"}, None, 400, "prompt", "prompt is required"),
    (
        "prompt type",
        {"model": "testbed", "prompt": 5},
        None,
        400,
        "prompt",
        "prompt=5 must be a string or",
    ),
    (
        "prompt list of str",
        {"model": "testbed", "prompt": ["a", "b"]},
        None,
        400,
        "prompt",
        "must be a string or",
    ),
    (
        "temperature type",
        {"model": "testbed", "prompt": "x", "temperature": "hot"},
        None,
        400,
        "temperature",
        "temperature='hot' must be a number",
    ),
    (
        "temperature range",
        {"model": "testbed", "prompt": "x", "temperature": -1},
        None,
        400,
        "temperature",
        "temperature=-1",
    ),
    (
        "n as a string",
        {"model": "testbed", "prompt": "x", "method": "sc", "n": "4"},
        None,
        400,
        "n",
        "n='4' must be an integer",
    ),
    (
        "n over the limit",
        {"model": "testbed", "prompt": "x", "method": "sc", "n": 33},
        None,
        400,
        "n",
        "n=33 must be <= 32",
    ),
    (
        "n choices",
        {"model": "testbed", "prompt": "x", "n": 2},
        None,
        400,
        "n",
        "asks for 2 choices",
    ),
    (
        "max_tokens over the limit",
        {"model": "testbed", "prompt": "x", "max_tokens": 257},
        None,
        400,
        "max_tokens",
        "max_tokens=257 must be <= 256",
    ),
    (
        "max_tokens zero",
        {"model": "testbed", "prompt": "x", "max_tokens": 0},
        None,
        400,
        "max_tokens",
        "max_tokens=0 must be >= 1",
    ),
    (
        "a prompt over the context",  # 100k tokens: refused before any forward, as vLLM does
        {"model": "testbed", "prompt": "Q 2 " * 50_000},
        None,
        400,
        "prompt",
        "leaves no room in the model's context of 512 tokens",
    ),
    (
        "token ids over the context",
        {"model": "testbed", "prompt": [5] * 600},
        None,
        400,
        "prompt",
        "a prompt of 600 tokens leaves no room",
    ),
    (
        "token ids outside the vocabulary",  # the embedding would raise on it: a 500
        {"model": "testbed", "prompt": [5, 10**6]},
        None,
        400,
        "prompt",
        "token ids [1000000] lie outside the model's vocabulary",
    ),
    (
        "unknown model",
        {"model": "gpt-4", "prompt": "x"},
        None,
        404,
        "model",
        "model='gpt-4' is not served",
    ),
    (
        "unknown method",
        {"model": "testbed", "prompt": "x", "method": "best"},
        None,
        400,
        "method",
        "method='best' must be one of",
    ),
    (
        "option of another method",
        {"model": "testbed", "prompt": "x", "method": "sc", "alpha": 0.3},
        None,
        400,
        "alpha",
        "does not apply to method 'sc'",
    ),
    (
        "m above n",
        {"model": "testbed", "prompt": "x", "method": "sart", "n": 4, "m": 5},
        None,
        400,
        "m",
        "m=5 must be <= n=4",
    ),
    (
        "unsupported field",
        {"model": "testbed", "prompt": "x", "logit_bias": {"5": 1.0}},
        None,
        400,
        "logit_bias",
        "not supported",
    ),
    (
        "a code path",
        {"model": "testbed", "prompt": "x", "method": "os:system"},
        None,
        400,
        "method",
        "must be one of",
    ),
    (
        "a chat template",
        {
            "model": "testbed",
            "messages": [{"role": "user", "content": "x"}],
            "chat_template": "{{x}}",
        },
        None,
        400,
        "chat_template",
        "not supported",
    ),
    (
        "a bad role",
        {"model": "testbed", "messages": [{"role": "root", "content": "x"}]},
        None,
        400,
        "messages",
        "messages.0.role='root' must be",
    ),
]


@pytest.mark.parametrize(
    ("body", "headers", "status", "param", "fragment"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_is_refused_naming_the_field(
    server: Server,
    body: object,
    headers: dict | None,
    status: int,
    param: str | None,
    fragment: str,
) -> None:
    path = (
        "/v1/chat/completions"
        if isinstance(body, dict) and "messages" in body
        else "/v1/completions"
    )
    headers = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
    send = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{server.url}{path}", headers=headers, timeout=30, **send)
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (status, status, param)
    assert fragment in error["message"]


def test_bad_input_leaves_the_server_serving(server: Server) -> None:
    for case in BAD_INPUTS[:4]:
        body = case[1]
        send = {"content": body} if isinstance(body, bytes) else {"json": body}
        httpx.post(f"{server.url}/v1/completions", timeout=30, **send)
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").completions.create(model="testbed", prompt="x")
    with pytest.raises(openai.BadRequestError, match="n=99 must be <= 32"):
        server.client().completions.create(
            model="testbed", prompt="x", extra_body={"method": "sc", "n": 99}
        )
    assert server.client().completions.create(model="testbed", prompt=QUESTIONS[4].prompt).choices
    assert httpx.get(f"{server.url}/health").status_code == 200


# ------------------------------------------------------------------ disconnects


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_client_that_leaves_has_its_branches_aborted(server: Server, stream: bool) -> None:
    before = server.wait_for(idle)
    request = {"model": "testbed", "prompt": "hello world", "method": "sc", "n": 8, "seed": 1}
    request["stream"] = stream
    payload = json.dumps(request).encode()
    host, port = server.url.removeprefix("http://").split(":")
    rid = f"leaves-{'stream' if stream else 'plain'}"
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nX-Request-Id: {rid}\r\n".encode()
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        # The testbed babbles up to 256 tokens per branch for this prompt (most reach
        # it; about 1 s): leave while it runs.
        server.wait_for(lambda m: m["sart:engine_live_branches"] > 0)
    after = server.wait_for(lambda m: m[CANCELLED] == before[CANCELLED] + 1 and idle(m))

    def delta(name: str) -> float:
        return after[name] - before[name]

    # Every branch still running when the client left was aborted (some may have ended
    # by themselves before); nothing is left in the engine (idle above).
    aborted = delta('sart:branches_failed_total{cause="cancelled"}')
    ended = sum(
        delta(f'sart:branches_finished_total{{finish_reason="{r}"}}') for r in ("stop", "length")
    )
    assert aborted > 0 and aborted + ended == 8
    made = after["sart:generation_tokens_total"] - before["sart:generation_tokens_total"]
    assert 0 < made < 8 * 256  # cut short, not run to max_tokens
    # One line says so, at INFO, with the request's id and what it had cost.
    line = rf"^INFO: +cmpl-{rid}: the client disconnected: cancelled after \S+ s, (\d+) tokens"
    found = _wait_for_line(server.log.name, line)
    assert int(found.group(1)) == made


def _wait_for_line(log: str, pattern: str, timeout: float = 10) -> re.Match[str]:
    """The first match of ``pattern`` in the file ``log``, once it is written."""
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(pattern, Path(log).read_text(), re.M)
        if found:
            return found
        assert time.monotonic() < deadline, f"no line {pattern!r} in:\n{Path(log).read_text()}"
        time.sleep(0.05)


def _time_out(server: Server, rid: str) -> None:
    """A request past its ``timeout``, answered 504."""
    with pytest.raises(openai.APIStatusError) as late:
        server.client().completions.create(
            model="testbed",
            prompt=QUESTIONS[5].prompt,
            extra_body={"method": "sc", "n": 8, "timeout": 0.01},
            extra_headers={"X-Request-Id": rid},
        )
    assert late.value.status_code == 504


def test_sarts_log_lines_follow_uvicorns_format_and_log_level(server: Server) -> None:
    _time_out(server, "late-info")
    _wait_for_line(server.log.name, r"^WARNING: +cmpl-late-info: the request timed out")
    with socket.socket() as probe:  # a free port: at --log-level error, no line names it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    quiet = Server("--log-level", "error", "--api-key", KEY, port=port)
    try:
        _time_out(quiet, "late-quiet")
        assert quiet.metrics()['sart:requests_total{status="timeout"}'] == 1
    finally:
        code, log = quiet.stop()
    assert code == 0 and "late-quiet" not in log, log


# ------------------------------------------------------------------ load


async def _load(server: Server, clients: int, each: int, plan: Callable[[int], dict]) -> list:
    """``clients`` concurrent clients, each sending ``each`` requests one after the
    other; returns (client, sequence, question, reply) per request."""
    client = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1",
        api_key=KEY,
        max_retries=0,
        timeout=600,
        http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=clients)),
    )

    async def one(c: int) -> list:
        out = []
        for k in range(each):
            question = QUESTIONS[(c * each + k) % len(QUESTIONS)]
            reply = await client.completions.create(
                model="testbed", prompt=question.prompt, extra_body=plan(c)
            )
            out.append((c, k, question, reply))
        return out

    async with client:
        done = await asyncio.gather(*(one(c) for c in range(clients)))
    return [row for rows in done for row in rows]


def _check_load(server: Server, before: dict, rows: list, clients: int, each: int) -> float:
    assert len(rows) == clients * each
    assert len({(c, k) for c, k, _, _ in rows}) == clients * each  # none lost
    assert len({reply.id for *_, reply in rows}) == clients * each  # none duplicated
    graded = [tb.grade(question, reply.choices[0].text) for _, _, question, reply in rows]
    for _, _, question, reply in rows:  # each reply answers its own question
        assert reply.usage.prompt_tokens == len(question.prompt.split())
        assert reply.model_extra["sart"]["answer"] == sart.extract_answer(reply.choices[0].text)
    after = server.wait_for(idle)
    done = 'sart:requests_total{status="completed"}'
    assert after[done] - before[done] == clients * each
    return sum(graded) / len(graded)


def test_64_concurrent_clients(server: Server) -> None:
    methods = [{"method": "vanilla"}, {"method": "sc", "n": 4}, {"method": "sart", "n": 4}]
    before = server.wait_for(idle)
    rows = asyncio.run(_load(server, 64, 2, lambda c: methods[c % 3]))
    accuracy = _check_load(server, before, rows, 64, 2)
    assert accuracy > 0.6  # real answers (vanilla alone is about 0.75 on these)


@pytest.mark.slow
def test_64_concurrent_clients_with_sart_n8(server: Server) -> None:
    before = server.wait_for(idle)
    rows = asyncio.run(_load(server, 64, 4, lambda c: {"method": "sart", "n": 8}))
    accuracy = _check_load(server, before, rows, 64, 4)
    assert accuracy > 0.9


def test_the_long_testbed_serves_with_its_defaults() -> None:
    # Its own server: the long testbed's policy and PRM, T = 64, 2,048 tokens a branch.
    served = Server("--model", "testbed-long", "--batch-size", "8")
    try:
        (model,) = served.client().models.list().data
        assert model.id == "testbed-long"
        question = tb.LONG.questions(0, 1)[0]
        reply = served.client().completions.create(
            model="testbed-long", prompt=question.prompt, extra_body={"method": "sart", "n": 4}
        )
    finally:
        code, log = served.stop()
    assert code == 0 and "Traceback" not in log, log
    extension = reply.model_extra["sart"]
    assert extension["policy"].startswith("sart(n=4")
    tokens = [b["tokens"] for b in extension["branches"]]
    assert max(tokens) <= 2048 and max(tokens) > 100  # long traces, within its cap
    assert extension["answer"] == sart.extract_answer(reply.choices[0].text)
    assert reply.usage.prompt_tokens == len(question.prompt.split())
