"""Process reward models. Adapters live in their own modules and load lazily.

::

    base       the PRM contract: ScoreItem, PRM, PricedPRM, validate_reward
    aggregate  steps (split on blank lines) and step rewards into one reward
    window     the context window on token ids (Encoded, ContextLimit, fit_context)
    formats    input formats on a tokenizer (QwenFormat, StepTagFormat)
    options    every PRM's keyword options, declared once
    scripted   ScriptedPRM: scripted rewards, for tests and the simulator
    priced     CostedPRM: any PRM plus a model of its calls' time, for virtual clocks
    process    PRMProcess: any PRM hosted in a child process
    hf         QwenMathPRM, StepTagPRM on transformers (torch)
    hf_cache   transformers KV caches for hf: pass, crop, merge, split
    vllm       VLLMQwenPRM on a vLLM pooling model

Only ``hf``, ``hf_cache`` and ``vllm`` import torch or vLLM.
"""

from sart.prm.base import PRM, PricedPRM, ScoreItem, validate_reward
from sart.prm.priced import CostedPRM

__all__ = ["PRM", "CostedPRM", "PricedPRM", "ScoreItem", "validate_reward"]
