"""What ``TransformersPRM`` needs of transformers across its versions, and the
checks and arguments of loading a checkpoint."""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers

from sart.errors import ConfigError


def version() -> tuple[int, int]:
    major, minor = re.findall(r"\d+", transformers.__version__)[:2]
    return int(major), int(minor)


def dtype_kwarg() -> str:
    # ``torch_dtype`` was renamed ``dtype`` in transformers 4.56.
    return "dtype" if version() >= (4, 56) else "torch_dtype"


def output_logits(output: Any) -> Any:
    logits = getattr(output, "logits", None)
    return output[0] if logits is None else logits


def model_device(model: Any) -> Any:
    device = getattr(model, "device", None)
    if device is not None:
        return torch.device(device)
    return next(model.parameters()).device


def forward_parameters(model: Any) -> Mapping[str, Any]:
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def check_positions(model: Any, max_length: int) -> None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and max_length > limit:
        raise ConfigError(
            f"max_length={max_length} must be <= the model's max_position_embeddings ({limit})"
        )


def ships_only_sart_code(path: str | Path) -> bool:
    """Whether ``path`` is a local checkpoint whose only Python files are copies of
    sart's own testbed PRM modelling code (so trusting them runs no foreign code)."""
    folder = Path(path)
    if not folder.is_dir():
        return False
    shipped = sorted(folder.glob("*.py"))
    if not shipped:
        return False
    own = (
        Path(__file__).resolve().parent.parent / "testbed" / "modeling_testbed_prm.py"
    ).read_bytes()
    return all(file.read_bytes() == own for file in shipped)


def load_kwargs(dtype: Any, trust_remote_code: bool, extra: Mapping[str, Any] | None) -> dict:
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, **(extra or {})}
    if dtype is not None:
        kwargs[dtype_kwarg()] = dtype
    return kwargs
