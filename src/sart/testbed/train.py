"""Train the testbed's policy and PRM from scratch, seeded: ``sart testbed train``.

1. Policy: a fresh Llama causal LM trained with AdamW on noisy traces
   (``tasks.noisy_trace``) generated on the fly, loss on the response tokens
   and EOS only. The training sequence is ``tokenizer(prompt)`` followed by
   the response's words and EOS: the ids sart's engines feed and produce.
2. PRM: ``LlamaForTokenClassification`` (2 labels) whose trunk starts from the
   trained policy, fine-tuned on rollouts sampled from the policy itself at
   temperature 1 and labelled step by step by the exact grader
   (``tasks.step_labels``: is the value held after this step the true running
   sum?). Half the rollouts are cut at a random token, as the PRM sees them
   during generation. Inputs are built by ``QwenMathPRM.encode``, the
   adapter's own encoding, so training and inference see the same ids.

The ``<step>`` separator's embedding starts as the step word ``"\\n\\n"``'s,
and each step's last token is labelled too (``prm_dense``). Known
limitation: this PRM stays weakly informative (AUROC ~0.61 for final
correctness, see docs/testbed.md); the other options here (``prm_labels``,
``prm_extra_layers``, ``prm_freeze_trunk``, ``prm_bad_weight``) are the
variants that were tried, none of which did better.

Both models and the tokenizer are saved with ``save_pretrained``, with a
``manifest.json`` (config, seed, versions, sha256 of every weights file).
Training runs on the CPU with a fixed number of threads and deterministic
algorithms; whether the hashes are bit-identical across machines depends on
the CPU kernels, so the tests check metrics as well as hashes.

Needs the ``[hf]`` extra.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from sart.errors import config_check
from sart.testbed.model import ModelConfig, sample
from sart.testbed.tasks import (
    MAX_DIGITS,
    STEP_WORD,
    TraceConfig,
    make_question,
    noisy_trace,
    step_checks,
    step_labels,
)
from sart.testbed.tokenizer import PRM_SEPARATOR, build_tokenizer

Log = Callable[[str], None]


def _positive(name: str):
    def check(_self: object, _attr: attrs.Attribute, value: float) -> None:
        config_check(value > 0, name, value, "> 0")

    return check


@attrs.frozen
class TrainConfig:
    """Everything that decides the shipped weights (written to the manifest)."""

    seed: int = 0
    threads: int = attrs.field(default=1, validator=_positive("threads"))
    """CPU threads: results are bit-reproducible only with the same number. One
    thread: on a 2-core machine shared with other work, two threads spent most
    of their time waiting for each other (3-10x slower steps)."""
    min_digits: int = 1
    max_digits: int = MAX_DIGITS
    trace: TraceConfig = attrs.field(factory=TraceConfig)
    model: ModelConfig = attrs.field(factory=ModelConfig)
    policy_steps: int = attrs.field(default=1500, validator=_positive("policy_steps"))
    batch_size: int = attrs.field(default=32, validator=_positive("batch_size"))
    lr: float = attrs.field(default=3e-3, validator=_positive("lr"))
    warmup: int = 50
    weight_decay: float = 0.01
    prm_rollouts: int = attrs.field(default=4096, validator=_positive("prm_rollouts"))
    """Policy samples (one per question, mixed difficulty) the PRM learns from."""
    prm_steps: int = attrs.field(default=500, validator=_positive("prm_steps"))
    prm_lr: float = attrs.field(default=3e-3, validator=_positive("prm_lr"))
    prm_dense: bool = True
    """Also train on each step's last token (same label as its separator)."""
    prm_bad_weight: float = attrs.field(default=1.0, validator=_positive("prm_bad_weight"))
    """Loss weight of "off track" labels (about 1 step in 8)."""
    prm_labels: str = "running"
    """``running``: is the value held after the step the true running sum
    (``tasks.step_labels``); ``local``: is the step itself right (``tasks.step_checks``)."""
    prm_extra_layers: int = 0
    """New layers on top of the policy's in the PRM (where it learns to check steps)."""
    prm_freeze_trunk: bool = False
    """Keep the policy's layers fixed in the PRM (only new layers, norm and head learn)."""
    prm_cut: float = 0.5
    """Fraction of PRM examples cut at a random token (partial traces, as during generation)."""

    def __attrs_post_init__(self) -> None:
        config_check(
            1 <= self.min_digits <= self.max_digits <= MAX_DIGITS,
            "max_digits",
            self.max_digits,
            f"in [min_digits={self.min_digits}, {MAX_DIGITS}]",
        )
        config_check(0.0 <= self.prm_cut <= 1.0, "prm_cut", self.prm_cut, "in [0, 1]")
        config_check(
            self.prm_labels in ("running", "local"),
            "prm_labels",
            self.prm_labels,
            "'running' or 'local'",
        )
        config_check(self.prm_extra_layers >= 0, "prm_extra_layers", self.prm_extra_layers, ">= 0")

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(
            self, value_serializer=lambda _i, _a, v: list(v) if isinstance(v, tuple) else v
        )


