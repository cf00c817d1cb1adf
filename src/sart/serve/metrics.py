"""The server's Prometheus metrics, in the ``sart:`` namespace (as vLLM's are in ``vllm:``).

Gauges are read from the scheduler and the engine when ``/metrics`` is
scraped; counters and histograms are updated as each request finishes.
Each server has its own registry, so several servers (tests) can live in
one process.

==========================================  =========  ====================================
name                                        type       what
==========================================  =========  ====================================
sart:num_requests_running                   gauge      prefilled, not finished
sart:num_requests_waiting                   gauge      accepted, waiting for a slot
sart:num_branches_running                   gauge      branches decoding (at most ``B``)
sart:num_branches_waiting                   gauge      branches of prefilled requests
                                                       waiting for a slot
sart:engine_live_branches                   gauge      branches the engine holds (KV)
sart:kv_tokens                              gauge      KV tokens the engine holds
sart:requests_total{status}                 counter    finished: completed, failed,
                                                       cancelled (client disconnected),
                                                       timeout (past its ``timeout``),
                                                       shutdown (cut by a shutdown)
sart:requests_rejected_total{code}          counter    refused before running: 400, 401,
                                                       404, 413, 429
sart:branches_finished_total{finish_reason} counter    completed branches: stop, length
sart:branches_pruned_total                  counter    pruned by the PRM
sart:branches_stopped_total                 counter    stopped early (request had enough)
sart:branches_failed_total{cause}           counter    error, cancelled, timeout,
                                                       shutdown
sart:prompt_tokens_total                    counter    prompt tokens prefilled
sart:generation_tokens_total                counter    tokens of every branch
sart:tokens_saved_total                     counter    estimate, see ``SavedTokens``
sart:prm_items_total                        counter    branches scored by the PRM
sart:prm_latency_seconds                    histogram  one PRM call
sart:e2e_request_latency_seconds            histogram  arrival to answer (completed)
sart:request_queue_time_seconds             histogram  arrival to prefill (every
                                                       request prefilled)
sart:request_inference_time_seconds         histogram  prefill to answer (completed)
==========================================  =========  ====================================
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sart.results import RequestResult
from sart.types import BranchStatus, RequestStatus

LATENCY_BUCKETS = (
    *(0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0),
    *(40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
PRM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SavedTokens:
    """Estimates the tokens a cut branch (pruned or stopped) would still have made.

    Nobody can know how long a branch that was cut would have run. The
    estimate is the mean residual length of the *completed* branches seen
    lately (a window of ``window``): for a branch cut after ``k`` tokens,
    the mean of ``L - k`` over completed lengths ``L > k``, capped at the
    request's ``max_tokens``; 0 if no completed branch ran longer. Completed
    branches under early stopping are the short ones, so this underestimates
    (what is reported is rather a lower bound); it is unbiased only for
    traffic that runs every branch to its end (Vanilla, Self-Consistency).

    The baseline is the request's first branches (those started from the
    prompt) run to their end. A method that forks (rebase, particle,
    sart-rebranch) replaces cut branches by forks, whose tokens that baseline
    would not have generated: they are taken off, and a cut fork saves
    nothing of the baseline. A request whose forks cost more than its cuts
    saved counts 0 (a counter does not go down).
    """

    def __init__(self, window: int = 2048) -> None:
        self._recent: collections.deque[int] = collections.deque(maxlen=window)

    def add(self, result: RequestResult, max_tokens: int) -> int:
        """Record ``result``'s completed lengths; return the tokens its cut branches saved."""
        for branch in result.branches:
            if branch.status.is_completed:
                self._recent.append(branch.num_tokens)
        cut = [
            b.num_tokens
            for b in result.branches
            if b.parent is None and b.status in (BranchStatus.PRUNED, BranchStatus.STOPPED)
        ]
        if not cut or not self._recent:
            return 0
        lengths = sorted(min(length, max_tokens) for length in self._recent)
        saved = 0.0
        for k in cut:
            longer = lengths[bisect.bisect_right(lengths, k) :]
            if longer:
                saved += sum(longer) / len(longer) - k
        forked = sum(b.generated for b in result.branches if b.parent is not None)
        return max(0, round(saved - forked))


class _Gauges(Collector):
    """Gauges read at scrape time from ``read()``: ``{name: (help, value)}``."""

    def __init__(self, read: Callable[[], dict[str, tuple[str, float]]]) -> None:
        self._read = read

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The gauges' names, without reading them (the registry checks names with it)."""
        for name, doc in GAUGE_HELP.items():
            yield GaugeMetricFamily(name, doc)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, (doc, value) in self._read().items():
            yield GaugeMetricFamily(name, doc, value=value)


