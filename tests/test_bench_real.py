"""`sart bench --engine hf`, prompt files and trace recording on the tiny demo models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import sart  # noqa: E402
from sart.bench.real import arrivals, load_prompts, record_trace  # noqa: E402
from sart.bench.traces import Trace  # noqa: E402
from sart.cli import main  # noqa: E402
from sart.engines.hf import HFEngine  # noqa: E402
from sart.testing import ScriptedPRM  # noqa: E402


def test_prompt_files_are_checked(tmp_path: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "id": "x"}\n')
    items = load_prompts(good)
    assert [(i.id, i.prompt, i.answer) for i in items] == [("p0", "a", "1"), ("x", "b", None)]
    for text, message in [
        ('{"answer": 1}\n', "needs a JSON object with 'prompt'"),
        ("not json\n", "needs a JSON object with 'prompt'"),
        ('{"prompt": ""}\n', "'prompt' must be a non-empty string"),
        ("\n", "holds no prompts"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(sart.ConfigError, match=message):
            load_prompts(bad)
    with pytest.raises(sart.ConfigError, match="No such file"):
        load_prompts(tmp_path / "absent.jsonl")
    # A byte that is not UTF-8 (a Latin-1 file) ended in a UnicodeDecodeError traceback.
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(sart.ConfigError, match=r"latin\.jsonl:2: not UTF-8 text"):
        load_prompts(latin)


def test_arrivals_are_seeded_and_increasing() -> None:
    times = arrivals(50, 4.0, seed=1)
    assert times == arrivals(50, 4.0, seed=1) != arrivals(50, 4.0, seed=2)
    assert sorted(set(times)) == times


def test_bench_on_the_transformers_engine(
    demo_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = [
        "bench",
        "--engine",
        "hf",
        "--model",
        str(demo_models["policy"]),
        "--prompts",
        str(demo_models["prompts"]),
        "--methods",
        "vanilla",
        "sc",
        "--n",
        "2",
        "--rate",
        "50",
        "--max-tokens",
        "12",
        "--interval",
        "4",
        "--out",
        str(out),
        "--no-plots",
    ]
    assert main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["time_unit"] == "seconds (wall clock)"
    assert [(r["method"], r["n"]) for r in doc["runs"]] == [("vanilla", 1), ("sc", 2)]
    for run in doc["runs"]:
        assert len(run["requests"]) == 8
        assert all(b["tokens"] <= 12 for r in run["requests"] for b in r["branches"])
        assert run["summary"]["accuracy"] is not None
    assert "transformers model" in capsys.readouterr().out


def test_bench_hf_needs_a_prm_for_sart(
    demo_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(
            [
                "bench",
                "--engine",
                "hf",
                "--model",
                str(demo_models["policy"]),
                "--prompts",
                str(demo_models["prompts"]),
                "--methods",
                "sart",
                "--out",
                str(tmp_path),
            ]
        )
    assert "needs --prm PATH" in capsys.readouterr().err


def test_record_trace_from_a_real_run(demo_models: dict[str, Path], tmp_path: Path) -> None:
    engine = HFEngine.from_pretrained(str(demo_models["policy"]), dtype=torch.float32)
    items = load_prompts(demo_models["prompts"])[:3]
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=10)
    prm = ScriptedPRM(every=4)
    trace = record_trace(items, engine, prm, n=3, interval=4, sampling=sampling, rate=100.0)
    path = tmp_path / "t.jsonl"
    trace.dump(path)
    loaded = Trace.load(path)
    assert [r.id for r in loaded] == ["q0", "q1", "q2"]
    assert loaded.width == 3 and loaded.interval == 4
    for item, request in zip(items, loaded):
        assert request.max_tokens == 10  # the cap the branches were generated under
        assert request.prompt_tokens == len(engine.tokenizer(item.prompt)["input_ids"])
        assert request.answer == item.answer
        for index, branch in enumerate(request.branches):
            assert 1 <= branch.length <= 10
            # One running score per full interval the branch outlived, then the final.
            assert len(branch.rewards) == (branch.length - 1) // 4
            script = prm.script(sart.BranchId(request.id, index))
            assert branch.final_reward == pytest.approx(
                script.reward_at(branch.length, 4, final=True), abs=1e-4
            )


def test_record_trace_keeps_the_real_engines_logprobs_per_segment(
    demo_models: dict[str, Path],
) -> None:
    """With ``SamplingSettings(logprobs=k)`` each branch of the trace holds, per segment
    of ``logprob_every`` tokens, the mean of the sampled tokens' logprobs and of their
    token confidences (minus the mean of the top-k), as the engine reported them."""
    engine = HFEngine.from_pretrained(str(demo_models["policy"]), dtype=torch.float32)
    reported: dict[sart.BranchId, list] = {}
    step = engine.step

    def spy(max_steps: int, until_first_end: bool = False):  # type: ignore[no-untyped-def]
        out = step(max_steps, until_first_end)
        for bid, delta in out.deltas.items():
            reported.setdefault(bid, []).extend(delta.logprobs)
        return out

    engine.step = spy  # type: ignore[method-assign]
    items = load_prompts(demo_models["prompts"])[:2]
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=11, logprobs=3)
    trace = record_trace(
        items,
        engine,
        ScriptedPRM(every=4),
        n=2,
        interval=4,
        sampling=sampling,
        rate=100.0,
        logprob_every=4,
    )
    for request in trace:
        for index, branch in enumerate(request.branches):
            tokens = reported[sart.BranchId(request.id, index)]
            assert len(tokens) == branch.length
            assert branch.logprob_every == 4
            segments = [tokens[i : i + 4] for i in range(0, branch.length, 4)]
            assert branch.logprobs == pytest.approx(
                [sum(t.logprob for t in s) / len(s) for s in segments], abs=1e-4
            )
            assert branch.confidences == pytest.approx(
                [sum(-sum(t.top) / 3 for t in s) / len(s) for s in segments], abs=1e-4
            )
            assert all(c > 0 for c in branch.confidences)


@pytest.mark.parametrize("where", ["no such directory", "a directory"])
def test_an_unwritable_record_trace_is_refused_before_anything_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    # --record-trace was written only after every run and the recording pass: a path
    # that could not take it lost the recording, after hours on a real model.
    from sart.bench import command

    monkeypatch.setattr(command, "load", lambda spec: pytest.fail("loaded the models"))
    target = tmp_path / "no" / "t.jsonl" if where == "no such directory" else tmp_path
    argv = ["bench", "--engine", "hf", "--model", "testbed", "--requests", "2", "--n", "2"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--record-trace", str(target), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert (
        f"sart: error: --record-trace {str(target)!r}: cannot write it (" in capsys.readouterr().err
    )
