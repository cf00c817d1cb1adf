"""Train the testbed's policy and PRM from scratch, seeded: ``sart testbed train``.

1. Policy: a fresh Llama causal LM trained with AdamW on noisy traces
   (``tasks.noisy_trace``) generated on the fly, loss on the response tokens
   and EOS only. The training sequence is ``tokenizer(prompt)`` followed by
   the response's words and EOS: the ids sart's engines feed and produce.
2. PRM (``sart.testbed.train_prm``): the trained policy, frozen, with a linear
   head on seven running features of its log-probabilities, fitted by logistic
   regression to the outcomes of the policy's own rollouts.

   Fine-tuning the policy's trunk as a token classifier on step labels (what
   this module did first) never learned to check a step's addition: AUROC
   ~0.61 for final correctness at half the trace, best-of-8 below a single
   branch. The policy's own likelihood already knows when a step result is
   wrong; see docs/testbed.md.

Both models and the tokenizer are saved with ``save_pretrained``, with a
``manifest.json`` (config, seed, versions, sha256 of every weights file).
Training runs on the CPU with a fixed number of threads and deterministic
algorithms; whether the hashes are bit-identical across machines depends on
the CPU kernels, so the tests check metrics as well as hashes.

Needs the ``[hf]`` extra.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sart.digests import sha256
from sart.testbed.first_stage import load_first_stage, save_first_stage
from sart.testbed.recipe import (
    TrainConfig,
    cosine_schedule,
    easiest,
    hardest,
    learning_rate,
)
from sart.testbed.skills import skill_hits, skill_probes
from sart.testbed.tasks import (
    MAX_DIGITS,
    TraceConfig,
    make_question,
    noisy_response,
)
from sart.testbed.tokenizer import build_tokenizer
from sart.testbed.train_common import pad_rows, setup_training
from sart.testbed.train_prm import train_prm

Log = Callable[[str], None]


# --------------------------------------------------------------------------- helpers


def _optimizer(model: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in named if not (p.ndim >= 2 and "embed" not in n)]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))


def encode_example(
    tokenizer: Any, prompt: str, response: str, finished: bool = True
) -> tuple[list[int], int]:
    """Prompt ids (as sart's engines encode them), then the response's and EOS (none
    for an unfinished response: a loop cut short); with the number of prompt ids."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    end = [tokenizer.eos_token_id] if finished else []
    return [*prompt_ids, *response_ids, *end], len(prompt_ids)


def tokenizer_for(config: TrainConfig) -> Any:
    """The tokenizer of the testbed ``config`` trains (the short one's vocabulary
    covers at least ``p1`` .. ``p8``; a cycled one's ``r1`` .. its most rounds)."""
    if config.cycle is not None:
        return build_tokenizer(MAX_DIGITS, -(-config.max_digits // config.cycle))
    return build_tokenizer(max(config.max_digits, MAX_DIGITS))


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

    setup_training(config)
    model = LlamaForCausalLM(config.model.llama(tokenizer))
    rng = random.Random(config.seed)
    # One difficulty per batch: the traces have similar lengths, so little compute
    # goes to padding (half of it with mixed batches).
    return _train_loop(
        model,
        tokenizer,
        config,
        config.trace,
        config.policy_steps,
        lambda step: rng.randint(easiest(config, step), hardest(config, step)),
        lambda step: config.lr * learning_rate(config, step),
        rng,
        "policy",
        log,
        on_step,
    )


def refine_policy(
    config: TrainConfig, model: Any, tokenizer: Any, log: Log = print, stage: int = 0
) -> Any:
    """``config.refine[stage]``: the trained ``model`` trained on, on traces of that
    stage's noise, with a fresh optimizer and a schedule of its own, from batches of
    the grown curriculum's difficulties."""
    refine = config.refine[stage]
    setup_training(config)
    # The first refine stage's names are those it had when it was the only one.
    name = "refine" if stage == 0 else f"refine{stage + 1}"
    rng = random.Random(f"{name}-{config.seed}")
    grown = easiest(config, config.policy_steps)
    return _train_loop(
        model,
        tokenizer,
        config,
        refine.trace,
        refine.steps,
        lambda _step: rng.randint(grown, config.max_digits),
        lambda step: refine.lr * cosine_schedule(step, refine.steps, refine.warmup),
        rng,
        name,
        log,
    )


def _train_loop(
    model: Any,
    tokenizer: Any,
    config: TrainConfig,
    trace: TraceConfig,
    steps: int,
    difficulty_at: Callable[[int], int],
    lr_at: Callable[[int], float],
    rng: random.Random,
    stage: str,
    log: Log,
    on_step: Callable[[int, Any], None] | None = None,
) -> Any:
    model.train()
    optimizer = _optimizer(model, lr_at(0), config.weight_decay)
    pad = tokenizer.pad_token_id
    probes = skill_probes(config)
    started = time.perf_counter()
    for step in range(steps):
        rows, labels = [], []
        difficulty = difficulty_at(step)
        for _ in range(config.batch_size):
            question = make_question(rng, difficulty, config.cycle)
            response, finished = noisy_response(question, rng, trace)
            ids, n_prompt = encode_example(tokenizer, question.prompt, response, finished)
            rows.append(ids)
            labels.append([-100] * n_prompt + ids[n_prompt:])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss = _accumulate(model, rows, labels, pad, config.micro_batches)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if on_step is not None:
            on_step(step, model)
        if step % 100 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - started
            watched = [skill_hits(model, tokenizer, group) for group in probes]
            shown = "  ".join(
                f"{kind} " + "/".join(f"{w[kind]:.2f}" for w in watched)
                for kind in ("copy", "add", "count")
                if kind in watched[-1]
            )
            log(f"{stage} step {step:5d}  loss {loss.item():.4f}  {shown}  {elapsed:6.0f}s")
    return model.eval()


def _accumulate(
    model: Any, rows: list[list[int]], labels: list[list[int]], pad: int, parts: int
) -> torch.Tensor:
    """Back-propagate the mean token loss of ``rows`` in ``parts`` micro-batches of
    similar lengths (one part: the whole batch at once); the loss."""
    if parts == 1:
        input_ids, targets = pad_rows(rows, pad), pad_rows(labels, -100)
        mask = pad_rows([[1] * len(r) for r in rows], 0)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=targets).loss
        loss.backward()
        return loss.detach()
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    size = math.ceil(len(rows) / parts)
    counted = sum(sum(t != -100 for t in row[1:]) for row in labels)
    total = torch.zeros(())
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        input_ids = pad_rows([rows[i] for i in chunk], pad)
        targets = pad_rows([labels[i] for i in chunk], -100)
        mask = pad_rows([[1] * len(rows[i]) for i in chunk], 0)
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
        # Summed, then divided by the whole batch's token count: the same gradient
        # as one batch, whatever the split.
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets[:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        ) / max(1, counted)
        loss.backward()
        total += loss.detach()
    return total


# --------------------------------------------------------------------------- the whole run


#: The model directories of a trained run, which its manifest hashes.
MODELS = ("policy", "prm")


def weight_hashes(root: Path) -> dict[str, str]:
    """sha256 of every ``*.safetensors`` of ``root``'s models (``policy/``, ``prm/``; not
    a ``first-stage/`` checkpoint), by relative path."""
    files = sorted(p for name in MODELS for p in (root / name).rglob("*.safetensors"))
    return {str(p.relative_to(root)): sha256(p) for p in files}


def _check_writable(root: Path) -> None:
    """Raise the ``OSError`` (naming the path) that saving into ``root`` would raise."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / ".write-probe"
    probe.write_bytes(b"")
    probe.unlink()


def _save(target: Path, model: Any, tokenizer: Any) -> None:
    """Save ``model`` and ``tokenizer`` into ``target`` all at once: written beside it
    and renamed, so an interrupted run leaves a complete directory or none, never
    a half-written one that would load (``sart testbed report --weights``)."""
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)


def train(
    out: str | Path,
    config: TrainConfig | None = None,
    log: Log = print,
    first_stage: str | Path | None = None,
) -> dict[str, Any]:
    """Train both models into ``out`` (``policy/``, ``prm/``, ``manifest.json``).

    ``first_stage``: a directory this config's earlier stages trained (``config``
    without its last refine stages: its manifest says so; a run with refine stages
    leaves its first stage in ``out/first-stage``), whose policy is refined instead of
    trained again. The first stage is deterministic (same seed, threads and
    versions), so this gives the weights a whole run gives, in the time of the rest.
    Returns the manifest."""
    import transformers

    config = config or TrainConfig()
    root = Path(out)
    _check_writable(root)  # before minutes of training, not after
    # Written last, the manifest says a directory's models are complete and from one run.
    (root / "manifest.json").unlink(missing_ok=True)
    tokenizer = tokenizer_for(config)
    started = time.perf_counter()
    # Seconds spent before this process: a loaded first stage's own training time.
    loaded_seconds, done = 0.0, 0
    if first_stage is None:
        policy = train_policy(config, tokenizer, log)
        if config.refine:
            save_first_stage(root, policy, tokenizer, config, time.perf_counter() - started, _save)
    else:
        policy, loaded_seconds, done = load_first_stage(Path(first_stage), config)
    for stage in range(done, len(config.refine)):
        policy = refine_policy(config, policy, tokenizer, log, stage)
    policy_seconds = loaded_seconds + time.perf_counter() - started
    _save(root / "policy", policy, tokenizer)
    prm = train_prm(config, root / "policy", tokenizer, log)
    _save(root / "prm", prm, tokenizer)
    seconds = {
        "policy": round(policy_seconds, 3),
        "total": round(loaded_seconds + time.perf_counter() - started, 3),
    }
    manifest = {
        "config": config.to_json(),
        # The first stage's own weights were loaded, not trained in this process.
        **({"first_stage_loaded": True} if first_stage is not None else {}),
        "seed": config.seed,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": config.threads,
        # Milliseconds kept: a tiny run's policy stage (tests, a fast machine)
        # takes under 0.05 s, which a tenth of a second would record as none.
        "seconds": seconds,
        "sha256": weight_hashes(root),
    }
    partial = root / ".manifest.json.partial"
    partial.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, root / "manifest.json")
    log(f"trained in {seconds['total']:.0f}s -> {root}")
    return manifest
