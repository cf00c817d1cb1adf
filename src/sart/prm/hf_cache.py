"""transformers KV caches as the transformers PRMs use them: pass, crop, read, fill.

Needs torch and transformers; used by ``sart.prm.hf``, which re-exports
``CacheAPI``. ``CacheAPI`` hides what differs between transformers 4.x and
5.x (the argument's name, how a cache is cropped, where its tensors live, how
a new one is filled with tensors as they are).

Only a ``DynamicCache`` of plain layers can be read into the PRM's KV pool and
filled from it (``sart.prm.hf_pool``; ``CacheAPI.tensors`` is ``None`` for
sliding windows, quantised, static or offloaded caches).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import transformers

from sart.hf_compat import cache_argument, from_legacy, new_cache

__all__ = ["CacheAPI"]


@attrs.frozen
class CacheAPI:
    """How a model's ``forward`` takes a KV cache: ``cache=`` in transformers 5.x,
    ``past_key_values=`` in 4.x (and in custom code written for it, such as
    Qwen2.5-Math-PRM's). Inspected once per model."""

    argument: str

    @classmethod
    def of(cls, model: Any) -> CacheAPI:
        return cls(cache_argument(model))

    @staticmethod
    def new(model: Any) -> Any:
        return new_cache(model.config)

    def returned(self, output: Any, passed: Any) -> Any:
        """The cache after a forward: the one the output carries, under the same
        name as the argument, if any (4.x causal LMs return it), else the one
        passed in, which the model filled in place (token-classification
        outputs and Qwen's custom code carry none)."""
        value = getattr(output, self.argument, None)
        if value is None or value is passed:
            return passed
        if isinstance(value, tuple):  # the legacy format, from old custom code
            return from_legacy(value)
        return value

    @staticmethod
    def crop(cache: Any, length: int) -> None:
        """Keep the first ``length`` tokens. A negative ``crop`` argument means
        "remove that many" in both 4.x and 5.x (5.x refuses positive ones)."""
        remove = cache.get_seq_length() - length
        if remove > 0:
            cache.crop(-remove)
        if cache.get_seq_length() != length:
            raise RuntimeError(f"cache crop to {length} left {cache.get_seq_length()} tokens")

    @staticmethod
    def tensors(cache: Any) -> list[tuple[Any, Any]] | None:
        """Each layer's (keys, values), ``[batch, heads, positions, head_dim]``, if
        the cache is laid out so that rows can be merged and split: a
        ``DynamicCache`` of plain ``DynamicLayer`` objects (transformers 5.x and
        late 4.x) or of ``key_cache``/``value_cache`` lists (earlier 4.x).
        ``None`` for any other (sliding windows, quantised, static, offloaded).
        """
        if type(cache) is not transformers.DynamicCache:
            return None
        layers = getattr(cache, "layers", None)
        if layers is not None:
            if not all(type(layer) is _DYNAMIC_LAYER and layer.is_initialized for layer in layers):
                return None
            out = [(layer.keys, layer.values) for layer in layers]
        else:
            keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
            if not isinstance(keys, list) or not isinstance(values, list):
                return None
            out = list(zip(keys, values))
        lengths = {t.shape[-2] if t.dim() == 4 else -1 for pair in out for t in pair}
        return out if out and len(lengths) == 1 and -1 not in lengths else None

    @staticmethod
    def fill(cache: Any, tensors: Sequence[tuple[Any, Any]]) -> Any:
        """``cache``, new and empty, holding ``tensors`` (as ``tensors`` returns
        them) as they are, not copied."""
        layers = getattr(cache, "layers", None)
        for i, (keys, values) in enumerate(tensors):
            if layers is not None and i < len(layers) and type(layers[i]) is _DYNAMIC_LAYER:
                _install(layers[i], keys, values)
            else:  # 4.x lists: ``update`` appends a layer's first tensors as they are
                cache.update(keys, values, i)
        return cache


_DYNAMIC_LAYER = getattr(transformers.cache_utils, "DynamicLayer", None)


def _install(layer: Any, keys: Any, values: Any) -> None:
    """Put tensors into an empty ``DynamicLayer`` as they are (its ``update``
    would concatenate them to an empty tensor: a copy of the whole cache)."""
    try:
        layer.lazy_initialization(keys, values)  # sets the device and dtype
    except TypeError:  # transformers 4.5x: lazy_initialization(key_states)
        layer.lazy_initialization(keys)
    layer.keys, layer.values = keys, values
