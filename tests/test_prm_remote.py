"""The remote PRM (``RemotePRM``) against two real ``vllm serve`` PRM servers on loopback.

Each server serves a tiny random ``Qwen2ForProcessRewardModel`` checkpoint as sart's
LAST-pooled architecture (registered in the server by sart's ``vllm.general_plugins``
entry point, as a user's ``vllm serve`` would load it). Checked: the rewards are the
network's own (a torch reference), a request's checks stay on one server and are
served from its prefix cache, requests spread over the servers, ``sart bench`` scores
through them (``--prm-url``), and a server killed mid-run fails only the requests it
held while the other carries on. Skipped where vLLM is not installed; CI runs it in
its vLLM stage.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

import sart  # noqa: E402
from adapters import vllm_serve_all  # noqa: E402
from sart.demo_models import build_qwen2_prm, build_tokenizer, write_demo_prompts  # noqa: E402
from sart.prm.aggregate import split_steps  # noqa: E402
from sart.prm.base import ScoreItem  # noqa: E402
from sart.rewards import score_items  # noqa: E402
from sart.types import BranchId  # noqa: E402

QUESTION = "What is 7 + 8?"


def response(n_steps: int) -> str:
    return "\n\n".join(
        f"Step {i + 1}: add {i} and {i + 3}. {i} + {i + 3} = {2 * i + 3}." for i in range(n_steps)
    )


def item(text: str, rid: str, final: bool = False) -> ScoreItem:
    return ScoreItem(BranchId(rid, 0), QUESTION, text, len(text), final)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    pytest.importorskip("vllm")
    return build_qwen2_prm(tmp_path_factory.mktemp("remote-prm"), build_tokenizer())


@pytest.fixture(scope="module")
def servers(
    checkpoint: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[str], list[Any]]]:
    """Two PRM servers: their URLs and processes."""
    from sart.prm.vllm_model import ARCHITECTURE

    logs = tmp_path_factory.mktemp("remote-prm-logs")
    flags = ["--runner", "pooling", "--enable-prefix-caching"]
    flags += ["--hf-overrides", json.dumps({"architectures": [ARCHITECTURE]})]
    handles: list[Any] = []
    with vllm_serve_all(
        [(checkpoint[0], logs / f"{k}.log", flags) for k in range(2)], handles
    ) as urls:
        yield urls, handles


def remote(urls: list[str], checkpoint: tuple[Path, Any], **options: Any) -> Any:
    from sart.prm.remote import RemotePRM

    return RemotePRM(urls, build_tokenizer(), aggregate="last", timeout=30, **options)


def reference(net: Any, prm: Any, text: str) -> float:
    """The network's reward of the last step (at its separator), on the documented
    full-text encoding."""
    ids = prm.format.reference_ids(QUESTION, split_steps(text))
    with torch.no_grad():
        logits = net(torch.tensor([ids])).logits[0]
    last = max(k for k, t in enumerate(ids) if t == prm.format.separator_id)
    return torch.softmax(logits[last].float(), dim=-1)[1].item()


def test_rewards_are_the_networks_and_checks_stay_on_one_cached_server(
    servers: tuple[list[str], list[Any]], checkpoint: tuple[Path, Any]
) -> None:
    urls, _ = servers
    prm = remote(urls, checkpoint)
    assert prm.workers == 2
    before = [prefix_cache(url) for url in urls]
    steps = split_steps(response(24))
    for k in range(3, len(steps) + 1, 3):
        partial = "\n\n".join(steps[:k])
        got = prm.score([item(partial, "grow"), item(partial, "other")])
        want = reference(checkpoint[1], prm, partial)
        assert got == pytest.approx([want, want], abs=1e-4)
    # Two requests, placed on the two servers, each kept there.
    assert {prm.placement.placed("grow"), prm.placement.placed("other")} == {0, 1}
    assert prm.requests_sent == [8, 8]
    # Served from each server's prefix cache: vLLM's /pooling reports no cached tokens
    # in its usage (so prm.tokens_cached stays 0 there), its metrics do. A check
    # re-sends its request's growing prefix: most of each is a hit.
    for url, (hits0, queries0) in zip(urls, before):
        hits, queries = prefix_cache(url)
        assert queries > queries0 and hits - hits0 > 0.5 * (queries - queries0), url
    prm.close()


def prefix_cache(url: str) -> tuple[float, float]:
    """A vLLM server's prefix-cache ``(hits, queries)`` in tokens, from its metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["vllm:prefix_cache_hits_total"], totals["vllm:prefix_cache_queries_total"]


