"""A model's default sampling, from its ``generation_config.json``, as ``vllm serve`` reads it.

``vllm serve`` samples a request that leaves temperature, top_p, top_k, min_p or a
penalty unset with the value the model's ``generation_config.json`` gives
(``--generation-config auto``, its default), and ``max_new_tokens`` there caps every
request. ``sart serve`` does the same: ``generation_defaults`` reads the file from the
model's directory (or, for a hub id, the Hugging Face cache, where loading the engine
put it), ``sart`` reads none, and a directory or file reads that one; an override (a
dict, vLLM's ``--override-generation-config``) is laid over it. Only the keys vLLM reads are kept
(``GENERATION_KEYS``): ``do_sample`` and the rest are ignored, as vLLM ignores them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sart.errors import ConfigError
from sart.types import SamplingSettings

FILE_NAME = "generation_config.json"
AUTO = "auto"
"""Read the model's own ``generation_config.json`` (none there: sart's defaults)."""
OWN = "sart"
"""Read none: sart's defaults (``SamplingSettings``'), as ``vllm serve
--generation-config vllm`` takes vLLM's."""

GENERATION_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_new_tokens",
)
"""The keys of ``generation_config.json`` that set a default, those vLLM reads
(``ModelConfig.get_diff_sampling_param``); ``max_new_tokens`` is ``max_tokens``."""


def generation_file(source: str, model: str | None) -> Path | None:
    """The ``generation_config.json`` that ``source`` names for ``model``: ``auto``,
    the model's (``None`` if it has none, or ``model`` is ``None``); ``sart``, none;
    else a directory holding one, or the file itself (a ``ConfigError`` if absent)."""
    if source == OWN:
        return None
    if source == AUTO:
        if model is None:
            return None
        path = Path(model).expanduser()
        if path.is_dir():
            return path / FILE_NAME if (path / FILE_NAME).is_file() else None
        return _from_hub(model)
    path = Path(source).expanduser()
    found = path / FILE_NAME if path.is_dir() else path
    if not found.is_file():
        raise ConfigError(
            f"generation_config={source!r} must be {AUTO!r}, {OWN!r}, or a directory "
            f"holding a {FILE_NAME} (or the file): no such file"
        )
    return found


def _from_hub(model: str) -> Path | None:
    """A hub model's ``generation_config.json`` from the Hugging Face cache, where the
    engine's download put it (``None`` where there is none): never the network, which
    offline costs ~25 s of retries before it fails."""
    try:
        import huggingface_hub
    except ImportError:
        return None
    try:
        cached = huggingface_hub.try_to_load_from_cache(model, FILE_NAME)
    except ValueError:  # not a hub id (HFValidationError): a path that is not there
        return None
    return Path(cached) if isinstance(cached, str) else None


def generation_defaults(
    source: str, model: str | None, override: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The sampling defaults ``source`` gives ``model`` (see ``generation_file``),
    ``override`` laid over them: ``SamplingSettings`` field names (``max_tokens`` for
    ``max_new_tokens``) to values, each checked as ``SamplingSettings`` checks it."""
    found = generation_file(source, model)
    config: dict[str, Any] = {}
    if found is not None:
        try:
            config = json.loads(found.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"generation_config={str(found)!r}: not readable JSON ({exc})"
            ) from None
        if not isinstance(config, dict):
            raise ConfigError(f"generation_config={str(found)!r}: not a JSON object")
    if override:
        unknown = sorted(set(override) - set(GENERATION_KEYS))
        if unknown:
            raise ConfigError(
                f"override_generation_config={dict(override)!r}: {', '.join(unknown)} "
                f"is not one of {', '.join(GENERATION_KEYS)}"
            )
        config = {**config, **override}
    out = {key: config[key] for key in GENERATION_KEYS if config.get(key) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    try:
        SamplingSettings(**out)
    except (ConfigError, TypeError) as exc:
        if found is None:  # the override's own value
            raise ConfigError(
                f"override_generation_config={dict(override or {})!r}: {exc}"
            ) from None
        also = f" with the override {dict(override)!r}" if override else ""
        raise ConfigError(f"generation_config={str(found)!r}{also}: {exc}") from None
    return out
