"""`sart bench --model testbed`: every method on the shipped testbed models, for real.

Real accuracy (graded against the questions' gold answers) and real wall-clock
latency on the transformers engine; the vLLM run of the same command is in
``tests/test_bench_vllm.py`` (CI's vLLM environment).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from sart.bench.config import method_policy
from sart.cli import main

METHODS = ["vanilla", "sc", "rebase", "sart-no-prune", "sart"]


def bench_argv(engine: str, out: Path, *extra: str) -> list[str]:
    return [
        "bench",
        "--engine",
        engine,
        "--model",
        "testbed",
        "--requests",
        "12",
        "--n",
        "4",
        "--rate",
        "20",
        "--batch-size",
        "16",
        "--out",
        str(out),
        "--no-plots",
        *extra,
    ]


def check_comparison(doc: dict) -> None:
    """What must hold for the five methods on 12 testbed questions at N = 4."""
    assert doc["time_unit"] == "seconds (wall clock)"
    # What was served, and sampled as the calibration samples.
    serving = doc["serving"]
    assert serving["model"].endswith("policy") and serving["prm"].endswith("prm")
    assert serving["sampling"] == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 256}
    assert serving["prm_options"]["aggregate"] == "last"
    # The transformers PRM ran in a process of its own (the default), beside decoding.
    assert serving["prm_process"] is True
    runs = {r["method"]: r for r in doc["runs"]}
    assert [(r["method"], r["n"]) for r in doc["runs"]] == [
        (m, 1 if m == "vanilla" else 4) for m in METHODS
    ]
    for run in runs.values():
        assert run["summary"]["failed"] == 0
        assert len(run["requests"]) == 12
        # Graded for real: the testbed's answers are digits, graded exactly.
        assert 0.0 < run["summary"]["accuracy"] <= 1.0
        assert all(r["gold"] in "0123456789" for r in run["requests"])
        assert run["summary"]["e2e"]["p50"] > 0
    tokens = {m: runs[m]["summary"]["tokens_per_request"] for m in METHODS}
    # Early stopping (M = 2 of 4) and pruning cut the tokens SC spends.
    assert tokens["sart"] < tokens["sc"] and tokens["sart-no-prune"] < tokens["sc"]
    # Early stopping leaves branches unfinished; SART's PRM prunes some. (The
    # testbed's branches have similar lengths, so several may finish within
    # one T-token chunk, and pruning often leaves no branch to stop.)
    no_prune = [b["status"] for r in runs["sart-no-prune"]["requests"] for b in r["branches"]]
    assert "stopped" in no_prune and "pruned" not in no_prune
    statuses = [b["status"] for r in runs["sart"]["requests"] for b in r["branches"]]
    assert "pruned" in statuses
    assert all(
        any(b["status"] == "finished" for b in r["branches"]) for r in runs["sart"]["requests"]
    )
    assert all(r["prm_items"] > 0 for r in runs["sart"]["requests"])
    assert all(r["prm_items"] == 0 for r in runs["sc"]["requests"])


CONFIDENCE = ["sc", "deepconf", "sart-conf"]


def check_confidence(doc: dict) -> None:
    """The confidence methods on 12 testbed questions at N = 4: real answers, rewards
    from the policy's log-probabilities, fewer tokens than SC."""
    runs = {r["method"]: r for r in doc["runs"]}
    assert list(runs) == CONFIDENCE
    for method in CONFIDENCE:
        summary = runs[method]["summary"]
        assert summary["failed"] == 0 and 0.0 < summary["accuracy"] <= 1.0
    for method in ("deepconf", "sart-conf"):
        done = [
            b
            for r in runs[method]["requests"]
            for b in r["branches"]
            if b["status"] in ("finished", "truncated")
        ]
        assert done and all(0.0 < b["reward"] <= 1.0 for b in done)
        assert all(r["prm_items"] > 0 for r in runs[method]["requests"])  # scored: by confidence
    tokens = {m: runs[m]["summary"]["tokens_per_request"] for m in CONFIDENCE}
    assert tokens["sart-conf"] < tokens["sc"]  # M-of-N stop and pruning
    assert tokens["deepconf"] <= tokens["sc"]


def test_bench_runs_the_confidence_methods_with_transformers(tmp_path: Path) -> None:
    argv = bench_argv("hf", tmp_path / "out", "--methods", *CONFIDENCE)
    assert main(argv) == 0
    check_confidence(json.loads((tmp_path / "out" / "results.json").read_text()))


def test_bench_compares_every_method_on_the_testbed_with_transformers(tmp_path: Path) -> None:
    assert main(bench_argv("hf", tmp_path / "out")) == 0
    check_comparison(json.loads((tmp_path / "out" / "results.json").read_text()))


def test_the_prm_may_run_in_the_drivers_process(tmp_path: Path) -> None:
    argv = bench_argv("hf", tmp_path / "out", "--methods", "sart", "--prm-in-process")
    assert main(argv) == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["serving"]["prm_process"] is False
    assert all(r["prm_items"] > 0 for r in doc["runs"][0]["requests"])


