"""A trained first stage kept apart, so that a refine stage can be tried again without it.

The long testbed's policy trains in stages: a first stage of most of an hour on two
cores, then refine stages of minutes each (``TrainConfig.refine``). A run with refine
stages saves its first stage's policy in ``OUT/first-stage`` (with a manifest of the
config without them); ``sart testbed train --first-stage DIR`` refines such a policy,
or the policy of a run of the recipe's first refine stages, instead of training it
again. The first stage is deterministic, so the result is the weights a whole run
gives.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from sart.errors import config_check
from sart.testbed.recipe import TrainConfig

#: Where a run with a refine stage keeps its first stage, under its ``out``.
FIRST_STAGE = "first-stage"


def save_first_stage(
    root: Path,
    policy: Any,
    tokenizer: Any,
    config: TrainConfig,
    seconds: float,
    save: Callable[[Path, Any, Any], None],
) -> Path:
    """Save ``policy`` (``config``'s first stage, trained in ``seconds``) into
    ``root/first-stage`` with its manifest, written last; ``save(target, model,
    tokenizer)`` writes a model directory whole. Returns the directory."""
    directory = root / FIRST_STAGE
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "manifest.json").unlink(missing_ok=True)
    save(directory / "policy", policy, tokenizer)
    manifest = {
        "config": attrs.evolve(config, refine=()).to_json(),
        "seconds": {"policy": round(seconds, 3)},
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", "utf-8")
    return directory


def load_first_stage(directory: Path, config: TrainConfig) -> tuple[Any, float, int]:
    """The policy ``directory``'s run of ``config`` trained without its refine stages
    (or with its first few), the seconds it took, and how many refine stages it had
    (``ConfigError`` if it was another config's, or all of this one)."""
    from transformers import LlamaForCausalLM

    manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    found = manifest["config"]
    stages = [
        k
        for k in range(len(config.refine))
        if attrs.evolve(config, refine=config.refine[:k]).to_json() == found
    ]
    config_check(
        bool(stages),
        "first_stage",
        str(directory),
        "a run of this config without its last refine stages",
    )
    policy = LlamaForCausalLM.from_pretrained(directory / "policy")
    return policy, float(manifest["seconds"]["policy"]), stages[0]


__all__ = ["FIRST_STAGE", "load_first_stage", "save_first_stage"]
