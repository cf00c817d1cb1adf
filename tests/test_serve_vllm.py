"""``sart serve`` on real vLLM, called with the official ``openai`` client: the gateway
(``--engine openai``, in its own process) in front of two ``vllm serve``
(``conftest.vllm_server_pair``, the demo policy), and the app on the test process's
vLLM engines (as ``--engine vllm`` and ``vllm-async`` run them). Skipped where vLLM is not
installed (CI runs it in its vLLM environment).

What only real upstreams show: each request's branches share their prompt's KV
through vLLM's prefix cache (``vllm:prefix_cache_hits``) when they all go to
one upstream, and a client that leaves has every branch aborted there (the
upstreams' running count falls to 0).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from adapters import fresh_vllm, fresh_vllm_async, server_metric  # noqa: E402
from sart.serve import Backend, ServeConfig, create_app  # noqa: E402
from serving import KEY, Served, Server  # noqa: E402

WORDS = "add the two numbers then check the sum carry one digit step result".split()


@pytest.fixture(scope="module")
def gateway(vllm_server_pair: tuple[str, str], demo_models: dict[str, Path]) -> Iterator[Server]:
    served = Server(
        "--engine", "openai", "--upstream", *vllm_server_pair, "--prm", "testbed",
        "--tokenizer", str(demo_models["policy"]), "--api-key", KEY,
        "--max-tokens", "24", "--max-tokens-limit", "4000", "--interval", "8",
        "--temperature", "1.0", "--batch-size", "32", "--keepalive", "0.2",
    )  # fmt: skip
    yield served
    code, log = served.stop()
    assert code == 0, log
    assert "Traceback" not in log, log


def long_prompt(seed: int, words: int = 300) -> str:
    """A prompt several KV blocks long that no other request shares."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + " Step 1: add 3 and 4."


def cache(urls: tuple[str, str]) -> tuple[float, float]:
    """Prefix-cache (queries, hits) in tokens, summed over the upstreams."""
    return (
        sum(server_metric(u, "vllm:prefix_cache_queries_total") for u in urls),
        sum(server_metric(u, "vllm:prefix_cache_hits_total") for u in urls),
    )


def test_sart_and_chat_through_the_gateway(gateway: Server) -> None:
    # The model name is the upstreams' own, read from their /v1/models.
    assert [m.id for m in gateway.client().models.list()] == ["demo"]
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200  # theirs say so
    reply = gateway.client().completions.create(
        model="demo", prompt="Step 1: add 3 and 4.", extra_body={"method": "sart", "n": 8}
    )
    extension = reply.model_extra["sart"]
    assert len(extension["branches"]) == 8
    assert reply.usage.completion_tokens == sum(b["tokens"] for b in extension["branches"])
    chat = gateway.client().chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "add 3 and 4"}],
        extra_body={"method": "sc", "n": 4},
    )
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.model_extra["sart"]["branches"]) == 4


def test_a_step_wise_client_gets_the_continuation_vllm_serve_gives(
    gateway: Server, vllm_server_pair: tuple[str, str]
) -> None:
    # A search library's loop: the answer so far as the last assistant message, with
    # vLLM's chat fields; the same model and seed give the same continuation through
    # the gateway (vanilla: one branch, seeded with the request's seed) as from vllm
    # serve itself, step after step.
    direct = openai.OpenAI(base_url=f"{vllm_server_pair[0]}/v1", api_key="none", max_retries=0)
    partial = "Step 1: add"
    for step in range(2):
        ask: dict[str, Any] = {
            "model": "demo",
            "messages": [
                {"role": "user", "content": "What is 3 plus 4?"},
                {"role": "assistant", "content": partial},
            ],
            "max_tokens": 6,
            "temperature": 1.0,
            "top_p": 1.0,
            "seed": 40 + step,
        }
        fields = {"continue_final_message": True, "add_generation_prompt": False}
        want = direct.chat.completions.create(**ask, extra_body=fields)
        got = gateway.client().chat.completions.create(
            **ask, extra_body={**fields, "method": "vanilla"}
        )
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        assert got.usage.completion_tokens == want.usage.completion_tokens
        partial += want.choices[0].message.content


