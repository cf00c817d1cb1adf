"""``FakeStreamingEngine``: scripted branches served as independent token streams.

The streaming counterpart of ``FakeEngine`` for testing ``StreamingEngine``
and the asyncio driver: each branch follows its ``BranchScript`` but streams
at its own pace, in chunks of 1-``burst`` tokens with ``await asyncio.sleep(0)``
between them (seeded per branch), so branches of one batch run ahead of each
other as they do on a real server; scripted log-probabilities as ``FakeEngine``'s.
``fail_stream`` makes chosen branches'
streams raise after some tokens.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Mapping

from sart.engines.scripts import BranchScript, ScriptLike, as_script
from sart.engines.streaming import BranchStart, Chunk, StreamingEngine
from sart.types import EXTRA_SAMPLING, BranchId, FinishReason


class FakeStreamingEngine(StreamingEngine):
    # Scripts, not sampling: every field is taken (and changes nothing).
    sampling_fields = frozenset(EXTRA_SAMPLING)

    def __init__(
        self,
        script: ScriptLike = None,
        *,
        burst: int = 5,
        fail_stream: Mapping[BranchId, int] | None = None,
    ) -> None:
        super().__init__()
        self.script = as_script(script)
        self.burst = burst
        self.fail_stream = dict(fail_stream or {})
        self.cancelled: list[BranchId] = []
        self._running: dict[BranchId, BranchScript] = {}  # the script each branch follows

    async def _open(self, start: BranchStart) -> AsyncIterator[Chunk]:
        branch, parent, prefix_tokens = start.branch, start.parent, start.prefix_tokens
        sampling = start.sampling
        if parent is None:
            script = self.script(branch)
        else:  # as FakeEngine: the script's fork if it has one, else what the parent runs
            fork = getattr(self.script, "fork", None)
            if fork is not None:
                script = fork(branch, parent, len(prefix_tokens))
            else:
                script = self._running[parent]
        self._running[branch] = script
        rng = random.Random(start.seed)
        pos = len(prefix_tokens)
        end = min(script.length, sampling.max_tokens)
        reason = FinishReason.STOP if script.length <= sampling.max_tokens else FinishReason.LENGTH
        while pos < end:
            await asyncio.sleep(0)
            n = min(end - pos, rng.randint(1, self.burst))
            failing = self.fail_stream.get(branch)
            if failing is not None and pos < failing <= pos + n:
                raise RuntimeError(f"injected stream failure at token {failing} of {branch}")
            ids = tuple(range(pos, pos + n))
            texts = tuple(script.text_span(i, i + 1) for i in range(pos, pos + n))
            k = sampling.logprobs
            logprobs = () if k is None else script.logprobs_span(pos, pos + n, k)
            pos += n
            yield Chunk(
                token_ids=ids,
                text="".join(texts),
                texts=texts,
                finish=reason if pos == end else None,
                logprobs=logprobs,
            )

    async def _cancel(self, branch: BranchId) -> None:
        self.cancelled.append(branch)
