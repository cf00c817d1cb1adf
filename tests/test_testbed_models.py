"""The shipped testbed weights: they load like any model, behave, and are what training makes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from sart.prm.base import ScoreItem
from sart.testbed import POLICY_PATH, PRM_AGGREGATION, PRM_PATH, WEIGHTS, prm_kwargs
from sart.testbed.tasks import Question, answer_step, clean_trace, join_steps
from sart.types import BranchId

MANIFEST = json.loads((WEIGHTS / "manifest.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def policy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(POLICY_PATH).eval(),
        AutoTokenizer.from_pretrained(POLICY_PATH),
    )


@pytest.fixture(scope="module")
def prm():
    from sart.prm.hf import QwenMathPRM

    return QwenMathPRM.from_pretrained(PRM_PATH, **prm_kwargs())


def test_shipped_files_match_the_manifest() -> None:
    from sart.testbed.train import weight_hashes

    assert weight_hashes(WEIGHTS) == MANIFEST["sha256"]
    assert set(MANIFEST["sha256"]) == {"policy/model.safetensors", "prm/model.safetensors"}
    total = sum((WEIGHTS / name).stat().st_size for name in MANIFEST["sha256"])
    assert total < 10 * 2**20  # a few MB in the repository


def test_shipped_prm_code_is_the_packages_modelling_module() -> None:
    # The PRM directory carries its modelling code (auto_map, trust_remote_code);
    # it must be the module the tests exercise and training saves.
    from sart.testbed import modeling_testbed_prm

    shipped = (PRM_PATH / "modeling_testbed_prm.py").read_text(encoding="utf-8")
    assert shipped == Path(modeling_testbed_prm.__file__).read_text(encoding="utf-8")
    config = json.loads((PRM_PATH / "config.json").read_text(encoding="utf-8"))
    assert config["auto_map"]["AutoModel"] == "modeling_testbed_prm.TestbedPRM"


def test_prm_is_the_policy_frozen_with_a_head(policy, prm) -> None:
    # The PRM reads traces with an exact copy of the shipped policy.
    model, _tokenizer = policy
    inner = prm.model.policy.state_dict()
    assert all(torch.equal(inner[k], v) for k, v in model.state_dict().items())


def test_policy_is_a_small_llama_with_vllm_friendly_heads(policy) -> None:
    model, tokenizer = policy
    config = model.config
    assert config.model_type == "llama"
    assert config.hidden_size // config.num_attention_heads % 32 == 0
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 1.5e6
    assert config.eos_token_id == tokenizer.eos_token_id
    assert type(tokenizer).__name__ != "Qwen2Tokenizer"  # the word-level one survived loading


def test_policy_greedy_answers_an_easy_question(policy) -> None:
    model, tokenizer = policy
    q = Question((3, 4, 2))
    ids = torch.tensor([tokenizer(q.prompt)["input_ids"]])
    out = model.generate(
        ids, max_new_tokens=64, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert text.startswith("p1 3 + 0 = 3 \n\n p2 4 + 3 = 7")
    assert text.endswith(answer_step(q.answer))


def test_policy_prefers_the_right_step(policy) -> None:
    # The log-probability of a correct next step beats a wrong one.
    model, tokenizer = policy
    q = Question((5, 8))
    prefix = f"{q.prompt} p1 5 + 0 = 5 \n\n p2 8 + 5 ="
    ids = torch.tensor([tokenizer(prefix)["input_ids"]])
    logits = model(input_ids=ids).logits[0, -1]
    right, wrong = tokenizer.convert_tokens_to_ids(["3", "4"])
    assert logits[right] > logits[wrong] + 1.0


def test_prm_loads_with_the_qwen_adapter_and_rates_every_step(prm) -> None:
    assert prm.aggregate == PRM_AGGREGATION
    q = Question((6, 6, 1, 9))
    right = clean_trace(q)
    wrong = join_steps(
        ["p1 6 + 0 = 6", "p2 6 + 6 = 4", "p3 1 + 4 = 5", "p4 9 + 5 = 4", answer_step(4)]
    )
    items = [
        ScoreItem(BranchId("q", i), q.prompt, text, len(text.split()), True)
        for i, text in enumerate([right, wrong])
    ]
    rewards = prm.step_rewards(items)
    assert len(rewards[0]) == len(rewards[1]) == 5
    assert all(0.0 <= r <= 1.0 for r in rewards[0] + rewards[1])
    # The steps before the slip are the same text: the same rewards (causal model).
    assert rewards[0][0] == pytest.approx(rewards[1][0], abs=1e-5)
    # From the slip on, the wrong trace is rated lower.
    assert all(w < r - 0.1 for w, r in zip(rewards[1][1:], rewards[0][1:]))
    # Incremental scoring (the default, used by sart's driver) agrees with batched.
    from sart.prm.hf import QwenMathPRM

    batched = QwenMathPRM(prm.model, prm.tokenizer, incremental=False, **prm_kwargs())
    for a, b in zip(rewards, batched.step_rewards(items)):
        assert a == pytest.approx(b, abs=1e-4)


def test_prm_input_is_the_adapters_encoding(prm) -> None:
    # The chat-template prefix is the question's words, each step ends in <step>.
    q = Question((2, 3))
    enc = prm.encode(q.prompt, clean_trace(q))
    tokens = prm.tokenizer.convert_ids_to_tokens(enc.ids())
    assert tokens[: len(enc.prefix)] == q.prompt.split()
    assert tokens.count("<step>") == 3
    assert [tokens[p] for p in enc.positions()] == ["<step>"] * 3


def test_compact_sampling_drops_finished_rows_and_samples_the_same_policy(policy) -> None:
    from sart.testbed import make_questions
    from sart.testbed.model import sample

    model, tokenizer = policy
    prompts = [tokenizer(q.prompt)["input_ids"] for q in make_questions(0, 24) for _ in range(4)]

    def draw(compact: bool, seed: int) -> list:
        generator = torch.Generator().manual_seed(seed)
        return sample(model, prompts, eos_id=tokenizer.eos_token_id, generator=generator,
                      compact=compact)  # fmt: skip

    plain, compact = draw(False, 0), draw(True, 0)
    assert compact == draw(True, 0)  # reproducible
    assert len(compact) == len(prompts) and all(s.finished for s in compact)
    assert all(tokenizer.eos_token_id not in s.tokens for s in compact)
    # Other draws, the same policy: mean lengths agree within noise (measured 56.2, 56.9).
    mean = lambda samples: sum(len(s.tokens) for s in samples) / len(samples)  # noqa: E731
    assert abs(mean(plain) - mean(compact)) < 6


def test_manifest_records_how_to_reproduce() -> None:
    config = MANIFEST["config"]
    assert MANIFEST["seed"] == config["seed"] == 0
    assert config["batch_size"] == 32
    assert MANIFEST["torch"] and MANIFEST["threads"] >= 1
    assert not math.isnan(MANIFEST["seconds"]["total"])


@pytest.mark.slow
def test_training_reproduces_the_shipped_weights(tmp_path: Path) -> None:
    """Retrain (about 8 minutes) and compare with the shipped files.

    Bit-identical weights need the same torch build, CPU kernels and thread
    count as the manifest's; where the hashes differ, the retrained models
    must still be as good (the calibration numbers agree within noise).
    """
    from sart.testbed.report import ReportConfig, calibrate
    from sart.testbed.train import TrainConfig, train

    config = TrainConfig(threads=MANIFEST["threads"])
    manifest = train(tmp_path, config, log=lambda _line: None)
    if manifest["sha256"] == MANIFEST["sha256"]:
        return
    same_build = manifest["torch"] == MANIFEST["torch"]
    report = ReportConfig(questions=60)
    ours = calibrate(report, tmp_path / "policy", tmp_path / "prm")
    shipped = calibrate(report)
    assert abs(ours.branch_accuracy - shipped.branch_accuracy) < 0.1, same_build
    assert abs(ours.median_length_cv - shipped.median_length_cv) < 0.1
    assert ours.auroc_half[PRM_AGGREGATION] > 0.75
