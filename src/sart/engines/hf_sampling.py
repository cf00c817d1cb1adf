"""A decode step's tokens for every branch at once (the transformers engine's sampler).

One pass over the step's ``[B, V]`` logits: vLLM's penalties and ``min_tokens``,
then temperature, ``min_p``, ``top_k``, ``top_p``, and the draw, each a fixed number
of tensor operations whatever ``B`` is (a GPU launches the same kernels for 1 branch
as for 64), and the raw log-probabilities the requests asked for. The caller reads
the tokens and log-probabilities back with one transfer (``read_back``).

The draw is counter-based: branch ``(seed, d)``'s ``d``-th token is drawn by inverse
CDF (in token-id order) with one uniform from a hash of its seed and ``d``
(``uniforms``). So a branch's tokens depend only on its seed and its own history,
not on which branches share its batch or in what order; a fork has a seed of its own
and so a stream of its own from its first token; a paused branch that resumes draws
what it would have. ``temperature == 0`` is greedy (the argmax), as
``model.generate(do_sample=False)``.

This sampler replaced one ``torch.Generator`` per branch (a softmax, sort, cumsum and
multinomial per branch per step, and a blocking read each): the same distributions,
other draws, so transformers runs from before it (``SAMPLER``) are not reproduced.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import attrs
import torch

from sart.engines.base import TokenLogprobs
from sart.types import SamplingSettings

SAMPLER = "counter-inverse-cdf/1"
"""This sampler's name, in a benchmark's serving description: ``--resume`` does not
mix runs of two samplers."""

_SCALE = float(2**53)


def uniforms(seeds: Sequence[int], draws: Sequence[int]) -> list[float]:
    """One number in (0, 1) per ``(seed, draw)``: 53 bits of a BLAKE2b hash of both
    (any integer seed; the same on every machine and device)."""
    out = []
    for seed, draw in zip(seeds, draws):
        key = f"{seed}:{draw}".encode()
        bits = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 11
        out.append((bits + 0.5) / _SCALE)
    return out


@attrs.frozen
class Row:
    """What sampling one branch's next token reads."""

    sampling: SamplingSettings
    seed: int
    tokens: Sequence[int]
    """The branch's tokens so far (a fork's include its parent's): its history."""
    prompt: Sequence[int] = ()
    """The prompt's ids (``repetition_penalty`` reads them)."""


def sample(logits: torch.Tensor, rows: Sequence[Row], stop_ids: frozenset[int]) -> torch.Tensor:
    """The next token of each row, ``[B]`` on ``logits``' device (not read back).
    ``stop_ids``: the model's EOS ids, held back before ``min_tokens``."""
    if any(r.sampling.extra_fields() for r in rows):
        logits = _penalised(logits.clone(), rows, stop_ids)
    vocab = logits.shape[1]
    device = logits.device
    params = torch.tensor(
        [
            [
                r.sampling.temperature or 1.0,
                r.sampling.min_p,
                min(r.sampling.top_k or vocab, vocab),
                r.sampling.top_p,
            ]
            for r in rows
        ],
        dtype=torch.float32,
        device=device,
    )
    temperature, min_p, top_k, top_p = params.unbind(1)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    if any(r.sampling.min_p > 0.0 for r in rows):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    limited = [min(r.sampling.top_k or vocab, vocab) for r in rows]
    if min(limited) < vocab:
        widest = max(k for k in limited if k < vocab)
        top = probs.topk(widest, dim=-1).values
        at = (top_k.clamp(max=widest) - 1).long()[:, None]
        kth = torch.where(top_k[:, None] < vocab, top.gather(1, at), 0.0)
        probs = probs.masked_fill(probs < kth, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    if any(r.sampling.top_p < 1.0 for r in rows):
        # The smallest prefix of tokens (likeliest first) whose mass reaches top_p.
        ordered, order = probs.sort(dim=-1, descending=True, stable=True)
        drop = (ordered.cumsum(-1) - ordered > top_p[:, None]) & (top_p[:, None] < 1.0)
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), 0.0)
    # Inverse CDF in token-id order: each row's draw reads its own uniform only.
    cdf = probs.double().cumsum(-1)
    draws = [len(r.tokens) for r in rows]
    u = torch.tensor(uniforms([r.seed for r in rows], draws), dtype=torch.float64, device=device)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    picked = picked.clamp(max=vocab - 1)
    greedy = torch.tensor([r.sampling.temperature == 0.0 for r in rows], device=device)
    return torch.where(greedy, logits.argmax(-1), picked)


