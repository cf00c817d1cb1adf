"""``sart serve`` told to stop under load, as an orchestrator stops it (SIGTERM): the
command in its own process on 127.0.0.1, the testbed, the official ``openai`` client.

Every request in flight gets an answer: its result if it finishes within the
grace period, else a 503 in OpenAI's error shape (an error event when
streaming); the process exits 0, promptly, with no traceback in its log.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from sart import testbed as tb  # noqa: E402
from serving import Server  # noqa: E402

#: Each request takes every slot (16 branches, --batch-size 16) for 64 tokens a
#: branch: they run one after the other, several seconds of work in all.
LONG = {"method": "sc", "n": 16, "ignore_eos": True}


def ask(server: Server, prompt: str, stream: bool, outcomes: list[Any], extra: Any = LONG) -> None:
    client = server.client(key="none", timeout=60)
    try:
        reply = client.completions.create(
            model="testbed", prompt=prompt, max_tokens=64, stream=stream, extra_body=extra
        )
        if stream:
            list(reply)
        outcomes.append("ok")
    except openai.APIStatusError as error:  # an HTTP error status
        outcomes.append((error.status_code, error.body))
    except openai.APIError as error:  # an error event in a stream
        outcomes.append(("event", error.message))
    except Exception as error:  # a connection cut short: what must not happen
        outcomes.append((type(error).__name__, str(error)))


def test_sigterm_under_load_answers_every_request_and_exits_0() -> None:
    server = Server("--batch-size", "16", "--shutdown-grace", "0.5", "--no-access-log")
    questions = tb.make_questions(seed=5, count=12)
    outcomes: list[Any] = []
    clients = [
        threading.Thread(target=ask, args=(server, q.prompt, k % 2 == 1, outcomes))
        for k, q in enumerate(questions)
    ]
    for client in clients:
        client.start()
    server.wait_for(lambda m: m['sart:requests_total{status="completed"}'] >= 1, timeout=60)
    server.process.send_signal(signal.SIGTERM)
    start = time.monotonic()
    code = server.process.wait(timeout=60)
    took = time.monotonic() - start
    for client in clients:
        client.join(timeout=60)
    log = Path(server.log.name).read_text()
    server.log.close()

    assert code == 0, log  # not 143: a clean shutdown is a clean exit
    assert "Traceback" not in log, log
    assert took < 15, f"took {took:.1f} s to exit"
    assert len(outcomes) == len(questions)
    refused = [o for o in outcomes if o != "ok"]
    assert refused, "every request finished: the load did not outlast the grace period"
    for outcome in refused:
        kind, detail = outcome
        if kind == "event":  # streamed: the stream's error event
            assert "shutting down" in detail, outcomes
        else:  # 503 in OpenAI's error shape, not uvicorn's plain-text 500
            assert kind == 503, outcomes
            assert "shutting down" in detail["message"], outcomes


def test_a_hung_prm_server_does_not_hold_the_stopping_server_past_its_grace() -> None:
    # Before: the drain answered the request 503 after the grace, but the process waited
    # for the PRM check in flight to time out (--prm-timeout, 60 s by default) before it
    # exited. Now the check is cut short when the server stops.
    from adapters import hung_classify_server

    with hung_classify_server() as (url, arrived):
        server = Server(
            "--prm-url", url, "--prm", str(tb.PRM_PATH), "--prm-timeout", "300",
            "--shutdown-grace", "0.5", "--no-access-log",
        )  # fmt: skip
        outcomes: list[Any] = []
        question = tb.make_questions(seed=5, count=1)[0]
        sart = {"method": "sart", "n": 4}  # checks at once: the testbed's T is small
        client = threading.Thread(target=ask, args=(server, question.prompt, False, outcomes, sart))
        client.start()
        assert arrived.wait(timeout=60), "no check reached the PRM server"
        server.process.send_signal(signal.SIGTERM)
        try:
            # A bound on a hang: waiting for the check to time out takes 300 s.
            code = server.process.wait(timeout=60)
        finally:
            if server.process.poll() is None:
                server.process.kill()
        client.join(timeout=60)
    log = Path(server.log.name).read_text()
    server.log.close()
    assert code == 0, log
    assert "Traceback" not in log, log
    ((status, body),) = outcomes
    assert status == 503 and "shutting down" in body["message"], outcomes
