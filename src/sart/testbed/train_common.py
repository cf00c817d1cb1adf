"""What the testbed's policy and PRM training share: a seeded, deterministic torch
setup and padding of id rows into one tensor. Needs the ``[hf]`` extra."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sart.testbed.recipe import TrainConfig


def setup_training(config: TrainConfig) -> None:
    """Fixed threads, deterministic algorithms and the run's seed."""
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(config.seed)


def pad_rows(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    """``rows`` right-padded with ``value`` to the longest, as one long tensor."""
    width = max(map(len, rows))
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=torch.long)
