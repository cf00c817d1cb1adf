"""How sart's requests and SGLang's streams map to each other (pure; no ``sglang`` import).

Sampling: ``temperature``, ``top_p``, ``max_new_tokens`` (capped by the
model's context length), ``stop`` and ``sampling_seed`` = the branch's seed.
SGLang honours ``sampling_seed`` only with ``enable_deterministic_inference``
(then the same seeds give the same text, which sart's ``check_engine`` asks
for), which needs a GPU attention backend (``fa3``, ``flashinfer``,
``triton``...); otherwise, and always on SGLang's CPU path, each branch still
samples independently, just not reproducibly.

Log-probabilities. A request whose ``SamplingSettings.logprobs`` is ``k``
(not ``None``) is sent with ``return_logprob=True`` and ``top_logprobs_num=k``
(``logprob_start_len`` is left at SGLang's default, -1: the output tokens
only, so the prompt costs nothing more and the radix cache still serves all
of it but its last token). Each chunk's ``meta_info`` then carries
``output_token_logprobs`` (one ``(logprob, token_id, text)`` per output
token; ``text`` is ``None``, ``return_text_in_logprobs`` being off) and, for
``k > 0``, ``output_top_logprobs`` (per token the ``k`` most likely as such
triples, highest first), cumulative or incremental as the chunk's
``output_ids`` are (SGLang slices both at the same offset); the adapter takes
the entries of the chunk's new tokens (``TokenLogprobs``), one per token, or
fails the request if SGLang sent fewer. A fork reports its own new tokens'
only. What they measure (``python/sglang/srt/layers/sampler.py``): unlike
vLLM's default raw log-probabilities, SGLang's are ``log_softmax(logits /
temperature)`` of the logits after its logit processors and penalties, but
before top-p / top-k / min-p filtering; a greedy request (temperature 0,
which SGLang runs as temperature 1 with top-k 1) gets ``log_softmax(logits)``.
SGLang's environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` makes them
the unscaled ``log_softmax(logits)`` for every request, like vLLM's.

``sampling_params`` and ``logprob_args`` build a branch's request fields;
``finish_reason`` and ``token_logprobs`` read a streamed chunk's ``meta_info``.
``sart.engines.sglang.SGLangEngine`` uses them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sart.engines.base import TokenLogprobs
from sart.types import BranchId, FinishReason, SamplingSettings

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}

#: vLLM's sampling field names that SGLang spells otherwise.
_SGLANG_NAMES = {"min_tokens": "min_new_tokens", "include_stop_str_in_output": "no_stop_trim"}


class SGLangRequestError(RuntimeError):
    """SGLang ended a branch's request itself (finish reason ``"abort"`` or unknown)."""


def sampling_params(sampling: SamplingSettings, seed: int, max_new_tokens: int) -> dict:
    """SGLang's ``sampling_params`` dict for one branch: vLLM's extra fields set away
    from their defaults under SGLang's names (``min_new_tokens``, ``no_stop_trim``;
    ``min_new_tokens`` kept within the tokens a fork or a resume has to go)."""
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_new_tokens": max_new_tokens,
        "sampling_seed": seed,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    for field, value in sampling.extra_fields(max_new_tokens).items():
        params[_SGLANG_NAMES.get(field, field)] = value
    return params


def logprob_args(sampling: SamplingSettings) -> dict[str, Any]:
    """The ``async_generate`` keywords that ask SGLang for ``sampling.logprobs``
    (none when it is ``None``: SGLang then computes none)."""
    if sampling.logprobs is None:
        return {}
    return {"return_logprob": True, "top_logprobs_num": sampling.logprobs}


def finish_reason(branch: BranchId, rid: str, reason: Any) -> FinishReason | None:
    """A chunk's ``meta_info["finish_reason"]`` as sart's (``None``: not the last
    chunk); ``SGLangRequestError`` for any reason but ``stop`` and ``length``."""
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    finish = _FINISH.get(kind) if isinstance(kind, str) else None
    if finish is None:
        message = reason.get("message") if isinstance(reason, Mapping) else None
        raise SGLangRequestError(
            f"SGLang ended branch {branch} (rid {rid!r}) with finish_reason {kind!r}"
            + (f": {message}" if message else f" ({reason!r})")
        )
    return finish


def stop_reason(reason: Any, stop_token_ids: Sequence[int]) -> str | int | None:
    """vLLM's ``stop_reason`` from SGLang's last ``finish_reason`` (``{"type": "stop",
    "matched": ...}``): the stop string, or the token id when it is one of the request's
    ``stop_token_ids``; ``None`` for EOS (SGLang names its id as ``matched`` too)."""
    matched = reason.get("matched") if isinstance(reason, Mapping) else None
    if isinstance(matched, str):
        return matched
    if isinstance(matched, int) and not isinstance(matched, bool) and matched in stop_token_ids:
        return matched
    return None


def token_logprobs(
    branch: BranchId, meta: Mapping[str, Any], start: int, count: int, top_k: int
) -> tuple[TokenLogprobs, ...]:
    """The log-probabilities of a chunk's ``count`` new tokens, at ``start`` in its
    ``meta_info`` lists: ``output_token_logprobs`` (``(logprob, token_id, text)`` per
    token) and, for ``top_k > 0``, ``output_top_logprobs`` (per token a list of such
    triples, most likely first). Raises ``SGLangRequestError`` if SGLang sent fewer
    entries than tokens: a branch's logprobs are one per token or none."""
    # Slices only: in cumulative mode the lists hold every token so far.
    sampled = (meta.get("output_token_logprobs") or ())[start : start + count]
    tops: Sequence[Any] = [()] * count
    if top_k > 0:
        tops = (meta.get("output_top_logprobs") or ())[start : start + count]
    if len(sampled) < count or len(tops) < count:
        raise SGLangRequestError(
            f"SGLang sent log-probabilities for {min(len(sampled), len(tops))} of the "
            f"{count} new tokens of branch {branch} (meta_info keys: {sorted(meta)})"
        )
    out = []
    for entry, top in zip(sampled, tops, strict=True):
        if entry is None or (top_k > 0 and not top):
            raise SGLangRequestError(
                f"SGLang sent a token of branch {branch} without its log-probabilities"
            )
        ranked = sorted(((float(t[0]), int(t[1])) for t in top), key=lambda t: -t[0])[:top_k]
        out.append(
            TokenLogprobs(
                float(entry[0]),
                tuple(value for value, _ in ranked),
                int(entry[1]),
                tuple(token for _, token in ranked),
            )
        )
    return tuple(out)
