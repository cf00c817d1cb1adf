"""``RemotePRM``'s side of the wire, against servers played by ``httpx.MockTransport``:
what it sends, how each kind of failure maps to a ``PRMError`` naming the requests the
failed server held, and the cooldown that keeps new placements off that server.

The same client against real ``vllm serve`` servers is ``test_prm_remote.py`` (the
vLLM stage of CI); these run in the main stage, with no server.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from adapters import hung_classify_server  # noqa: E402
from sart.demo_models import build_tokenizer  # noqa: E402
from sart.errors import PRMError  # noqa: E402
from sart.prm.base import ScoreItem  # noqa: E402
from sart.prm.remote import RemotePRM  # noqa: E402
from sart.types import BranchId  # noqa: E402

QUESTION = "What is 7 + 8?"
TEXT = "Step 1: 7 + 8 = 15.\n\nStep 2: so the answer is 15."
GOOD, BAD = "http://good.test", "http://bad.test"
Handler = Callable[[Any], Any]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def item(rid: str) -> ScoreItem:
    return ScoreItem(BranchId(rid, 0), QUESTION, TEXT, len(TEXT), False)


def answer(request: Any, logits: tuple[float, float] = (0.0, 1.0)) -> Any:
    """A ``/classify`` answer: ``logits`` for every input."""
    inputs = json.loads(request.content)["input"]
    data = [{"index": i, "probs": list(logits)} for i in range(len(inputs))]
    return httpx.Response(200, json={"data": data, "usage": {"prompt_tokens": 1}})


def raising(exc: Exception) -> Handler:
    """A server that cannot be reached: the transport raises ``exc``."""

    def handler(request: Any) -> Any:
        raise exc

    return handler


def prm(tokenizer: Any, bad: Handler, seen: list[Any] | None = None, **options: Any) -> Any:
    """A ``RemotePRM`` on two servers: ``GOOD`` answers, ``BAD`` runs ``bad``."""

    def route(request: Any) -> Any:
        if seen is not None:
            seen.append(request)
        return answer(request) if request.url.host == "good.test" else bad(request)

    transport = httpx.MockTransport(route)
    return RemotePRM([GOOD, BAD], tokenizer, transport=transport, aggregate="last", **options)


def test_it_posts_token_ids_to_classify_and_reads_column_one(tokenizer: Any) -> None:
    seen: list[Any] = []
    remote = prm(tokenizer, answer, seen, model="prm", api_key="k")
    rewards = remote.score([item("r0"), item("r1")])
    assert rewards == pytest.approx([1 / (1 + math.exp(-1))] * 2)  # softmax((0, 1))[1]
    assert {r.url.path for r in seen} == {"/classify"}
    body = json.loads(seen[0].content)
    assert body["model"] == "prm" and body["use_activation"] is False
    assert all(isinstance(t, int) for t in body["input"][0])
    assert seen[0].headers["authorization"] == "Bearer k"
    # Two requests, one per server (fewest placed first), one HTTP request each.
    assert remote.requests_sent == [1, 1]
    remote.close()


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (lambda r: httpx.Response(503, text="overloaded"), "answered 503: overloaded"),
        (lambda r: httpx.Response(200, text="not json"), "unreadable answer"),
        (lambda r: httpx.Response(200, json={"data": []}), "answered 0 results for 1 inputs"),
        # Before: "answered 1 results for 1 inputs", true and no help.
        (lambda r: answer(r, (1.0, 2.0, 3.0)), "answered 3 logits for an input"),  # type: ignore[arg-type]
        (raising(httpx.ConnectError("refused")), "ConnectError"),
        (raising(httpx.ReadTimeout("slow")), "ReadTimeout"),
    ],
)
def test_a_failing_server_fails_only_the_requests_it_held(
    tokenizer: Any, bad: Handler, said: str
) -> None:
    remote = prm(tokenizer, bad)
    with pytest.raises(PRMError, match=said) as caught:
        remote.score([item("r0"), item("r1")])
    # r0 was placed on the good server, r1 on the bad one: only r1 is named.
    assert caught.value.request_ids == frozenset({"r1"})
    assert BAD in str(caught.value)
    # The good server's reward was kept: r0 scores again without the bad server.
    assert remote.score([item("r0")]) == pytest.approx([1 / (1 + math.exp(-1))])
    remote.close()


def test_a_failed_server_is_left_out_for_its_cooldown(tokenizer: Any) -> None:
    now = [0.0]
    remote = prm(tokenizer, lambda r: httpx.Response(500, text="down"), cooldown=30.0)
    remote.placement._clock = lambda: now[0]  # a clock the test moves
    with pytest.raises(PRMError):
        remote.score([item("r0"), item("r1")])
    # r1 lost its placement; it and a new request go to the good server, though
    # the bad one holds fewer requests.
    remote.score([item("r1"), item("r2")])
    assert remote.placement.placed("r1") == 0 and remote.placement.placed("r2") == 0
    # Past the cooldown the bad server takes new requests again (and fails them).
    now[0] = 31.0
    with pytest.raises(PRMError) as caught:
        remote.score([item("r3")])
    assert caught.value.request_ids == frozenset({"r3"})
    remote.close()


def test_cancel_cuts_a_check_a_hung_server_holds_short(tokenizer: Any) -> None:
    # Before: nothing could end a check a hung server held before --prm-timeout (60 s by
    # default), and sart serve, stopping, waited that long to exit.
    with hung_classify_server() as (url, arrived):
        remote = RemotePRM([url], tokenizer, timeout=300.0, cooldown=0.0, aggregate="last")
        failures: list[BaseException] = []

        def check() -> None:
            try:
                remote.score([item("r0")])
            except BaseException as exc:
                failures.append(exc)

        checking = threading.Thread(target=check)
        checking.start()
        assert arrived.wait(timeout=60)
        remote.cancel()
        checking.join(timeout=60)  # a bound on a hang: the check's timeout is 300 s
        assert not checking.is_alive(), "the check was not cut short"
        (failure,) = failures
        assert isinstance(failure, PRMError) and failure.request_ids == {"r0"}
        assert f"PRM server {url}: the check was cancelled" in str(failure)
        # Checks after the cancel are sent as usual.
        assert remote.score([item("r1")]) == pytest.approx([1 / (1 + math.exp(-1))])
        remote.close()
