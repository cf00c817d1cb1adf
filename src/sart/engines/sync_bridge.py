"""``SyncBridge``: an async engine behind the synchronous engine contract, on an event loop.

The synchronous driver, ``check_engine`` and the benchmarks call engines step by
step; ``StreamingEngine`` adapters (vLLM's ``AsyncLLM``, SGLang's ``Engine``, the
OpenAI gateway) are coroutines. The bridge runs each call to completion on a loop of
its own, or on one that belongs to someone else (``sglang.Engine``'s).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from sart.engines.base import BranchSpec, EngineStats, StepOutput
from sart.types import BranchId, Prompt, SamplingSettings


class SyncBridge:
    """Runs an async engine (``StreamingEngine`` and friends) behind the synchronous
    engine contract, on an event loop: for the ``SyncDriver``, ``check_engine`` and
    benchmarks.

    ``SyncBridge(engine)`` runs it on a private loop, which ``close()`` closes
    (after closing the engine). ``SyncBridge(engine, loop=loop)`` runs it on a
    loop that belongs to someone else, such as ``sglang.Engine``'s own loop or
    another bridge's; ``close()`` then leaves the loop and the engine to their
    owner. Engines that bind to the loop running when they are built
    (vLLM's ``AsyncLLM``, ``sglang.Engine``) are built with
    ``SyncBridge.build(factory)``, which calls ``factory`` on the bridge's loop.
    """

    def __init__(self, engine: Any, *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.engine = engine
        self._owns_loop = loop is None
        self.loop = asyncio.new_event_loop() if loop is None else loop
        self.supports_fork = bool(getattr(engine, "supports_fork", False))
        self.supports_pause = bool(getattr(engine, "supports_pause", False))
        self.sampling_fields = frozenset(getattr(engine, "sampling_fields", ()))
        self.bridged_name = type(engine).__name__

    @classmethod
    def build(cls, factory: Callable[[], Any]) -> SyncBridge:
        """A bridge, on a loop of its own, over the engine ``factory()`` returns (or,
        for an async factory, the engine it resolves to), called while that loop runs."""

        async def make() -> Any:
            made = factory()
            return await made if inspect.isawaitable(made) else made

        loop = asyncio.new_event_loop()
        try:
            engine = loop.run_until_complete(make())
        except BaseException:
            loop.close()
            raise
        bridge = cls(engine, loop=loop)
        bridge._owns_loop = True
        return bridge

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer, if it has one (a server's chat template comes from it)."""
        return getattr(self.engine, "tokenizer", None)

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        return self._run(self.engine.prefill(request_id, prompt, sampling))

    def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        self._run(self.engine.start_branches(request_id, branches))

    def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        return self._run(self.engine.step(max_steps, until_first_end))

    def abort(self, branch_ids: Sequence[BranchId]) -> None:
        self._run(self.engine.abort(branch_ids))

    def pause(self, branch_ids: Sequence[BranchId]) -> None:
        self._run(self.engine.pause(branch_ids))

    def release_prefix(self, request_id: str) -> None:
        self._run(self.engine.release_prefix(request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        """Close the engine, then the loop, leaving nothing pending behind.

        The engine's own ``aclose()`` (``OpenAIEngine``: its HTTP clients) runs
        on the loop, or its ``shutdown()`` (``VLLMAsyncEngine``: vLLM's engine
        core) is called. Then every task still on the loop is cancelled and
        run to its end before the loop closes: a task destroyed while pending
        (such as ``AsyncLLM``'s output handler, whose cancellation
        ``shutdown()`` only schedules) can leave a ZeroMQ socket open, and
        ZeroMQ's context then blocks the interpreter's exit forever.
        Idempotent. On a borrowed loop (``loop=``) it does nothing: the loop's
        owner closes the engine and the loop.
        """
        if not self._owns_loop or self.loop.is_closed():
            return
        try:
            if hasattr(self.engine, "aclose"):
                self._run(self.engine.aclose())
            elif hasattr(self.engine, "shutdown"):
                self.engine.shutdown()
        finally:
            self._drain()
            self.loop.close()

    def _drain(self) -> None:
        # One pass lets callbacks scheduled from other threads (call_soon_threadsafe
        # cancellations) land before the tasks are gathered.
        self._run(asyncio.sleep(0))
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            self._run(asyncio.gather(*pending, return_exceptions=True))
        self._run(self.loop.shutdown_asyncgens())

    def __enter__(self) -> SyncBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["SyncBridge"]