def test_a_testbed_run_records_a_trace_for_the_simulator(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    argv = bench_argv("hf", tmp_path / "out", "--methods", "vanilla", "--record-trace", str(trace))
    assert main(argv) == 0
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == 12 and all(len(line["branches"]) == 4 for line in lines)
    assert all(line["answer"] in "0123456789" for line in lines)
    # Each branch's log-probabilities were recorded with it (per 16 tokens).
    branches = [b for line in lines for b in line["branches"]]
    assert all(b["logprobs"] and b["confidences"] for b in branches)
    assert all(max(b["logprobs"]) <= 0 and min(b["confidences"]) >= 0 for b in branches)
    # The recorded trace replays in the simulator, the confidence methods included.
    replay = tmp_path / "replay"
    argv = ["bench", "--trace", str(trace), "--out", str(replay), "--no-plots", "--n", "4"]
    assert main([*argv, "--methods", "sc", "sart", "deepconf", "sart-conf"]) == 0
    runs = json.loads((replay / "results.json").read_text())["runs"]
    assert [r["method"] for r in runs] == ["sc", "sart", "deepconf", "sart-conf"]
    rewards = {
        r["method"]: [b["reward"] for q in r["requests"] for b in q["branches"] if b["reward"]]
        for r in runs
    }
    # Replayed confidence is the recorded one, not the trace's PRM rewards.
    assert rewards["sart-conf"] and set(rewards["sart-conf"]) != set(rewards["sart"])


def test_bench_mix_serves_urgent_and_bulk_testbed_requests_with_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sart.bench import mix

    groupings = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        groupings.append(type(kwargs.get("equivalence")).__name__)
        return method_policy(*args, **kwargs)

    monkeypatch.setattr(mix, "method_policy", recorded)
    out = tmp_path / "out"
    argv = [a for a in bench_argv("hf", out) if a not in ("--n", "4")]
    mixed = ["--mix", "interactive:0.3:sart:2,bulk:0.7:sc:4", "--equivalence", "math-verify"]
    assert main([*argv, *mixed]) == 0
    # Both classes' votes group answers by meaning, in the warm-up and both runs.
    assert groupings == ["MathVerifyEquivalence"] * 6
    saved = json.loads((out / "results.json").read_text())
    assert saved["equivalence"] == "math-verify"
    (document,) = saved["rates"]
    assert [c["name"] for c in document["classes"]] == ["interactive", "bulk"]
    fcfs, priority = document["runs"]
    assert (fcfs["scheduling"], priority["scheduling"]) == ("fcfs", "priority")
    for run in (fcfs, priority):
        counts = [c["requests"] for c in run["classes"]]
        assert sum(counts) == 12 and all(counts)  # the same questions, split the same way
        assert counts == [c["requests"] for c in fcfs["classes"]]
        for stats in run["classes"]:
            assert 0 < stats["p50"] <= stats["p97"] and 0.0 < stats["accuracy"] <= 1.0


def test_a_real_benchmark_resumes_with_its_serving_compared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    assert main(bench_argv("hf", out, "--methods", "sc")) == 0
    before = json.loads((out / "results.json").read_text())
    assert main(bench_argv("hf", out, "--methods", "sc", "sart", "--resume")) == 0
    after = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in after["runs"]] == ["sc", "sart"]
    assert after["runs"][0] == before["runs"][0]  # kept, not served again
    assert after["resumed"] == [{"rate": 20.0, "method": "sc", "n": 4}]
    assert after["serving"] == before["serving"]
    # All done: the models are not even loaded.
    from sart.bench import command

    monkeypatch.setattr(command, "load", lambda spec: pytest.fail("loaded the models"))
    assert main(bench_argv("hf", out, "--methods", "sc", "sart", "--resume")) == 0
    # Another sampling is another benchmark.
    with pytest.raises(SystemExit):
        main(bench_argv("hf", out, "--methods", "sc", "--temperature", "0.5", "--resume"))
    # Runs of another sampler are another benchmark: the same seeds draw other tokens.
    assert after["serving"]["sampler"] == "counter-inverse-cdf/1"
    document = json.loads((out / "results.json").read_text())
    document["serving"].pop("sampler")  # as results.json was before the batched sampler
    (out / "results.json").write_text(json.dumps(document))
    with pytest.raises(SystemExit):
        main(bench_argv("hf", out, "--methods", "sc", "sart", "--resume"))


def test_resuming_refuses_a_prompt_file_that_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # results.json did not hold the --prompts file at all: edited, its runs were kept.
    from sart.testbed import testbed

    prompts = tmp_path / "prompts.jsonl"
    questions = testbed("testbed").questions(0, 6)
    lines = [json.dumps({"prompt": q.prompt, "answer": q.answer}) for q in questions]
    prompts.write_text("\n".join(lines[:4]) + "\n")
    argv = bench_argv("hf", tmp_path / "out", "--methods", "sc", "--prompts", str(prompts))
    argv = [a for i, a in enumerate(argv) if "--requests" not in argv[i - 1 : i + 1]]
    assert main(argv) == 0
    assert main([*argv, "--resume"]) == 0  # the same file: kept
    prompts.write_text("\n".join(lines[2:]) + "\n")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv, "--resume"])
    assert f"--prompts {prompts}: the file changed since (sha256 " in capsys.readouterr().err
