"""``sart serve --model testbed`` when its PRM's process dies (killed for memory, a crash
in native code): the command in its own process on 127.0.0.1, the official ``openai``
client. The PRM process is started again and requests that need rewards are served
again, rather than failing for good while ``/health`` says 200.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from sart import testbed as tb  # noqa: E402
from serving import Server  # noqa: E402

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="finds the PRM's process in /proc"
)


def prm_process(server: Server) -> int:
    """The pid of the server's PRM process (spawned by multiprocessing, from any of the
    server's threads)."""
    pid = server.process.pid
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += (task / "children").read_text().split()
    found = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(found) == 1, found
    return int(found[0])


def test_a_killed_prm_process_is_started_again_and_requests_are_served() -> None:
    server = Server("--no-access-log")
    try:
        client = server.client(key="none", timeout=60)
        question = tb.make_questions(seed=2, count=1)[0]
        extra = {"method": "sart", "n": 4}
        first = client.completions.create(model="testbed", prompt=question.prompt, extra_body=extra)
        assert first.model_extra["sart"]["answer"] is not None

        os.kill(prm_process(server), signal.SIGKILL)
        for seed in range(3):
            reply = client.completions.create(
                model="testbed", prompt=question.prompt, seed=seed, extra_body=extra
            )
            assert reply.model_extra["sart"]["answer"] is not None
        assert server.metrics()['sart:requests_total{status="failed"}'] == 0
    finally:
        code, log = server.stop()
    assert code == 0, log
    assert "the PRM process exited (exit code -9): starting it again" in log, log
