"""A vLLM model class for cached PRM checks: Qwen2.5-Math-PRM read at the last token only.

vLLM serves Qwen2.5-Math-PRM (``Qwen2ForProcessRewardModel``) with ``STEP``
pooling: every step's reward from one forward over the whole input. vLLM 0.32
cannot serve such a model from its prefix cache (``ModelConfig.
is_prefix_caching_supported`` is False for ``STEP`` pooling, and
``token_classify`` requests skip reading the cache), so every check re-encodes
every branch from its first token.

``LastStepQwen2PRM`` is the same network (the Qwen2 body and the two-layer
``score`` head, the same weights, loaded by the same loader) with ``LAST``
pooling for the ``classify`` task: asked for an input that ends at a step's
separator, it returns that step's two logits. A causal model with ``LAST``
pooling is served from the prefix cache, so asking, at each check, for the
prefix that ends at a branch's latest separator computes only the tokens
after the blocks the previous check left in the cache
(``sart.prm.vllm_cached.VLLMCachedPRM``).

It is registered with vLLM's public extension point for out-of-tree models
(``ModelRegistry.register_model``) under ``ARCHITECTURE``, by ``register()``:
called by ``VLLMCachedPRM`` in this process, and by vLLM itself in every
process it starts (``vllm serve`` included) through the ``vllm.general_plugins``
entry point that sart's package declares. A checkpoint of Qwen2.5-Math-PRM
loads as this class with ``hf_overrides={"architectures": [ARCHITECTURE]}``
(``vllm serve ... --hf-overrides '{"architectures": ["SartLastStepQwen2PRM"]}'``);
its weights and ``config.json`` stay as they are.

This module imports vLLM's model code only when the class is built
(``_model_class``), so ``register()`` is cheap and safe to call anywhere.
"""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "SartLastStepQwen2PRM"
"""The architecture name the model class is registered under."""
TARGET = "sart.prm.vllm_model:LastStepQwen2PRM"
"""``module:attribute`` of the class, as vLLM's registry takes it (loaded lazily)."""


def register() -> None:
    """Register ``LastStepQwen2PRM`` with vLLM as ``ARCHITECTURE`` (idempotent). Also
    the ``vllm.general_plugins`` entry point: vLLM calls it in each of its processes."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, TARGET)


def _model_class() -> type:
    from vllm.model_executor.layers.pooler.seqwise import pooler_for_classify
    from vllm.model_executor.models.interfaces_base import default_pooling_type
    from vllm.model_executor.models.qwen2_rm import Qwen2RewardBaseModel

    @default_pooling_type(seq_pooling_type="LAST")
    class LastStepQwen2PRM(Qwen2RewardBaseModel):
        """Qwen2.5-Math-PRM's network; the ``classify`` task reads the score head's two
        logits at the last token of the input (see the module docstring)."""

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            vllm_config.model_config.hf_config.num_labels = 2
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            pooler_config = vllm_config.model_config.pooler_config
            assert pooler_config is not None
            # The forward already applies the score head: the pooler only picks the
            # last token's logits (no classifier of its own).
            self.pooler = pooler_for_classify(pooler_config)

    LastStepQwen2PRM.__module__ = __name__
    LastStepQwen2PRM.__qualname__ = "LastStepQwen2PRM"
    return LastStepQwen2PRM


def __getattr__(name: str) -> Any:
    # ``LastStepQwen2PRM`` is built on first access (vLLM's registry resolves TARGET
    # with getattr), so importing this module never imports vLLM.
    if name == "LastStepQwen2PRM":
        cls = _model_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ARCHITECTURE", "TARGET", "register"]
