"""The testbed PRM's model class: the policy's own likelihood of a trace, read by a small head.

A process reward model in Qwen2.5-Math-PRM's format (2 labels per token, read
at the step separator) built from two parts:

1. a frozen copy of the testbed policy (a Llama causal LM), which reads the
   trace with the separator shown to it as the step word it generated, and
   gives every response token's log-probability under the policy;
2. seven running features of those log-probabilities, per position, over the
   response so far — the lowest, the sum, how many tokens were below 10%
   and below 1%, the response's length, the question's length, and the steps
   so far — standardised and read by a linear 2-label head trained on the
   policy's own graded rollouts (``sart.testbed.train.train_prm``).

The first four say whether the trace has slipped (a wrong step result is a
token the policy itself found unlikely); the last three say how much of the
question is still ahead, where more slips may come. The separator's own
log-probability is left out: the PRM format puts one after a step cut
mid-way, which the policy would never have written.

This file is saved next to the weights and loaded with ``trust_remote_code``
through ``auto_map`` (as Qwen2.5-Math-PRM's own modelling code is), so it
imports only torch and transformers. Incremental scoring with a KV cache works:
the running features of the positions already seen are kept on the cache
object and cut back with it. They are tensors aligned with the cache's
positions (``[batch, positions, ...]``, in a dict under ``cache_state_key``),
so that ``sart.prm.hf`` can batch the caches of several branches the way it
batches their keys and values: left-padded to the longest with masked
positions (the features read at a row's last cached position are then its
own), the new tokens given their real ``position_ids``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import TokenClassifierOutput

FEATURES = (
    "min_logprob",
    "sum_logprob",
    "below_10pct",
    "below_1pct",
    "response_tokens",
    "question_tokens",
    "steps",
)
"""The head's inputs, per position (see the module docstring)."""

_STATE = "_sart_testbed_prm_state"
"""Attribute of a KV cache holding the running features of its positions."""


class TestbedPRMConfig(PretrainedConfig):
    """The policy's configuration and the token ids the features need.

    The policy's configuration is ``text_config``, the name transformers looks
    for (``get_text_config``) when it sizes a KV cache for this model."""

    model_type = "sart_testbed_prm"
    sub_configs: ClassVar[dict[str, type]] = {"text_config": LlamaConfig}

    def __init__(
        self,
        text_config: LlamaConfig | dict[str, Any] | None = None,
        separator_id: int = 0,
        step_word_id: int = 0,
        question_end_id: int = 0,
        **kwargs: Any,
    ) -> None:
        if not isinstance(text_config, LlamaConfig):
            text_config = LlamaConfig(**(text_config or {}))
        self.text_config = text_config
        self.separator_id = separator_id
        """The PRM's step separator (``<step>``): rewards are read there."""
        self.step_word_id = step_word_id
        """What the policy sees in the separator's place: the step word it writes."""
        self.question_end_id = question_end_id
        """The token ending the question (``S``): the response starts after it."""
        kwargs.setdefault("num_labels", 2)
        super().__init__(**kwargs)


