"""``benchmarks/confidence_auroc.py`` runs end to end on the shipped testbed, and its
log-probabilities are the ones sart's transformers engine reports.

The full run (120 questions x 8) is a benchmark; this runs its main path on a
few questions, checks the log-probabilities against the HF engine and a plain
forward, and the pure parts on hand-made inputs. Skipped without torch.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import sart  # noqa: E402
from sart.messages import TokenLogprobs  # noqa: E402
from sart.testbed import POLICY_PATH  # noqa: E402
from sart.testbed.tasks import make_questions  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "confidence_auroc.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("confidence_auroc", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: its classes find their module by name
    spec.loader.exec_module(module)
    return module


def test_the_main_path_writes_every_judge_with_aurocs_in_range(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "auroc.json"
    result = bench.main(
        ["--questions", "4", "--n", "2", "--difficulties", "3", "8", "--out", str(out)]
    )
    written = json.loads(out.read_text())
    assert written["config"]["questions"] == 4 and written["config"]["window"] == 16
    assert written["branches"] == 8 and len(written["per_branch"]) == 8
    names = [r["name"] for r in written["rows"]]
    assert names == [
        "PRM (last)", "token", "group", "lowest-group", "tail", "lowest-logprob", "mean-logprob"
    ]  # fmt: skip
    labels = [b["correct"] for b in written["per_branch"]]
    for r in result["rows"]:
        for key in ("auroc_half", "auroc_full", "best_of_n"):
            value = r[key]
            if key == "best_of_n" or len(set(labels)) == 2:
                assert 0.0 <= value <= 1.0, (r["name"], key, value)
            else:
                assert math.isnan(value)
    printed = capsys.readouterr().out
    assert "AUROC 50%" in printed and "lowest-logprob" in printed


def _engine_run(prompt: str, k: int) -> tuple[list[int], dict[int, list[int]], dict[int, list]]:
    """Three branches of the testbed policy on sart's HF engine, with ``logprobs=k``:
    (prompt ids, tokens and reported log-probabilities per branch)."""
    from sart.engines.hf import HFEngine
    from sart.engines.prompts import prompt_ids

    e = HFEngine.from_pretrained(str(POLICY_PATH), dtype=torch.float32)
    sampling = sart.SamplingSettings(temperature=1.0, top_p=1.0, max_tokens=80, logprobs=k)
    e.prefill("r", prompt, sampling)
    e.start_branches("r", [sart.BranchSpec(j, seed=20 + j) for j in range(3)])
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list] = {}
    while e.stats().live_branches:
        for bid, delta in e.step(8).deltas.items():
            tokens.setdefault(bid.index, []).extend(delta.token_ids)
            logprobs.setdefault(bid.index, []).extend(delta.logprobs)
    return prompt_ids(e.tokenizer, prompt), tokens, logprobs


def test_logprobs_equal_the_hf_engines_and_a_plain_forward(bench: ModuleType) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(POLICY_PATH).eval()
    tokenizer = AutoTokenizer.from_pretrained(POLICY_PATH)
    prompt = make_questions(1, 1, (6,))[0].prompt
    ids, tokens, reported = _engine_run(prompt, k=20)
    assert ids == tokenizer(prompt)["input_ids"]  # the ids ``draw`` samples from
    generated = [tokens[j] for j in range(3)]
    assert len({len(g) for g in generated}) > 1  # padding is exercised
    computed = bench.token_logprobs(
        policy, [ids] * 3, generated, 20, tokenizer.pad_token_id, batch_size=2
    )
    for j, g in enumerate(generated):
        assert len(computed[j]) == len(g) == len(reported[j])
        # What sart's engine reports with SamplingSettings(logprobs=20).
        for mine, theirs in zip(computed[j], reported[j]):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
            assert list(mine.top) == pytest.approx(list(theirs.top), abs=1e-4)
            assert len(mine.top) == 20
            assert list(mine.top) == sorted(mine.top, reverse=True)
            assert mine.logprob <= mine.top[0] + 1e-6
        # And a plain forward of this branch alone (no batch, no padding, no cache).
        with torch.inference_mode():
            logits = policy(input_ids=torch.tensor([ids + g])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        for t, token in enumerate(g):
            assert computed[j][t].logprob == pytest.approx(
                float(logp[len(ids) - 1 + t, token]), abs=1e-5
            )


def test_top_k_is_clamped_to_the_vocabulary(bench: ModuleType) -> None:
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(POLICY_PATH).eval()
    vocab = policy.get_output_embeddings().weight.shape[0]
    (row,) = bench.token_logprobs(policy, [[3, 4, 5]], [[6, 7]], vocab + 50, None)
    assert [len(t.top) for t in row] == [vocab, vocab]
    # The whole distribution: its probabilities sum to one.
    assert all(math.fsum(math.exp(x) for x in t.top) == pytest.approx(1.0) for t in row)


def test_signal_values_read_half_way_and_at_the_end(bench: ModuleType) -> None:
    signals = bench.make_signals(window=2, tail=2)
    lps = [TokenLogprobs(x, (x, -3.0)) for x in (-0.1, -2.0, -0.2, -0.3, -0.5)]
    values = bench.signal_values(lps, signals)
    assert values["lowest-logprob"] == (-2.0, -2.0)
    assert values["mean-logprob"][0] == pytest.approx(-1.05)
    assert values["mean-logprob"][1] == pytest.approx(-3.1 / 5)
    # Token confidence: minus the mean of the top values.
    assert values["token"] == pytest.approx((2.5, 1.75))
    assert values["group"][1] == pytest.approx((1.65 + 1.75) / 2)
    empty = bench.signal_values([], signals)
    assert all(math.isnan(a) and math.isnan(b) for a, b in empty.values())
    one = bench.signal_values(lps[:1], signals)
    assert all(math.isnan(a) and not math.isnan(b) for a, b in one.values())


def test_pure_statistics(bench: ModuleType) -> None:
    labels = [True, False, True, False]
    groups = [0, 0, 1, 1]
    # An empty prefix (NaN) ranks lowest.
    r = bench.row("x", [math.nan, 0.0, 1.0, 0.5], [0.9, 0.1, 0.2, 0.3], labels, groups)
    assert r.auroc_half == pytest.approx(0.5)
    assert r.within_half == pytest.approx(0.5)
    # Pooled, 3 of the 4 (right, wrong) pairs are in order; within each question, one of two.
    assert r.auroc_full == pytest.approx(0.75) and r.within_full == pytest.approx(0.5)
    assert r.best_of_n == pytest.approx(0.5)
    text = bench.table([r], n=2)
    assert text.splitlines()[0].split()[:3] == ["judge", "AUROC", "50%"]
    assert "best-of-2" in text
