"""Training the testbed: the configuration, and a tiny end-to-end run (the real one is --slow)."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from sart.errors import ConfigError

pytest.importorskip("transformers")

import torch

from sart.testbed.first_stage import FIRST_STAGE
from sart.testbed.model import ModelConfig
from sart.testbed.train import TrainConfig, train
from sart.testbed.train_prm import _fit_head


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("micro_batches", 0),
        ("prm_max_length", 0),
        ("prm_cut", 1.5),
        ("prm_l2", 0.0),
        ("prm_rollouts", 0),
        ("threads", 0),
        ("max_digits", 65),
        ("warmup", -5),
        ("weight_decay", -0.1),
        ("curriculum_hold", -1),
        ("curriculum", -3),
    ],
)
def test_config_refuses_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{field: value})


def test_head_fit_is_the_logistic_regression_of_the_outcomes() -> None:
    from sart.testbed import modeling_testbed_prm as prm_model

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            n = len(prm_model.FEATURES)
            self.feature_mean = torch.nn.Parameter(torch.zeros(n), requires_grad=False)
            self.feature_scale = torch.nn.Parameter(torch.ones(n), requires_grad=False)
            self.score = torch.nn.Linear(n, 2)

    torch.manual_seed(0)
    features = torch.randn(2000, len(prm_model.FEATURES)) * 3 + 1
    truth = torch.sigmoid(2 * features[:, 0] - features[:, 3])
    labels = torch.bernoulli(truth)
    head = Head()
    loss = _fit_head(head, features, labels, l2=1e-4)
    with torch.no_grad():
        probs = torch.softmax(head.score((features - head.feature_mean) / head.feature_scale), -1)
    good = probs[:, 1]
    # The 2-label softmax is the fitted probability: close to the true one,
    # and its penalised loss is the reported one.
    assert (good - truth).abs().mean() < 0.05
    penalty = 1e-4 * float((head.score.weight[1].detach() ** 2).sum())
    bce = float(torch.nn.functional.binary_cross_entropy(good, labels))
    assert loss == pytest.approx(bce + penalty, abs=1e-4)


#: A training run of seconds: the smallest model and data that exercise every stage.
TINY = TrainConfig(
    model=ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=1),
    policy_steps=3,
    batch_size=4,
    prm_rollouts=8,
    max_digits=3,
)


def test_a_tiny_training_run_writes_loadable_models(tmp_path: Path) -> None:
    from sart.prm.base import ScoreItem
    from sart.prm.hf import QwenMathPRM
    from sart.testbed import prm_kwargs
    from sart.testbed.tasks import Question, clean_trace
    from sart.types import BranchId

    config = TINY
    lines: list[str] = []
    started = time.perf_counter()
    manifest = train(tmp_path, config, log=lines.append)
    # The seconds recorded are this run's, each stage counted once.
    seconds = manifest["seconds"]
    assert 0 < seconds["policy"] < seconds["total"] <= time.perf_counter() - started + 0.1
    assert set(manifest["sha256"]) == {"policy/model.safetensors", "prm/model.safetensors"}
    assert json.loads((tmp_path / "manifest.json").read_text())["config"]["prm_rollouts"] == 8
    assert any(line.startswith("prm head: 8 rollouts") for line in lines)
    prm = QwenMathPRM.from_pretrained(tmp_path / "prm", **prm_kwargs())
    q = Question((1, 2))
    (rewards,) = prm.step_rewards([ScoreItem(BranchId("r", 0), q.prompt, clean_trace(q), 9, True)])
    assert len(rewards) == 3 and all(0.0 <= r <= 1.0 for r in rewards)


def test_micro_batches_give_the_gradient_of_the_whole_batch() -> None:
    from transformers import LlamaForCausalLM

    from sart.testbed.train import _accumulate, tokenizer_for

    tokenizer = tokenizer_for(TINY)
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig(max_positions=64).llama(tokenizer))
    rows = [[3, 4, 5, 6, 7, 8], [3, 4, 9], [3, 5, 5, 5], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    labels = [[-100, -100, *r[2:]] for r in rows]
    pad = tokenizer.pad_token_id
    grads = []
    for parts in (1, 3):
        model.zero_grad()
        loss = _accumulate(model, rows, labels, pad, parts)
        grads.append((float(loss), [p.grad.clone() for p in model.parameters()]))
    (whole, whole_grads), (split, split_grads) = grads
    assert split == pytest.approx(whole, rel=1e-5)
    for a, b in zip(whole_grads, split_grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_curriculum_grows_the_hardest_question_from_short_ones() -> None:
    from sart.testbed.recipe import hardest

    config = TrainConfig(min_digits=4, max_digits=64, curriculum=500)
    assert [hardest(config, s) for s in (0, 250, 499, 500, 1000)] == [8, 36, 63, 64, 64]
    held = TrainConfig(min_digits=4, max_digits=64, curriculum_hold=100, curriculum=500)
    assert [hardest(held, s) for s in (0, 99, 100, 350, 600)] == [8, 8, 8, 36, 64]
    assert hardest(TrainConfig(), 0) == TrainConfig().max_digits  # none: the whole range


def test_a_cycle_must_cover_the_hardest_question_in_rounds() -> None:
    assert TrainConfig(min_digits=4, max_digits=64, cycle=4).cycle == 4
    with pytest.raises(ConfigError, match="cycle"):
        TrainConfig(min_digits=4, max_digits=64, cycle=3)  # 22 rounds
    with pytest.raises(ConfigError, match="cycle"):
        TrainConfig(max_digits=8, cycle=9)  # more digits than the vocabulary's p8


def test_the_long_testbeds_training_config_and_vocabulary() -> None:
    from sart.testbed.recipe import LONG, TRAIN_CONFIGS
    from sart.testbed.train import tokenizer_for

    assert TRAIN_CONFIGS["long"] is LONG and TRAIN_CONFIGS["short"] == TrainConfig()
    assert (LONG.min_digits, LONG.max_digits, LONG.max_new_tokens) == (4, 64, 2048)
    assert LONG.model.max_positions >= 2048 + 2 * 8 + 4  # a loop cut at the cap fits
    # Cycled: 4 digits at most, over up to 16 rounds (64 additions).
    words = tokenizer_for(LONG).get_vocab()
    assert LONG.cycle == 4
    assert {"p4", "r1", "r16"} <= set(words) and not {"p9", "r17", "r0"} & set(words)
    # Trained on both cores (the manifest's thread count is part of its hashes).
    assert LONG.threads == 2
    # Then refined on fewer slips (docs/testbed.md, "How the long task came to be").
    assert LONG.refine and LONG.refine[0].trace.error_carry < LONG.trace.error_carry
    # The short testbed's vocabulary is the one its weights were trained with.
    assert len(tokenizer_for(TrainConfig())) == 30


def test_skills_tell_a_trained_policy_from_a_fresh_one() -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from sart.testbed import SHORT
    from sart.testbed.recipe import LONG
    from sart.testbed.skills import skill_probes, skills
    from sart.testbed.train import tokenizer_for

    config = TrainConfig()
    (probes,) = skill_probes(config)  # no curriculum: one group, at max_digits
    assert {q.difficulty for q in probes} == {config.max_digits}
    tokenizer = AutoTokenizer.from_pretrained(SHORT.policy_path)
    trained = LlamaForCausalLM.from_pretrained(SHORT.policy_path).eval()
    copy, add = skills(trained, tokenizer, probes)
    assert copy >= 0.95 and add >= 0.95
    torch.manual_seed(0)
    fresh = LlamaForCausalLM(config.model.llama(tokenizer_for(config))).eval()
    copy, add = skills(fresh, tokenizer, probes)
    assert copy < 0.3 and add < 0.3
    # With a curriculum, more groups watch the grown questions' shortest and longest.
    start, shortest, goal = skill_probes(LONG)
    assert [{q.difficulty for q in g} for g in (start, shortest, goal)] == [{8}, {24}, {64}]
    # Cycled questions are also watched counting their rounds; plain ones are not.
    from sart.testbed.skills import skill_hits

    long_tokenizer = tokenizer_for(LONG)
    untrained = LlamaForCausalLM(LONG.model.llama(long_tokenizer)).eval()
    with torch.no_grad():
        assert set(skill_hits(untrained, long_tokenizer, shortest[:2])) == {"copy", "add", "count"}
    assert set(skill_hits(trained, tokenizer, probes[:2])) == {"copy", "add"}


def test_an_unwritable_out_is_refused_before_training(tmp_path: Path) -> None:
    # Before: found out by save_pretrained, after the policy's minutes of training.
    blocker = tmp_path / "file"
    blocker.write_text("")
    steps: list[str] = []
    with pytest.raises(OSError) as info:
        train(blocker / "weights", TrainConfig(), log=steps.append)
    assert info.value.filename is not None and str(blocker) in str(info.value.filename)
    assert steps == []  # nothing trained


def test_an_interrupted_run_leaves_no_half_written_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sart.testbed import train as train_module

    config = TINY
    (tmp_path / "manifest.json").write_text("{}")  # an earlier run's

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "train_prm", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, config, log=lambda line: None)
    # The policy was saved whole; no PRM directory, and no manifest vouching for either.
    assert (tmp_path / "policy" / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


def test_the_cli_trains_each_testbeds_config_with_its_own_seed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from sart.cli import main
    from sart.testbed import recipe
    from sart.testbed import train as train_module

    trained: list[tuple[TrainConfig, object]] = []
    monkeypatch.setattr(
        train_module,
        "train",
        lambda _out, config, first_stage: trained.append((config, first_stage)),
    )
    runs = (
        ["--model", "long"],
        ["--model", "long", "--seed", "5", "--threads", "1"],
        [],
        ["--model", "long", "--first-stage", "stage1"],
    )
    for argv in runs:
        assert main(["testbed", "train", "--out", str(tmp_path / "w"), *argv]) == 0
    (long, none), (reseeded, _), (short, _), (refined, first) = trained
    assert long == recipe.LONG and (long.seed, long.threads) == (2, 2) and none is None
    assert (reseeded.seed, reseeded.threads) == (5, 1) and reseeded.trace == recipe.LONG.trace
    assert short == TrainConfig() and short.threads == 1
    assert refined == recipe.LONG and first == "stage1"


def test_the_rope_base_reaches_the_saved_config(tmp_path: Path) -> None:
    from transformers import AutoConfig, LlamaForCausalLM

    from sart.testbed.train import tokenizer_for

    tokenizer = tokenizer_for(TINY)
    for theta in (10_000.0, 1e6):
        model = LlamaForCausalLM(ModelConfig(max_positions=64, rope_theta=theta).llama(tokenizer))
        model.save_pretrained(tmp_path / str(theta))
        saved = AutoConfig.from_pretrained(tmp_path / str(theta))
        assert saved.rope_parameters["rope_theta"] == theta


def test_the_learning_rate_can_decay_after_the_hold_only() -> None:
    from sart.testbed.recipe import cosine_schedule, learning_rate

    plain = TrainConfig(policy_steps=400, curriculum_hold=200, curriculum=100)
    # By default: one cosine over the whole run (the short testbed's weights).
    whole_run = [cosine_schedule(s, 400, 50) for s in range(400)]
    assert [learning_rate(plain, s) for s in range(400)] == whole_run
    held = TrainConfig(policy_steps=400, curriculum_hold=200, curriculum=100, decay_after_hold=True)
    rates = [learning_rate(held, s) for s in range(400)]
    assert rates[:50] == [cosine_schedule(s, 400, 50) for s in range(50)]  # the same warmup
    assert rates[50:201] == [1.0] * 151  # the peak, through the hold
    assert all(a >= b for a, b in itertools.pairwise(rates[200:]))  # then a decay...
    assert rates[300] > learning_rate(plain, 300) + 0.25
    assert rates[-1] == pytest.approx(0.1, abs=1e-3)


def test_grown_batches_draw_from_the_testbeds_own_range() -> None:
    from sart.testbed.recipe import easiest

    config = TrainConfig(
        min_digits=4, max_digits=64, curriculum_hold=100, curriculum=50, grown_min_digits=24
    )
    assert [easiest(config, s) for s in (0, 149, 150, 1000)] == [4, 4, 24, 24]
    assert easiest(TrainConfig(min_digits=2), 10_000) == 2
    with pytest.raises(ConfigError, match="grown_min_digits"):
        TrainConfig(min_digits=4, max_digits=64, grown_min_digits=65)


def test_refine_stage_refuses_bad_values_naming_the_field() -> None:
    from sart.testbed.recipe import RefineConfig
    from sart.testbed.tasks import TraceConfig

    with pytest.raises(ConfigError, match=r"refine\.steps"):
        RefineConfig(steps=0, trace=TraceConfig())
    with pytest.raises(ConfigError, match=r"refine\.lr"):
        RefineConfig(steps=1, trace=TraceConfig(), lr=0.0)
    with pytest.raises(ConfigError, match=r"refine\.warmup=-1 must be >= 0"):
        RefineConfig(steps=1, trace=TraceConfig(), warmup=-1)
    # A probability is a float: the config is written out with the weights.
    with pytest.raises(ConfigError, match=r"error_carry=0 must be a float in \[0, 1\]"):
        TraceConfig(error_carry=0)


def test_a_refine_stage_from_a_saved_first_stage_gives_the_whole_runs_weights(
    tmp_path: Path,
) -> None:
    import attrs

    from sart.testbed.recipe import RefineConfig
    from sart.testbed.tasks import TraceConfig

    refined = attrs.evolve(TINY, refine=RefineConfig(steps=2, trace=TraceConfig(error_carry=0.0)))
    lines: list[str] = []
    whole = train(tmp_path / "whole", refined, log=lines.append)
    assert any(line.startswith("refine step     1") for line in lines)
    first = train(tmp_path / "first", TINY, log=lambda line: None)
    assert first["sha256"] != whole["sha256"]  # the refine stage changed the policy
    resumed = train(
        tmp_path / "resumed", refined, log=lambda line: None, first_stage=tmp_path / "first"
    )
    assert resumed["sha256"] == whole["sha256"]
    assert resumed["first_stage_loaded"] is True and "first_stage_loaded" not in whole
    assert resumed["config"]["refine"][0]["steps"] == 2
    # The whole run kept its first stage apart (not in its hashes), and refining that
    # gives its weights again.
    assert set(whole["sha256"]) == {"policy/model.safetensors", "prm/model.safetensors"}
    again = train(
        tmp_path / "again",
        refined,
        log=lambda line: None,
        first_stage=tmp_path / "whole" / FIRST_STAGE,
    )
    assert again["sha256"] == whole["sha256"]
    assert not (tmp_path / "first" / FIRST_STAGE).exists()  # no refine stage, nothing kept
    # A second refine stage: from the first two stages' run, as from the whole run's.
    second = RefineConfig(steps=2, trace=TraceConfig(error_carry=0.5), lr=5e-3)
    twice = attrs.evolve(refined, refine=(*refined.refine, second))
    whole2 = train(tmp_path / "whole2", twice, log=lines.append)
    assert any(line.startswith("refine2 step     1") for line in lines)
    assert whole2["sha256"] != whole["sha256"]
    for earlier in (tmp_path / "whole", tmp_path / "first"):
        again = train(tmp_path / "x", twice, log=lambda line: None, first_stage=earlier)
        assert again["sha256"] == whole2["sha256"]
    with pytest.raises(ConfigError, match="first_stage"):  # nothing left to train
        train(tmp_path / "y", refined, log=lambda line: None, first_stage=tmp_path / "whole")
    # Another config's first stage is refused, before any training.
    other = attrs.evolve(refined, seed=1)
    with pytest.raises(ConfigError, match="first_stage"):
        train(tmp_path / "other", other, log=lambda line: None, first_stage=tmp_path / "first")


def test_the_long_testbeds_first_stage_in_the_repository_is_its_recipes() -> None:
    # The first stage ships in the repository so that the refine stages can be
    # tried again without it: a change to LONG's first stage must retrain it.
    from sart.testbed import LONG as BED
    from sart.testbed.first_stage import load_first_stage
    from sart.testbed.recipe import LONG as RECIPE

    directory = BED.weights / FIRST_STAGE
    if not (directory / "policy").is_dir():
        pytest.skip("an installed package has no first stage (the repository has)")
    policy, seconds, stages_done = load_first_stage(directory, RECIPE)
    assert stages_done == 0 and seconds > 0
    assert policy.config.max_position_embeddings == RECIPE.model.max_positions
