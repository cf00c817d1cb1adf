"""``RemotePRM``: the PRM on one or more ``vllm serve`` servers, scored over HTTP.

At the scale sart is deployed at, one PRM cannot read tokens as fast as a
tensor-parallel policy generates them; the PRM side is then a pool of servers,
each ``vllm serve`` of the PRM checkpoint loaded as sart's ``LAST``-pooled
architecture, so that each check is served from that server's prefix cache
(``sart.prm.vllm_cached``; the same network and weights as Qwen2.5-Math-PRM)::

    pip install -e '.[vllm]'          # in the PRM servers' environment too: the
                                      # entry point registers the architecture
    vllm serve Qwen/Qwen2.5-Math-PRM-7B --runner pooling --trust-remote-code \\
        --hf-overrides '{"architectures": ["SartLastStepQwen2PRM"]}' --port 8100

The wire format is vLLM's ``/classify`` endpoint: ``{"input": [[token ids], ...],
"use_activation": false}`` (token ids: the client encodes with the PRM's own
tokenizer, ``sart.prm.formats.QwenFormat``, exactly as the in-process PRMs do),
answered with ``{"data": [{"index": i, "probs": [logit_0, logit_1]}, ...]}``;
the reward is the softmax's column 1. Each input ends at a branch's latest step
separator, so the reward is that step's; the client keeps each branch's rated
steps and aggregates them as ``VLLMCachedPRM`` does (same options, same
meaning of ``min``/``prod``/``mean``).

Placement. A request's items always go to the same server (its branches share
the question's prefix, and a branch's checks hit the blocks its previous check
left): a request is placed, at its first check, on the server with the fewest
requests placed, and stays there until ``release``. One ``score`` call sends one
HTTP request per server involved, side by side. ``workers`` is the number of
servers: the driver keeps that many checks in flight.

Failures. A server that answers with an error, an unreadable body or not within
``timeout`` seconds (``connect_timeout`` to connect) fails the items it held: a
``PRMError`` names their requests, and the driver fails those requests and
carries on with the others (scoring them again: cheap, from the caches). The
server is then left out of new placements for ``cooldown`` seconds, and its
requests are placed again at their next check. ``cancel`` cuts the checks in
flight short (each fails at once, its connection shut down as a client that went
away): ``sart serve`` does so as it stops, so that a hung server does not hold the
process for ``timeout`` seconds.
``api_key`` is sent as ``Authorization: Bearer``. Needs ``httpx``
(``pip install -e '.[remote]'``) and a tokenizer (transformers, for
``from_pretrained``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import socket
import threading
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

from sart.errors import ConfigError, PRMError, config_check, needs_extra
from sart.load_spec import PRM_TIMEOUT
from sart.prm.aggregate import aggregate as aggregate_rewards
from sart.prm.base import ScoreItem
from sart.prm.formats import QwenFormat
from sart.prm.last_step import StepMemory, last_step_jobs, two_way_reward
from sart.prm.options import VLLMQwenOptions, build_options
from sart.prm.placement import Placement, fan_out

with needs_extra("the remote PRM", "remote"):
    import httpx

__all__ = ["RemotePRM"]

DEFAULT_MAX_LENGTH = 4096


class RemotePRM:
    """Qwen2.5-Math-PRM's last-step reward from ``vllm serve`` servers at ``urls``; see
    the module docstring. ``tokenizer`` is the PRM's tokenizer (an object, or a
    directory / hub id for ``AutoTokenizer``); ``options`` are ``VLLMQwenPRM``'s
    (``max_length`` defaults to 4096, ``window_stride`` to ``max_length // 4``)."""

    Options: ClassVar[type[VLLMQwenOptions]] = VLLMQwenOptions

    def __init__(
        self,
        urls: Sequence[str],
        tokenizer: Any,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = PRM_TIMEOUT,
        connect_timeout: float = 5.0,
        cooldown: float = 30.0,
        trust_remote_code: bool = False,
        transport: Any = None,
        **options: Any,
    ) -> None:
        urls = [str(u).rstrip("/") for u in urls]
        config_check(bool(urls), "urls", urls, "at least one server URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"urls={url!r} must start with http:// or https://")
        config_check(timeout > 0, "timeout", timeout, "> 0")
        config_check(connect_timeout > 0, "connect_timeout", connect_timeout, "> 0")
        config_check(cooldown >= 0, "cooldown", cooldown, ">= 0")
        if options.get("max_length") is None:
            options["max_length"] = DEFAULT_MAX_LENGTH
        if options.get("window_stride") is None:
            options["window_stride"] = max(1, options["max_length"] // 4)
        self.options = build_options(self.Options, type(self).__name__, options)
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                tokenizer, trust_remote_code=trust_remote_code
            )
        if tokenizer is None:
            raise ConfigError("tokenizer=None: RemotePRM encodes with the PRM's tokenizer")
        self.urls = urls
        self.model = model
        self.limit = self.options.limit
        self.aggregate = self.options.aggregate
        self.format = QwenFormat(tokenizer, self.options, self.limit, owner=type(self).__name__)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            transport=transport,
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(len(urls), "sart-remote-prm")
        self._lock = threading.Lock()
        self.placement = Placement(len(urls), cooldown=cooldown)
        """Which server scores each request (``sart.prm.placement``)."""
        self._memory = StepMemory()
        self.tokens_processed = 0
        """Tokens sent to the servers."""
        self.tokens_cached = 0
        """Of those, the servers' prefix caches held, from their ``usage`` where they
        report it. vLLM's ``/pooling`` (0.32) does not: there it stays 0 and the
        servers' own ``vllm:prefix_cache_hits`` metric tells."""
        self.requests_sent = [0] * len(urls)
        """HTTP requests sent to each server."""
        # Every connection's network stream (httpcore's, seen through the "trace"
        # request extension), so that cancel() can shut its socket down: closing the
        # client would not wake a thread blocked reading it.
        self._streams: weakref.WeakSet[Any] = weakref.WeakSet()
        self._cancels = 0  # how many times cancel() was called

    @property
    def workers(self) -> int:
        """Calls taken side by side: one per server (the driver keeps that many checks
        in flight). Safe to call from several threads."""
        return len(self.urls)

    @property
    def tokenizer(self) -> Any:
        return self.format.tokenizer

    @property
    def tokens_computed(self) -> int:
        return self.tokens_processed - self.tokens_cached

    # ------------------------------------------------------------------ protocol

    def score(self, items: Sequence[ScoreItem]) -> list[float]:
        """One reward in [0, 1] per item: its rated steps' rewards reduced with
        ``aggregate``. Raises ``PRMError`` naming the requests of the items a failed
        server held (after recording the others' rewards)."""
        return [aggregate_rewards(r, self.aggregate) for r in self.step_rewards(items)]

    def step_rewards(self, items: Sequence[ScoreItem]) -> list[list[float]]:
        """Per item, the rewards of the steps its branch's checks have rated, in order."""
        jobs = last_step_jobs([self.format.encode_item(item) for item in items])
        out = fan_out(
            self.placement,
            self._pool,
            [items[job.position].branch.request_id for job in jobs],
            lambda server, held: self._post(server, [jobs[k].ids for k in held]),
            mark_down=True,
        )
        for server, logits in out.answers.items():
            for k, pair in zip(out.held[server], logits):
                job = jobs[k]
                self._memory.record(items[job.position].branch, job.step, two_way_reward(pair))
        out.raise_failures()
        return self._memory.collect(items)

    def release(self, request_id: str) -> None:
        """Forget the request: its placement and its branches' rated steps."""
        self.placement.release(request_id)
        self._memory.release(request_id)

    def cancel(self) -> None:
        """Cut every check in flight short: each fails now with a ``PRMError`` that
        says it was cancelled, rather than when its server answers or ``timeout``
        passes (its server is left out of placements for the cooldown, as after any
        failure). Checks started afterwards are sent as usual. Safe to call from any
        thread."""
        with self._lock:
            self._cancels += 1
            streams = list(self._streams)
        for stream in streams:
            _shut(stream)

    def close(self) -> None:
        self.cancel()
        self._pool.shutdown(wait=True)
        self._client.close()

    # ------------------------------------------------------------------ internals

    def _post(self, server: int, inputs: list[list[int]]) -> list[list[float]]:
        """One ``/classify`` request: each input's two logits (``PRMError`` on failure)."""
        url = f"{self.urls[server]}/classify"
        body: dict[str, Any] = {"input": inputs, "use_activation": False}
        if self.model is not None:
            body["model"] = self.model
        with self._lock:
            self.requests_sent[server] += 1
            cancels = self._cancels
        trace = functools.partial(self._connected, cancels)
        try:
            response = self._client.post(url, json=body, extensions={"trace": trace})
        except httpx.HTTPError as exc:
            if self._cancels != cancels:
                raise PRMError(f"PRM server {self.urls[server]}: the check was cancelled") from exc
            raise PRMError(f"PRM server {self.urls[server]}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise PRMError(
                f"PRM server {self.urls[server]} answered {response.status_code}: "
                f"{response.text[:200]}"
            )
        try:
            document = response.json()
            data = sorted(document["data"], key=lambda d: d["index"])
            logits = [[float(x) for x in d["probs"]] for d in data]
        except (ValueError, KeyError, TypeError) as exc:
            raise PRMError(f"PRM server {self.urls[server]}: unreadable answer ({exc})") from exc
        if len(logits) != len(inputs):
            raise PRMError(
                f"PRM server {self.urls[server]} answered {len(logits)} results for "
                f"{len(inputs)} inputs"
            )
        widths = sorted({len(pair) for pair in logits} - {2})
        if widths:
            raise PRMError(
                f"PRM server {self.urls[server]} answered {widths[0]} logits for an input; "
                "a PRM needs two each (is it serving the LAST-pooled architecture?)"
            )
        usage = document.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        with self._lock:
            self.tokens_processed += sum(map(len, inputs))
            self.tokens_cached += int(details.get("cached_tokens") or 0)
        return logits

    def _connected(self, cancels: int, event: str, info: dict[str, Any]) -> None:
        """httpcore's trace of a check that began after ``cancels`` cancels: keep each
        connection it opens (TLS wraps the TCP stream in another) for ``cancel``, and
        shut it down at once if a cancel came while it connected."""
        if event not in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            return
        stream = info["return_value"]
        with self._lock:
            self._streams.add(stream)
            cancelled = self._cancels != cancels
        if cancelled:
            _shut(stream)


def _shut(stream: Any) -> None:
    """Shut down a network stream's socket: a thread blocked reading it wakes to the
    end of the stream (a socket closed, or wrapped by TLS since, is left as it is)."""
    sock = stream.get_extra_info("socket")
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError):
        pass