# --------------------------------------------------------------------------- helpers


def _setup(config: TrainConfig) -> None:
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(config.seed)


def _schedule(step: int, total: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _pad(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def _optimizer(model: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in named if not (p.ndim >= 2 and "embed" not in n)]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))


def encode_example(tokenizer: Any, prompt: str, response: str) -> tuple[list[int], int]:
    """Prompt ids (as sart's engines encode them), then the response's and EOS;
    with the number of prompt ids."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    return [*prompt_ids, *response_ids, tokenizer.eos_token_id], len(prompt_ids)


# --------------------------------------------------------------------------- the policy


def train_policy(
    config: TrainConfig,
    tokenizer: Any,
    log: Log = print,
    on_step: Callable[[int, Any], None] | None = None,
) -> Any:
    """A freshly initialised policy trained on noisy traces.

    ``on_step(step, model)``, if given, runs after every optimizer step (for
    monitoring; it must not draw from the global torch RNG).
    """
    from transformers import LlamaForCausalLM

    _setup(config)
    model = LlamaForCausalLM(config.model.llama(tokenizer))
    model.train()
    rng = random.Random(config.seed)
    optimizer = _optimizer(model, config.lr, config.weight_decay)
    pad = tokenizer.pad_token_id
    started = time.perf_counter()
    for step in range(config.policy_steps):
        rows, labels = [], []
        # One difficulty per batch: the traces have similar lengths, so little
        # compute goes to padding (half of it with mixed batches).
        difficulty = rng.randint(config.min_digits, config.max_digits)
        for _ in range(config.batch_size):
            question = make_question(rng, difficulty)
            ids, n_prompt = encode_example(
                tokenizer, question.prompt, noisy_trace(question, rng, config.trace)
            )
            rows.append(ids)
            labels.append([-100] * n_prompt + ids[n_prompt:])
        input_ids, targets = _pad(rows, pad), _pad(labels, -100)
        mask = _pad([[1] * len(r) for r in rows], 0)
        for group in optimizer.param_groups:
            group["lr"] = config.lr * _schedule(step, config.policy_steps, config.warmup)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=targets).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if on_step is not None:
            on_step(step, model)
        if step % 100 == 0 or step == config.policy_steps - 1:
            elapsed = time.perf_counter() - started
            log(f"policy step {step:5d}  loss {loss.item():.4f}  {elapsed:6.0f}s")
    return model.eval()


# --------------------------------------------------------------------------- the PRM


def prm_examples(
    config: TrainConfig, policy: Any, tokenizer: Any, encoder: Any, log: Log = print
) -> list[tuple[list[int], list[int], list[int]]]:
    """(ids, rating positions, 0/1 labels) from the policy's own rollouts.

    ``encoder`` is a ``QwenMathPRM``: its ``encode`` is the input format.
    """
    from sart.testbed.tasks import Question

    rng = random.Random(config.seed + 1)
    questions: list[Question] = [
        make_question(rng, rng.randint(config.min_digits, config.max_digits))
        for _ in range(config.prm_rollouts)
    ]
    generator = torch.Generator().manual_seed(config.seed + 2)
    started = time.perf_counter()
    samples = sample(
        policy,
        [tokenizer(q.prompt)["input_ids"] for q in questions],
        eos_id=tokenizer.eos_token_id,
        generator=generator,
    )
    log(f"prm rollouts: {len(samples)} in {time.perf_counter() - started:.0f}s")
    examples = []
    for question, s in zip(questions, samples):
        tokens = list(s.tokens)
        if tokens and rng.random() < config.prm_cut:
            tokens = tokens[: rng.randint(1, len(tokens))]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        enc = encoder.encode(question.prompt, text)
        if not enc.segments:
            continue
        label = step_checks if config.prm_labels == "local" else step_labels
        labels = label(question, text)[enc.first_step :]
        examples.append((enc.ids(), enc.positions(), [int(x) for x in labels]))
    return examples


def _prm_model(config: TrainConfig, policy: Any, tokenizer: Any) -> Any:
    """The policy's layers, ``prm_extra_layers`` new ones on top, a 2-label head.

    The new layers start as the identity (their output projections are zero),
    so the PRM starts from the policy's own reading of the trace; with
    ``prm_freeze_trunk`` only they, the final norm and the head learn, and
    the policy's features (it knows what each step's result should be) stay
    intact.
    """
    from transformers import LlamaForTokenClassification

    settings = policy.config.to_dict()
    settings.update(
        num_hidden_layers=policy.config.num_hidden_layers + config.prm_extra_layers,
        num_labels=2,
        architectures=["LlamaForTokenClassification"],
    )
    model = LlamaForTokenClassification(type(policy.config)(**settings))
    missing, _unexpected = model.model.load_state_dict(policy.model.state_dict(), strict=False)
    assert all(".layers." in m or m.startswith("layers.") for m in missing), missing
    with torch.no_grad():
        for layer in model.model.layers[policy.config.num_hidden_layers :]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        # The policy never saw <step>: it starts as the step word "\n\n", so
        # the policy's layers read a step's end as they do when generating.
        embeddings = model.get_input_embeddings().weight
        step_word = tokenizer.convert_tokens_to_ids(STEP_WORD)
        embeddings[tokenizer.convert_tokens_to_ids(PRM_SEPARATOR)] = embeddings[step_word]
    if config.prm_freeze_trunk:
        model.model.embed_tokens.requires_grad_(False)
        for layer in model.model.layers[: policy.config.num_hidden_layers]:
            layer.requires_grad_(False)
    return model


def train_prm(config: TrainConfig, policy_dir: Path, tokenizer: Any, log: Log = print) -> Any:
    """The PRM: the policy's trunk with a 2-label head, fine-tuned on graded rollouts."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from sart.prm.hf import QwenMathPRM

    # The load report (policy's lm_head unused, the score head new) is expected.
    hf_logging.set_verbosity_error()
    _setup(config)
    policy = LlamaForCausalLM.from_pretrained(policy_dir)
    torch.manual_seed(config.seed + 3)
    model = _prm_model(config, policy, tokenizer)
    encoder = QwenMathPRM(
        model, tokenizer, system_prompt=None, step_separator=PRM_SEPARATOR, max_length=512
    )
    examples = prm_examples(config, policy, tokenizer, encoder, log)
    positives = sum(sum(e[2]) for e in examples) / max(1, sum(len(e[2]) for e in examples))
    log(f"prm examples: {len(examples)}, positive step labels {positives:.2f}")
    rng = random.Random(config.seed + 4)
    optimizer = _optimizer(model, config.prm_lr, config.weight_decay)
    model.train()
    started = time.perf_counter()
    for step in range(config.prm_steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(config.batch_size)]
        input_ids = _pad([e[0] for e in batch], tokenizer.pad_token_id)
        mask = _pad([[1] * len(e[0]) for e in batch], 0)
        targets = torch.full_like(input_ids, -100)
        for row, (_ids, positions, labels) in enumerate(batch):
            targets[row, positions] = torch.tensor(labels, dtype=torch.long)
            if config.prm_dense:
                # The step's last token gets its label too: there the step's
                # result sits next to the policy's own prediction of it (one
                # token back), an easier place to learn the check than <step>.
                targets[row, [q - 1 for q in positions]] = torch.tensor(labels, dtype=torch.long)
        for group in optimizer.param_groups:
            group["lr"] = config.prm_lr * _schedule(step, config.prm_steps, config.warmup)
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, 2),
            targets.reshape(-1),
            weight=torch.tensor([config.prm_bad_weight, 1.0]),
            ignore_index=-100,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == config.prm_steps - 1:
            log(
                f"prm step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - started:6.0f}s"
            )
    return model.eval()


# --------------------------------------------------------------------------- the whole run


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weight_hashes(root: Path) -> dict[str, str]:
    """sha256 of every ``*.safetensors`` under ``root``, by relative path."""
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*.safetensors"))}


def train(out: str | Path, config: TrainConfig | None = None, log: Log = print) -> dict[str, Any]:
    """Train both models into ``out`` (``policy/``, ``prm/``, ``manifest.json``).

    Returns the manifest."""
    import transformers

    config = config or TrainConfig()
    root = Path(out)
    tokenizer = build_tokenizer()
    started = time.perf_counter()
    policy = train_policy(config, tokenizer, log)
    policy_seconds = time.perf_counter() - started
    policy.save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    prm = train_prm(config, root / "policy", tokenizer, log)
    prm.save_pretrained(root / "prm")
    tokenizer.save_pretrained(root / "prm")
    manifest = {
        "config": config.to_json(),
        "seed": config.seed,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": config.threads,
        "seconds": {
            "policy": round(policy_seconds, 1),
            "total": round(time.perf_counter() - started, 1),
        },
        "sha256": weight_hashes(root),
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    log(f"trained in {manifest['seconds']['total']:.0f}s -> {root}")
    return manifest
