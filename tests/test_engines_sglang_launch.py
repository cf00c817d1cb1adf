"""``sart.engines.sglang_launch``'s cleanup after a failed start, without SGLang: the
child processes' SIGQUIT (SGLang's way of saying a child failed) sent to this process."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from sart.engines import sglang_launch

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "SIGQUIT") or threading.current_thread() is not threading.main_thread(),
    reason="SIGQUIT handlers are set from the main thread of a POSIX process",
)


def test_a_second_childs_sigquit_during_the_cleanup_is_ignored(monkeypatch) -> None:
    previous = signal.signal(signal.SIGQUIT, sglang_launch._raise_child_failed)
    try:
        sent = []

        def children() -> set[object]:  # another child fails while the first is cleaned up
            os.kill(os.getpid(), signal.SIGQUIT)
            sent.append(True)
            return set()

        monkeypatch.setattr(sglang_launch, "_children", children)
        # Without the fix, _ChildFailed escapes from here, out of the except clause.
        sglang_launch._failed_start(set(), True, signal.SIG_DFL)
        assert sent and signal.getsignal(signal.SIGQUIT) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGQUIT, previous)
