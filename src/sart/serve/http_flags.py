"""``sart serve``'s HTTP flags: where it listens, who may ask, how answers stream, how
it stops, what it logs (``add_http_flags``)."""

from __future__ import annotations

import argparse
from typing import Any

from sart.flags import default_of
from sart.serve.config import ServeConfig

DEFAULT_PORT = 8000
API_KEY_ENV = "SART_API_KEY"


def _serve_default(name: str) -> Any:
    return default_of(ServeConfig, name)


def _size(count: int) -> str:
    return f"{count >> 20} MiB" if count % (1 << 20) == 0 else f"{count:,} bytes"


def add_http_flags(p: argparse.ArgumentParser) -> None:
    """The HTTP group of ``sart serve``'s flags."""
    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any)"
    )
    g.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV} "
        "if set, else open); /health and /metrics stay open, as vLLM's",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=_serve_default("max_body_bytes"),
        help=f"largest request body (default {_size(_serve_default('max_body_bytes'))}; "
        "413 past it)",
    )
    g.add_argument(
        "--keepalive",
        type=float,
        default=None,
        metavar="SECONDS",
        help="send an SSE keep-alive comment every SECONDS while a stream is undecided, "
        "for proxies that close idle connections (default: none, as vLLM; vLLM's "
        "'vllm bench serve' client mishandles comments)",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=_serve_default("stream_interval"),
        metavar="TOKENS",
        help="tokens per streamed chunk, after the first token, of a request whose one "
        f"branch is its answer (vanilla), as vLLM's (default "
        f"{_serve_default('stream_interval')}; 1: every token); a stream of several branches "
        "sends the chosen answer in one chunk",
    )
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=_serve_default("shutdown_grace"),
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long requests in flight get to finish; those "
        f"still running then are cancelled and answered 503 "
        f"({_serve_default('shutdown_grace'):g})",
    )
    g.add_argument(
        "--no-access-log",
        action="store_true",
        help="do not log each HTTP request (uvicorn's access log)",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the log level of uvicorn and of sart's own lines (info)",
    )