def _penalised(logits: torch.Tensor, rows: Sequence[Row], stop_ids: frozenset[int]) -> torch.Tensor:
    """``logits`` (a copy) under vLLM's penalties, batched: ``repetition_penalty`` on the
    prompt's and the output's tokens, ``presence_penalty`` and ``frequency_penalty`` on
    the output's, and no EOS or stop token before ``min_tokens``. Each penalty is one
    scatter over the (row, token) pairs of the rows that set it, uploaded at once."""
    device = logits.device
    vocab = logits.shape[1]

    def pairs(items: Sequence[tuple[int, Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows_ = [i for i, ids in items for _ in ids]
        cols = [t for _, ids in items for t in ids]
        flat = torch.tensor([rows_, cols], dtype=torch.long, device=device)
        return flat[0], flat[1]

    repeat = [(i, sorted({*r.prompt, *r.tokens})) for i, r in enumerate(rows)]
    repeat = [(i, ids) for i, ids in repeat if rows[i].sampling.repetition_penalty != 1.0 and ids]
    if repeat:
        at = pairs(repeat)
        penalty = torch.tensor(
            [rows[i].sampling.repetition_penalty for i, ids in repeat for _ in ids],
            dtype=logits.dtype,
            device=device,
        )
        picked = logits[at]
        logits[at] = torch.where(picked > 0, picked / penalty, picked * penalty)
    counted = [
        (i, r.tokens)
        for i, r in enumerate(rows)
        if r.tokens and (r.sampling.presence_penalty or r.sampling.frequency_penalty)
    ]
    if counted:
        row_ids, token_ids = pairs(counted)
        counts = torch.zeros_like(logits).index_put_(
            (row_ids, token_ids), torch.ones_like(token_ids, dtype=logits.dtype), accumulate=True
        )
        weights = torch.tensor(
            [[r.sampling.frequency_penalty, r.sampling.presence_penalty] for r in rows],
            dtype=logits.dtype,
            device=device,
        )
        logits -= weights[:, :1] * counts + weights[:, 1:] * (counts > 0).to(logits.dtype)
    early = [
        (i, sorted(t for t in {*stop_ids, *r.sampling.stop_token_ids} if 0 <= t < vocab))
        for i, r in enumerate(rows)
        if len(r.tokens) < r.sampling.min_tokens
    ]
    if early:
        logits[pairs(early)] = float("-inf")
    return logits


def logprobs(
    logits: torch.Tensor, rows: Sequence[Row], tokens: torch.Tensor
) -> tuple[list[int], torch.Tensor | None]:
    """The rows whose request asked for log-probabilities, and for them ``[rows, 1 + 2k]``
    of the raw ``log_softmax`` of ``logits`` (before penalties and temperature, as
    vLLM's default): column 0 the sampled token's, then the ``k`` likeliest, then their
    token ids (``k`` the largest asked; each row keeps its own first ``k`` in
    ``read_back``)."""
    asking = [i for i, r in enumerate(rows) if r.sampling.logprobs is not None]
    if not asking:
        return [], None
    vocab = logits.shape[-1]
    index = torch.tensor(asking, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    values = logp.gather(1, tokens.index_select(0, index)[:, None])
    widest = max(min(rows[i].sampling.logprobs or 0, vocab) for i in asking)
    if widest > 0:
        top = logp.topk(widest, dim=-1)
        values = torch.cat([values, top.values, top.indices.to(values.dtype)], dim=1)
    return asking, values


def read_back(
    tokens: torch.Tensor, asking: list[int], values: torch.Tensor | None, rows: Sequence[Row]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The step's tokens and log-probabilities on the host, in one transfer (one sync)."""
    batch = tokens.shape[0]
    if values is None:
        return tokens.tolist(), [None] * batch
    width = values.shape[1]
    packed = torch.zeros((batch, 1 + width), dtype=torch.float64, device=tokens.device)
    packed[:, 0] = tokens
    packed[torch.tensor(asking, device=tokens.device), 1:] = values.double()
    table = packed.tolist()
    out: list[TokenLogprobs | None] = [None] * batch
    widest = (width - 1) // 2
    for i in asking:
        row = table[i]
        k = min(rows[i].sampling.logprobs or 0, widest)
        ids = row[2 + widest : 2 + widest + k]
        out[i] = TokenLogprobs(
            row[1], tuple(row[2 : 2 + k]), int(row[0]), tuple(int(t) for t in ids)
        )
    return [int(row[0]) for row in table], out


__all__ = ["SAMPLER", "Row", "logprobs", "read_back", "sample", "uniforms"]
