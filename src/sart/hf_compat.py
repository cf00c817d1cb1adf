"""What differs between transformers 4.x and 5.x, in one place, for the engine and the PRMs.

- the forward's cache argument: ``cache=`` in 5.x, ``past_key_values=`` in 4.x (and in
  custom code written for it, such as Qwen2.5-Math-PRM's): ``cache_argument``;
- building a ``DynamicCache`` over tensors (``from_legacy_cache`` in 4.x, a
  ``ddp_cache_data`` list in 5.x, which copies it) or empty: ``dynamic_cache``,
  ``new_cache``; a legacy tuple a custom model returns: ``from_legacy``;
- reading one back: the output's cache (``out_cache``) and its per-layer tensors
  (``pairs_of``: ``layers`` in 5.x, ``to_legacy_cache`` in 4.x).

Needs torch and transformers (imported here), so only the ``[hf]`` adapters import it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import DynamicCache

KV = list[tuple[Any, Any]]
"""Per layer, ``(keys, values)``: ``[batch, heads, positions, head_dim]`` each."""

LEGACY = hasattr(DynamicCache, "from_legacy_cache")
"""transformers 4.x: caches are built from and read back as legacy tuples."""


def cache_argument(model: Any) -> str:
    """The name under which ``model.forward`` takes a KV cache."""
    parameters: Mapping[str, inspect.Parameter]
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    return "cache" if "cache" in parameters else "past_key_values"


def new_cache(config: Any) -> Any:
    """An empty ``DynamicCache`` for a model of ``config``."""
    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers < 4.56 takes no config
        return DynamicCache()


def dynamic_cache(pairs: Sequence[tuple[Any, Any]], config: Any) -> Any:
    """A ``DynamicCache`` over ``pairs`` (transformers copies them)."""
    if LEGACY:
        return DynamicCache.from_legacy_cache(tuple(pairs))
    return DynamicCache(ddp_cache_data=list(pairs), config=config)


def from_legacy(value: Any) -> Any:
    """A legacy tuple of per-layer pairs (what old custom code returns) as a cache."""
    return DynamicCache.from_legacy_cache(value)


def out_cache(out: Any) -> Any:
    """A forward output's cache (transformers 5 renamed ``past_key_values`` ``cache``)."""
    return getattr(out, "cache", None) or out.past_key_values


def pairs_of(cache: Any) -> KV:
    """A transformers cache's per-layer ``(keys, values)``."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k, v) for k, v in cache.to_legacy_cache()]  # transformers 4.x


__all__ = [
    "KV",
    "LEGACY",
    "cache_argument",
    "dynamic_cache",
    "from_legacy",
    "new_cache",
    "out_cache",
    "pairs_of",
]