class ServeMetrics:
    """The server's metrics on a registry of its own (see the module docstring)."""

    def __init__(self, gauges: Callable[[], dict[str, tuple[str, float]]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Gauges(gauges))
        counter, histogram = self._counter, self._histogram
        self.requests = counter("sart:requests", "Requests finished, by status.", "status")
        self.rejected = counter(
            "sart:requests_rejected", "Requests refused before running, by HTTP status.", "code"
        )
        self.finished = counter(
            "sart:branches_finished",
            "Completed branches, by finish reason (stop: EOS or a stop string; length: "
            "max_tokens).",
            "finish_reason",
        )
        self.pruned = counter("sart:branches_pruned", "Branches pruned.")
        self.stopped = counter(
            "sart:branches_stopped", "Branches stopped because their request had enough completed."
        )
        self.failed = counter(
            "sart:branches_failed",
            "Branches failed, by cause (error; cancelled: the client disconnected; "
            "timeout: their request ran past its timeout; shutdown: the server stopped).",
            "cause",
        )
        self.prompt_tokens = counter("sart:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter(
            "sart:generation_tokens", "Tokens generated, by every branch."
        )
        self.tokens_saved = counter(
            "sart:tokens_saved",
            "Estimated tokens not generated thanks to pruning and early stopping, against "
            "running every first branch to its end, less the tokens forks generated (a "
            "conservative estimate).",
        )
        self.prm_items = counter("sart:prm_items", "Branches scored by the PRM.")
        self.prm_latency = histogram(
            "sart:prm_latency_seconds", "Duration of one PRM call.", PRM_BUCKETS
        )
        # Latencies of completed requests only: a cancelled or timed-out request's
        # time says when its client gave up, not how fast the server answers (those
        # are counted in sart:requests_total by status).
        self.e2e = histogram(
            "sart:e2e_request_latency_seconds", "From arrival to answer, of completed requests."
        )
        self.queue = histogram(
            "sart:request_queue_time_seconds",
            "From arrival to prefill, of every request that was prefilled.",
        )
        self.inference = histogram(
            "sart:request_inference_time_seconds", "From prefill to answer, of completed requests."
        )
        self._saved = SavedTokens()

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        """A counter on this server's registry, with ``labels``."""
        return Counter(name, doc, labels, registry=self.registry)

    def _histogram(
        self, name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS
    ) -> Histogram:
        """A histogram on this server's registry (latency buckets unless told)."""
        return Histogram(name, doc, buckets=buckets, registry=self.registry)

    def observe_prm(self, seconds: float, items: int) -> None:
        self.prm_latency.observe(seconds)
        self.prm_items.inc(items)

    def observe(
        self, result: RequestResult, *, cancelled: bool, max_tokens: int, shutdown: bool = False
    ) -> None:
        """Count one finished request (``cancelled``: its client left; ``shutdown``: the
        server's shutdown cancelled it, which is not the client's doing)."""
        if shutdown:
            status = "shutdown"
        elif cancelled:
            status = "cancelled"
        elif result.status is RequestStatus.CANCELLED:  # not by its client: by its timeout
            status = "timeout"
        else:
            status = "completed" if result.status is RequestStatus.COMPLETED else "failed"
        self.requests.labels(status).inc()
        for branch in result.branches:
            if branch.status is BranchStatus.FINISHED:
                self.finished.labels("stop").inc()
            elif branch.status is BranchStatus.TRUNCATED:
                self.finished.labels("length").inc()
            elif branch.status is BranchStatus.PRUNED:
                self.pruned.inc()
            elif branch.status is BranchStatus.STOPPED:
                self.stopped.inc()
            elif branch.status is BranchStatus.FAILED:
                cause = status if status in ("cancelled", "timeout", "shutdown") else "error"
                self.failed.labels(cause).inc()
        self.generation_tokens.inc(result.generated_tokens)
        self.tokens_saved.inc(self._saved.add(result, max_tokens))
        timings = result.timings
        if timings.scheduled is not None:
            self.queue.observe(timings.queueing)
            if result.ok:
                self.inference.observe(timings.inference)
        if result.ok:
            self.e2e.observe(timings.end_to_end)

    def reject(self, code: int) -> None:
        self.rejected.labels(str(code)).inc()


def gauge_table(values: dict[str, float]) -> dict[str, tuple[str, float]]:
    """``{name: value}`` with each gauge's help text."""
    return {name: (GAUGE_HELP[name], value) for name, value in values.items()}


GAUGE_HELP: dict[str, str] = {
    "sart:num_requests_running": "Requests prefilled and not finished.",
    "sart:num_requests_waiting": "Requests accepted and waiting for a slot.",
    "sart:num_branches_running": "Branches decoding (at most the branch budget B).",
    "sart:num_branches_waiting": "Branches of prefilled requests waiting for a slot.",
    "sart:engine_live_branches": "Branches the engine holds (their KV cache).",
    "sart:kv_tokens": "KV-cache tokens the engine holds.",
}
