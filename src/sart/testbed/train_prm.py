"""Fit the testbed's PRM around a trained policy (``sart testbed train``, step 2).

``modeling_testbed_prm.TestbedPRM`` is a frozen copy of the trained policy whose
log-probabilities of the trace feed seven running features and a linear 2-label
head, read at ``<step>`` separators as Qwen2.5-Math-PRM is. The head is fitted by
logistic regression on rollouts sampled from the policy itself at temperature 1
(some cut at a random token, as the PRM sees branches during generation), each
position labelled with whether the whole rollout is graded correct; inputs are
built by ``QwenMathPRM.encode``, the adapter's own encoding. ``sart.testbed.train``
runs it after the policy. Needs the ``[hf]`` extra.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from sart.testbed.logistic import fit_logistic
from sart.testbed.model import sample
from sart.testbed.recipe import TrainConfig
from sart.testbed.tasks import QUESTION_END, STEP_WORD, grade, make_question
from sart.testbed.tokenizer import PRM_SEPARATOR
from sart.testbed.train_common import pad_rows, setup_training

Log = Callable[[str], None]


def prm_examples(
    config: TrainConfig, policy: Any, tokenizer: Any, encoder: Any, log: Log = print
) -> list[tuple[list[int], list[int], bool]]:
    """(ids, rating positions, outcome) from the policy's own rollouts.

    One rollout per question (mixed difficulty), sampled at temperature 1;
    ``prm_cut`` of them cut at a random token, as the PRM sees branches
    during generation. The outcome is whether the *whole* rollout is graded
    correct: every prefix of it is an example of "will this trace end right"
    (Math-Shepherd's Monte Carlo label with one rollout). ``encoder`` is a
    ``QwenMathPRM``: its ``encode`` is the input format.
    """
    rng = random.Random(config.seed + 1)
    questions = [
        make_question(rng, rng.randint(config.min_digits, config.max_digits), config.cycle)
        for _ in range(config.prm_rollouts)
    ]
    generator = torch.Generator().manual_seed(config.seed + 2)
    started = time.perf_counter()
    samples = sample(
        policy,
        [tokenizer(q.prompt)["input_ids"] for q in questions],
        eos_id=tokenizer.eos_token_id,
        generator=generator,
        max_new_tokens=config.max_new_tokens,
        compact=config.compact_rollouts,
    )
    log(f"prm rollouts: {len(samples)} in {time.perf_counter() - started:.0f}s")
    examples = []
    for question, s in zip(questions, samples):
        tokens = list(s.tokens)
        correct = grade(question, tokenizer.decode(tokens, skip_special_tokens=True))
        if tokens and rng.random() < config.prm_cut:
            tokens = tokens[: rng.randint(1, len(tokens))]
        enc = encoder.encode(question.prompt, tokenizer.decode(tokens, skip_special_tokens=True))
        if enc.segments:
            examples.append((enc.ids(), enc.positions(), correct))
    return examples


def prm_config(policy: Any, tokenizer: Any) -> Any:
    """The testbed PRM's configuration around a trained policy."""
    from sart.testbed.modeling_testbed_prm import TestbedPRMConfig

    ids = tokenizer.convert_tokens_to_ids
    settings = policy.config.to_dict()
    settings.pop("_name_or_path", None)  # where the policy was loaded from: not a setting
    return TestbedPRMConfig(
        text_config=settings,
        separator_id=ids(PRM_SEPARATOR),
        step_word_id=ids(STEP_WORD),
        question_end_id=ids(QUESTION_END),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


@torch.no_grad()
def _example_features(
    model: Any, examples: Sequence[tuple[list[int], list[int], bool]], pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running features at every rating position, and the outcome labels."""
    rows, labels = [], []
    for start in range(0, len(examples), 64):
        chunk = examples[start : start + 64]
        input_ids = pad_rows([e[0] for e in chunk], pad)
        mask = pad_rows([[1] * len(e[0]) for e in chunk], 0)
        features = model.features(input_ids, mask)
        for row, (_ids, positions, correct) in enumerate(chunk):
            rows.append(features[row, positions])
            labels += [float(correct)] * len(positions)
    return torch.cat(rows), torch.tensor(labels)


def _fit_head(model: Any, features: torch.Tensor, labels: torch.Tensor, l2: float) -> float:
    """Fit the PRM's head (``fit_logistic``); the final training loss."""
    fitted = fit_logistic(features, labels, l2)
    with torch.no_grad():
        model.feature_mean.copy_(fitted.mean)
        model.feature_scale.copy_(fitted.scale)
        # Two labels (bad, good) whose softmax is the logistic model's probability.
        model.score.weight.zero_()
        model.score.bias.zero_()
        model.score.weight[1] = fitted.weight
        model.score.bias[1] = fitted.bias
    return fitted.loss


def train_prm(config: TrainConfig, policy_dir: Path, tokenizer: Any, log: Log = print) -> Any:
    """The PRM (``modeling_testbed_prm.TestbedPRM``): the trained policy, frozen,
    with its head fitted to the outcomes of the policy's own rollouts."""
    from transformers import LlamaForCausalLM

    from sart.prm.hf import QwenMathPRM
    from sart.testbed.modeling_testbed_prm import FEATURES, TestbedPRM

    setup_training(config)
    policy = LlamaForCausalLM.from_pretrained(policy_dir).eval()
    model = TestbedPRM(prm_config(policy, tokenizer))
    model.policy.load_state_dict(policy.state_dict())
    model.eval()
    encoder = QwenMathPRM(
        model,
        tokenizer,
        system_prompt=None,
        step_separator=PRM_SEPARATOR,
        max_length=config.prm_max_length,
    )
    examples = prm_examples(config, policy, tokenizer, encoder, log)
    started = time.perf_counter()
    features, labels = _example_features(model, examples, tokenizer.pad_token_id)
    loss = _fit_head(model, features, labels, config.prm_l2)
    weights = ", ".join(
        f"{name} {w:+.2f}" for name, w in zip(FEATURES, model.score.weight[1].tolist())
    )
    log(
        f"prm head: {len(examples)} rollouts, {len(labels)} positions, "
        f"{float(labels.mean()):.2f} positive, loss {loss:.4f} "
        f"({time.perf_counter() - started:.0f}s); weights {weights}"
    )
    return model
