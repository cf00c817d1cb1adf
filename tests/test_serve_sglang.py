"""``sart serve`` on a real SGLang (``--engine sglang``: ``sglang.Engine`` behind its
bridge), called with the official ``openai`` client: it answers, and a client that
leaves has every branch of its request gone from SGLang. The session's SGLang engine
on the demo policy (``conftest.sglang_engine``); skipped where SGLang is not
installed (failed with ``SART_REQUIRE_SGLANG=1``, as CI's SGLang run sets).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from sart.serve import Backend, ServeConfig, create_app  # noqa: E402
from serving import Served  # noqa: E402
from sglang_cpu import in_flight, sglang_adapter, wait_for_load  # noqa: E402


def test_sart_serve_on_sglang_answers_and_frees_a_leaving_clients_branches(
    sglang_engine: Any,
) -> None:
    bridge = sglang_adapter(sglang_engine, rid_prefix="serve-").bridge()
    config = ServeConfig(models=("demo",), max_tokens=24, max_tokens_limit=3000, batch_size=16)
    served = Served(create_app(config, Backend(bridge, None)), bridge).__enter__()
    try:
        reply = served.openai().completions.create(
            model="demo", prompt="Step 1: add 3 and 4.", extra_body={"method": "sc", "n": 4}
        )
        extension = reply.model_extra["sart"]
        assert len(extension["branches"]) == 4
        assert reply.usage.completion_tokens == sum(b["tokens"] for b in extension["branches"])
        with pytest.raises((openai.APITimeoutError, openai.APIConnectionError)):
            served.openai().with_options(timeout=1.0).completions.create(
                model="demo",
                prompt="Step 1: add 12 and 7.",
                max_tokens=3000,  # branches never sample EOS here (sglang_cpu.NO_EOS)
                extra_body={"method": "sc", "n": 8},
            )
        served.wait_for(lambda: served.metric('sart:requests_total{status="cancelled"}') >= 1)
        served.wait_for(lambda: served.metric("sart:engine_live_branches") == 0)
        # SGLang's scheduler has dropped them: it runs nothing (the server is idle, so
        # the test may drive sglang.Engine's loop to ask).
        assert wait_for_load(sglang_engine, 0) == (0, 0)
        # Its tokenizer manager forgets them when its loop next runs: at the server's
        # next engine call (the bridge drives that loop only during calls).
        served.openai().completions.create(
            model="demo",
            prompt="Step 1: add 1 and 1.",
            max_tokens=4,
            extra_body={"method": "vanilla"},
        )
        assert in_flight(sglang_engine, "serve-") == []
    finally:
        served.__exit__()