def test_sart_bench_scores_on_the_servers(
    servers: tuple[list[str], list[Any]], checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    from sart.cli import main
    from sart.demo_models import build_demo_models

    urls, _ = servers
    demo = build_demo_models(tmp_path / "demo")
    prompts = write_demo_prompts(tmp_path / "p.jsonl", 4)
    out = tmp_path / "out"
    argv = ["bench", "--engine", "hf", "--model", str(demo["policy"]), "--prompts", str(prompts)]
    argv += ["--prm", str(checkpoint[0]), "--prm-url", *urls, "--methods", "sart", "--n", "2"]
    argv += ["--rate", "50", "--max-tokens", "24", "--interval", "8", "--no-plots"]
    assert main([*argv, "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["serving"]["prm_kind"] == "remote"
    assert doc["serving"]["prm_urls"] == urls
    (run,) = doc["runs"]
    assert (run["summary"]["requests"], run["summary"]["failed"]) == (4, 0)


def test_sart_serve_scores_on_the_servers(
    servers: tuple[list[str], list[Any]], checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    pytest.importorskip("fastapi")
    from sart.demo_models import build_demo_models
    from serving import KEY, Server

    urls, _ = servers
    demo = build_demo_models(tmp_path / "demo")
    flags = ["--model", str(demo["policy"]), "--prm", str(checkpoint[0]), "--prm-url", *urls]
    server = Server(*flags, "--api-key", KEY, "--interval", "8", "--max-tokens", "24")
    try:
        reply = server.client().completions.create(
            model=str(demo["policy"]), prompt="1 + 2 =", extra_body={"method": "sart", "n": 4}
        )
        outcome = reply.model_extra["sart"]
        assert outcome["policy"].startswith("sart(n=4")
        assert len(outcome["branches"]) == 4
    finally:
        code, log = server.stop()
    assert code == 0, log
    assert "PRM: " + str(checkpoint[0]) in log


def test_a_killed_server_fails_only_the_requests_it_held(
    servers: tuple[list[str], list[Any]], checkpoint: tuple[Path, Any]
) -> None:
    urls, handles = servers
    prm = remote(urls, checkpoint, cooldown=300)
    rids = [f"q{k}" for k in range(4)]
    first = score_items(prm, [item(response(2), rid) for rid in rids])
    assert first.failures == {} and len(first.rewards) == 4
    on_second = {rid for rid in rids if prm.placement.placed(rid) == 1}
    assert len(on_second) == 2
    handles[1].send_signal(signal.SIGKILL)  # the second server dies mid-run
    handles[1].wait(10)
    second = score_items(prm, [item(response(3), rid) for rid in rids])
    assert set(second.failures) == on_second
    assert all("PRM server" in reason for reason in second.failures.values())
    assert {b.request_id for b in second.rewards} == set(rids) - on_second
    # New requests go to the server that is up; so do the dead one's, if they ask again.
    third = prm.score([item(response(2), "late"), item(response(3), sorted(on_second)[0])])
    assert prm.placement.placed("late") == 0 and len(third) == 2
    prm.close()


def test_every_command_takes_the_servers(tmp_path: Path) -> None:
    from sart.cli import _parser
    from sart.model_flags import load_spec

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    for argv in (
        ["bench", "--engine", "hf", "--model", "m", "--prm", "p", "--prm-url", *urls],
        ["eval", "--dataset", "testbed", "--model", "m", "--prm", "p", "--prm-url", *urls],
        ["serve", "--model", "m", "--prm", "p", "--prm-url", *urls, "--prm-api-key", "k"],
    ):
        args = _parser().parse_args(argv)
        spec = load_spec(args, batch_size=8)
        assert (spec.prm_kind, spec.prm_urls) == ("remote", tuple(urls)), argv[0]
    timed = _parser().parse_args(["serve", "--model", "m", "--prm", "p", "--prm-url", *urls,
                                  "--prm-timeout", "5"])  # fmt: skip
    assert load_spec(timed, batch_size=8).prm_timeout == 5.0
    for argv, said in (
        (
            ["--prm", "p", "--prm-timeout", "5"],
            r"^--prm-timeout has no effect with --prm-kind qwen \(it is for --prm-kind remote\)$",
        ),
        (
            ["--prm", "p", "--prm-url", *urls, "--prm-timeout", "0"],
            r"prm_timeout=0.0 must be a finite number > 0",
        ),
    ):
        with pytest.raises(sart.ConfigError, match=said):
            load_spec(_parser().parse_args(["serve", "--model", "m", *argv]), batch_size=8)
    no_tokenizer = _parser().parse_args(["serve", "--model", "m", "--prm-url", *urls])
    with pytest.raises(sart.ConfigError, match="--prm-url needs --prm"):
        load_spec(no_tokenizer, batch_size=8)