class TestbedPRM(PreTrainedModel):
    """Frozen policy + running likelihood features + a linear 2-label head."""

    config_class = TestbedPRMConfig
    base_model_prefix = "prm"
    _no_split_modules: ClassVar[list[str]] = ["LlamaDecoderLayer"]
    cache_state_key: ClassVar[str] = _STATE
    """The KV cache attribute holding per-position state: a dict of tensors shaped
    ``[batch, positions, ...]``, aligned with the cache's positions (the
    protocol ``sart.prm.hf`` follows to merge and split such caches)."""

    def __init__(self, config: TestbedPRMConfig) -> None:
        super().__init__(config)
        self.policy = LlamaForCausalLM(config.text_config)
        self.policy.requires_grad_(False)
        n = len(FEATURES)
        # Parameters rather than buffers so that save/load treat them like weights.
        self.feature_mean = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.feature_scale = nn.Parameter(torch.ones(n), requires_grad=False)
        self.score = nn.Linear(n, 2)
        parameters = inspect.signature(self.policy.forward).parameters
        # transformers 5.x names the cache argument ``cache``, 4.x ``past_key_values``.
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Every weight comes from the policy or from training: nothing to draw.
        pass

    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[batch, tokens, len(FEATURES)]`` running features (unstandardised).

        With ``cache``, ``input_ids`` continue the positions it holds (whose
        features it keeps); the policy's KV cache is filled in place. A row's
        last cached position must be one of its own (pad on the left), and
        ``position_ids`` go to the policy (its rotary embeddings must see the
        real positions, not count the pads).
        """
        config = self.config
        past = cache.get_seq_length() if cache is not None else 0
        state = _cached_state(cache, past, input_ids.shape[0])
        policy_ids = input_ids.masked_fill(input_ids == config.separator_id, config.step_word_id)
        kwargs: dict[str, Any] = {}
        if cache is not None:
            kwargs[self._cache_argument] = cache
        output = self.policy(
            input_ids=policy_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=cache is not None,
            **kwargs,
        )
        logprobs = torch.log_softmax(output.logits.float(), dim=-1)
        batch = input_ids.shape[0]
        vocab = logprobs.shape[-1]
        # The distribution each token was drawn from: the previous position's.
        before = (
            state["next"][:, -1:]
            if state is not None
            else torch.zeros(batch, 1, vocab, device=logprobs.device)
        )
        predicted = torch.cat([before, logprobs[:, :-1]], dim=1)
        token_lp = predicted.gather(-1, policy_ids.unsqueeze(-1)).squeeze(-1)

        seen_before = (
            state["seen"][:, -1:]
            if state is not None
            else torch.zeros(batch, 1, dtype=torch.bool, device=input_ids.device)
        )
        is_end = input_ids == config.question_end_id
        seen = torch.cumsum(is_end.long(), dim=1).bool() | seen_before
        # A response token comes after the question's end (not the end itself).
        in_response = torch.cat([seen_before, seen[:, :-1]], dim=1)
        separator = input_ids == config.separator_id
        counted = in_response & ~separator
        zero = torch.zeros_like(token_lp)
        lp = torch.where(counted, token_lp, zero)
        inf = torch.full_like(token_lp, float("inf"))
        running_min = torch.cummin(torch.where(counted, token_lp, inf), dim=1).values
        increments = torch.stack(
            [
                lp,
                (counted & (token_lp < math.log(0.1))).float(),
                (counted & (token_lp < math.log(0.01))).float(),
                counted.float(),
                (~in_response).float(),
                (in_response & separator).float(),
            ],
            dim=-1,
        )
        sums = torch.cumsum(increments, dim=1)
        if state is not None:
            sums = sums + state["sums"][:, -1:]
            running_min = torch.minimum(running_min, state["min"][:, -1:])
        if cache is not None:
            _keep_state(cache, state, logprobs, seen, running_min, sums)
        lowest = torch.where(torch.isinf(running_min), zero, running_min)
        return torch.cat([lowest.unsqueeze(-1), sums], dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        cache: Any = None,
        use_cache: bool | None = None,
        **_: Any,
    ) -> TokenClassifierOutput:
        """``logits[batch, tokens, 2]`` (bad, good) at every position."""
        cache = cache if cache is not None else past_key_values
        features = self.features(
            input_ids, attention_mask, cache if use_cache else None, position_ids=position_ids
        )
        standardised = (features - self.feature_mean) / self.feature_scale
        # Features are computed in float32; the head may be in half precision.
        return TokenClassifierOutput(logits=self.score(standardised.to(self.score.weight.dtype)))


def _cached_state(cache: Any, past: int, batch: int) -> dict[str, torch.Tensor] | None:
    """The running features of the cache's first ``past`` positions (cut back to them)."""
    if cache is None or past == 0:
        return None
    state = getattr(cache, _STATE, None)
    if state is None or state["seen"].shape[1] < past or state["seen"].shape[0] != batch:
        raise ValueError(
            "TestbedPRM: this KV cache was not filled by a TestbedPRM (its running features "
            "are missing); score from the start without a cache"
        )
    return {key: value[:, :past] for key, value in state.items()}


def _keep_state(
    cache: Any,
    state: dict[str, torch.Tensor] | None,
    logprobs: torch.Tensor,
    seen: torch.Tensor,
    running_min: torch.Tensor,
    sums: torch.Tensor,
) -> None:
    new = {"next": logprobs, "seen": seen, "min": running_min, "sums": sums}
    if state is not None:
        new = {key: torch.cat([state[key], value], dim=1) for key, value in new.items()}
    setattr(cache, _STATE, new)


# ``save_pretrained`` copies this file next to the weights and writes the
# ``auto_map`` that ``AutoConfig``/``AutoModel`` follow with trust_remote_code.
TestbedPRMConfig.register_for_auto_class()
TestbedPRM.register_for_auto_class("AutoModel")