def test_a_requests_branches_share_its_prompt_through_one_upstreams_cache(
    gateway: Server, vllm_server_pair: tuple[str, str]
) -> None:
    n, requests = 8, 6
    queries0, hits0 = cache(vllm_server_pair)
    for i in range(requests):
        gateway.client().completions.create(
            model="demo", prompt=long_prompt(i), extra_body={"method": "sc", "n": n}
        )
    queries, hits = (a - b for a, b in zip(cache(vllm_server_pair), (queries0, hits0)))
    # Each request's prompt is computed once and served from the cache to its other
    # branches: at least (n - 1) / n of the queried prompt tokens, but for the
    # partial last block and branches admitted in the same step as the first
    # (measured on this machine: benchmarks/gateway.py).
    assert hits >= 0.6 * queries, (hits, queries)


def test_a_client_that_leaves_has_every_branch_aborted_upstream(
    gateway: Server, vllm_server_pair: tuple[str, str]
) -> None:
    def leave() -> None:
        with pytest.raises((openai.APITimeoutError, openai.APIConnectionError)):
            gateway.client(timeout=1.0).completions.create(
                model="demo",
                prompt=long_prompt(99),
                max_tokens=3500,
                # No EOS: a tiny random model often draws one within a second, and a
                # request whose branches all end before the client leaves is no test.
                extra_body={"method": "sc", "n": 8, "ignore_eos": True},
            )

    thread = threading.Thread(target=leave)
    thread.start()
    thread.join(60)
    deadline = time.monotonic() + 20
    while any(server_metric(u, "vllm:num_requests_running") for u in vllm_server_pair):
        assert time.monotonic() < deadline, "branches still running upstream"
        time.sleep(0.05)
    gateway.wait_for(lambda m: m['sart:requests_total{status="cancelled"}'] >= 1)


# ------------------------------------------------- vLLM in the server's process


@pytest.fixture(params=["vllm", "vllm-async"])
def in_process(
    request: pytest.FixtureRequest, vllm_engine: Any, vllm_async_bridge: Any
) -> Iterator[tuple[Served, Callable[[], int]]]:
    """The app in this process (``serving.Served``) on the session's vLLM engine
    (``LLMEngine``, or ``AsyncLLM`` behind its bridge, as ``sart serve --engine vllm``
    and ``vllm-async`` run them), and a function counting vLLM's unfinished requests."""
    if request.param == "vllm":
        engine = fresh_vllm(vllm_engine)
        unfinished = vllm_engine.llm_engine.get_num_unfinished_requests
    else:
        engine = fresh_vllm_async(vllm_async_bridge)
        unfinished = vllm_async_bridge.engine.async_llm.get_num_unfinished_requests
    config = ServeConfig(models=("demo",), max_tokens=24, max_tokens_limit=4000, batch_size=32)
    served = Served(create_app(config, Backend(engine, None)), engine).__enter__()
    yield served, unfinished
    served.__exit__()


def test_in_process_vllm_answers_and_a_client_that_leaves_frees_its_branches(
    in_process: tuple[Served, Callable[[], int]],
) -> None:
    served, unfinished = in_process
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200  # AsyncLLM's too
    reply = served.openai().completions.create(
        model="demo", prompt="Step 1: add 3 and 4.", extra_body={"method": "sc", "n": 4}
    )
    assert len(reply.model_extra["sart"]["branches"]) == 4
    with pytest.raises((openai.APITimeoutError, openai.APIConnectionError)):
        served.openai().with_options(timeout=1.0).completions.create(
            model="demo",
            prompt=long_prompt(7, words=100),
            max_tokens=4000,
            extra_body={"method": "sc", "n": 16, "ignore_eos": True},  # still running at 1 s
        )
    # vLLM's running set empties (its KV is freed with it), and the request is
    # counted as cancelled: it was still running when the client left.
    served.wait_for(lambda: served.metric('sart:requests_total{status="cancelled"}') >= 1)
    served.wait_for(lambda: unfinished() == 0, timeout=60)
    served.wait_for(lambda: served.metric("sart:engine_live_branches") == 0)
