"""The ``sart serve`` command: build the engine and the PRM, then serve them with uvicorn.

``sart serve`` with no flags serves the shipped testbed (``--model testbed``:
its policy on transformers, its PRM in a process of its own) on
``127.0.0.1:8000``. Models load as ``sart bench`` loads them (the same
helpers, the same flags); ``--engine`` picks the adapter:

- ``hf`` (default): transformers, on ``--device``; its calls run on a
  worker thread so that the event loop keeps answering;
- ``vllm``: vLLM's ``LLMEngine`` in this process (the same worker thread);
- ``vllm-async``: vLLM's ``AsyncLLM``, awaited on the server's event loop;
- ``sglang``: ``sglang.Engine`` in this process (``--sglang-arg`` passes its
  ``ServerArgs``); it runs its calls on its own event loop, which the worker
  thread drives (``SGLangEngine.bridge()``);
- ``openai``: the gateway, sart in front of running vLLM or SGLang servers
  (``--upstream URL [URL ...]``, all serving one model): ``OpenAIEngine``
  streams each branch from them, all branches of a request from one upstream
  (``--placement request``, the default), chosen by load. ``--model`` is the
  upstreams' model name (default: the first one the first upstream lists);
  ``--tokenizer`` (default ``--model`` where it is a local directory) gives the
  chat template and exact token counts, else the upstream's ``/tokenize``
  counts and chat requests are refused. The PRM runs here (``--prm``;
  ``--prm testbed`` is the shipped testbed PRM).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sart.bench.command import (
    REAL_TEMPERATURE,
    TESTBED,
    TESTBED_INTERVAL,
    TESTBED_MAX_TOKENS,
    RealSetup,
    _load_engine,
    _load_prm,
    prm_in_child_process,
    vllm_engine_args,
)
from sart.errors import ConfigError
from sart.serve.config import Backend, ServeConfig
from sart.serve.methods import method_names
from sart.types import Scoring

DEFAULT_PORT = 8000
ENGINES = ("hf", "vllm", "vllm-async", "sglang", "openai")
"""Engines ``sart serve`` runs (the simulator and the fake engine are not servers)."""
API_KEY_ENV = "SART_API_KEY"
UPSTREAM_KEY_ENV = "SART_UPSTREAM_API_KEY"
LOOP_BOUND = frozenset({"vllm-async"})
"""Engines built on the server's event loop, when it starts."""


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve SART behind an OpenAI-compatible HTTP API (default: the testbed model)",
        description="Serve a model and a PRM behind OpenAI's /v1/completions and "
        "/v1/chat/completions; each request picks its method (vanilla, sc, sart, ...) with "
        "extra_body. See docs/tutorials/serve.md.",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        help="a model directory or hub id, or 'testbed' (the default: the shipped tiny "
        "reasoning model and its PRM, see docs/testbed.md); --engine openai: the "
        "upstreams' model name (default: the first one the first upstream lists)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients give in 'model' (default: --model as given)",
    )
    g.add_argument(
        "--engine",
        choices=ENGINES,
        default="hf",
        help="the engine (default hf); openai: a gateway in front of --upstream servers",
    )
    g.add_argument(
        "--prm",
        default=None,
        help="the PRM's directory or hub id, or 'testbed' (--model testbed: its own PRM). "
        "Without one only methods that need no rewards run (vanilla, sc)",
    )
    g.add_argument(
        "--prm-kind",
        choices=["qwen", "shepherd", "vllm-qwen"],
        default="qwen",
        help="Qwen2.5-Math-PRM style on transformers (default), Math-Shepherd style, or "
        "Qwen2.5-Math-PRM served by vLLM as a pooling model",
    )
    g.add_argument("--device", default="cpu", help="hf: the model's device (default cpu)")
    g.add_argument("--prm-device", default=None, help="the PRM's torch device (default --device)")
    g.add_argument(
        "--prm-in-process",
        action="store_true",
        help="run a transformers PRM on a thread of this process instead of a process of "
        "its own (the default: on CPUs a PRM thread barely runs beside decoding)",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the model and the PRM to run modelling code their checkpoints ship "
        "(off by default; requests can never load models or code)",
    )
    g.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm, vllm-async: an engine argument (repeatable); max_num_seqs defaults to "
        "--batch-size",
    )
    g.add_argument(
        "--sglang-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="sglang: a ServerArgs field (repeatable), e.g. tp_size=2; "
        "max_running_requests defaults to --batch-size",
    )
    g.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this module at start, e.g. one that calls "
        "sart.serve.register_method (repeatable)",
    )

    g = p.add_argument_group("gateway (--engine openai)")
    g.add_argument(
        "--upstream",
        nargs="+",
        default=[],
        metavar="URL",
        help="OpenAI-compatible servers of one model (vllm serve, SGLang's launch_server), "
        "e.g. http://10.0.0.5:8000",
    )
    g.add_argument(
        "--upstream-api-key",
        default=None,
        help=f"the upstreams' API key (default ${UPSTREAM_KEY_ENV} if set)",
    )
    g.add_argument(
        "--placement",
        choices=["request", "branch"],
        default="request",
        help="request (default): every branch of a request on one upstream, so its prompt "
        "is prefilled once and cached; branch: each branch on the least-loaded upstream",
    )
    g.add_argument(
        "--upstream-abort",
        choices=["disconnect", "explicit"],
        default="disconnect",
        help="how a pruned branch is aborted upstream: disconnect (default: its stream is "
        "closed; vLLM and SGLang abort it) or explicit (also POST vLLM's "
        "/inference/v1/abort_requests, served with --enable-scale-out; for upstreams "
        "behind a proxy that does not pass disconnects on)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer directory or hub id for chat templates and token counts "
        "(default: --model where it is a local directory)",
    )

    g = p.add_argument_group("requests: defaults and limits")
    g.add_argument(
        "--method",
        default=None,
        help="method of requests that name none (default sart; sc without a PRM)",
    )
    g.add_argument("--n", type=int, default=8, help="branches of requests that do not say (8)")
    g.add_argument("--max-n", type=int, default=32, help="the most branches per request (32)")
    g.add_argument(
        "--interval",
        type=int,
        default=None,
        help=f"T, decode steps between checks (default 400; testbed {TESTBED_INTERVAL})",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens per branch of requests that do not say (default 16384; testbed "
        f"{TESTBED_MAX_TOKENS})",
    )
    g.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="the most tokens per branch a request may ask for (default --max-tokens)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"temperature of requests that do not say (default {REAL_TEMPERATURE}; "
        "testbed 1.0, as calibrated)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="top_p of requests that do not say (default 0.95; testbed 1.0)",
    )

    g = p.add_argument_group("scheduling")
    g.add_argument(
        "--batch-size", type=int, default=64, help="branch budget B, over all requests (64)"
    )
    g.add_argument(
        "--scoring",
        choices=[s.value for s in Scoring],
        default=Scoring.OVERLAPPED.value,
        help="overlapped (default): decoding goes on while the PRM scores; blocking: "
        "Algorithm 1 as written",
    )
    g.add_argument(
        "--priority-aging",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="requests carry 'priority' (lower is more urgent, as vLLM's); a waiting "
        "request gains one level per SECONDS waited, so none starves (60; 0: strict)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="the most requests waiting for a slot; past it, 429 at once (1024)",
    )

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
        default=1 << 20,
        help="largest request body (default 1 MiB; 413 past it)",
    )
    g.add_argument(
        "--keepalive",
        type=float,
        default=5.0,
        help="seconds between keep-alive comments of a stream still undecided (5)",
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
        help="uvicorn's log level (info)",
    )
    p.set_defaults(func=run_serve_command)


def serve_config(args: argparse.Namespace, *, has_prm: bool) -> ServeConfig:
    """The ``ServeConfig`` the flags describe (testbed defaults under ``--model testbed``;
    ``args.model`` resolved, see ``_setup``)."""
    testbed = args.model == TESTBED
    max_tokens = args.max_tokens or (TESTBED_MAX_TOKENS if testbed else 16384)
    method = args.method or ("sart" if has_prm else "sc")
    if method not in method_names():
        raise ConfigError(f"--method={method!r} must be one of {method_names()}")
    return ServeConfig(
        models=tuple(args.served_model_name or [args.model]),
        method=method,
        n=args.n,
        max_n=args.max_n,
        interval=args.interval or (TESTBED_INTERVAL if testbed else 400),
        max_tokens=max_tokens,
        max_tokens_limit=args.max_tokens_limit or max_tokens,
        temperature=_first(args.temperature, 1.0 if testbed else REAL_TEMPERATURE),
        top_p=_first(args.top_p, 1.0 if testbed else 0.95),
        batch_size=args.batch_size,
        scoring=args.scoring,
        max_queue=args.max_queue,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        keepalive=args.keepalive,
        aging=args.priority_aging or None,
    )


def _first(value: float | None, default: float) -> float:
    return default if value is None else value


def _setup(args: argparse.Namespace) -> RealSetup:
    """Model and PRM paths (the testbed's, under ``--model testbed``); resolves
    ``args.model`` (the gateway asks its upstream for it)."""
    from sart.types import SamplingSettings

    if args.engine == "openai":
        if not args.upstream:
            raise ConfigError("--engine openai needs --upstream URL [URL ...]")
        args.model = args.model or _upstream_model(args.upstream[0], _upstream_key(args))
    elif args.upstream:
        raise ConfigError(f"--upstream is for --engine openai, not --engine {args.engine}")
    args.model = args.model or TESTBED
    local_testbed = args.model == TESTBED and args.engine != "openai"
    _check_path("--model", None if args.engine == "openai" else args.model)
    _check_path("--prm", args.prm)
    _check_path("--tokenizer", args.tokenizer)
    from sart import testbed as tb

    model = str(tb.POLICY_PATH) if local_testbed else args.model
    prm, options = args.prm, {}
    if prm == TESTBED or (prm is None and local_testbed):
        if args.prm_kind != "qwen":
            raise ConfigError(
                f"--prm-kind {args.prm_kind}: the testbed PRM runs on transformers only "
                "(--prm-kind qwen, the default)"
            )
        prm, options = str(tb.PRM_PATH), tb.prm_kwargs()
    return RealSetup(model, prm, options, [], SamplingSettings())


def backend_loader(args: argparse.Namespace, setup: RealSetup) -> Callable[[], Backend]:
    """What builds the engine and the PRM. A PRM in its own process (``PRMProcess``,
    the default) starts on a thread while the engine loads; one in this process loads
    after the engine.

    Why not both on threads: transformers 5 resolves its names lazily, and two
    threads importing it at once can see it half-built ("cannot import name
    'AutoModelForCausalLM' from 'transformers'": seen here, 1 start in a few, and
    reported against transformers 5 and vLLM). So the PRM's module is imported on
    this thread before its thread starts, which then only starts its process while
    this one builds the engine; and a PRM that would load its model on that thread
    (``--prm-in-process``, ``vllm-qwen``) is not given one."""

    def load() -> Backend:
        from sart.registry import load_prm

        if setup.prm:
            load_prm(args.prm_kind)
        threaded = setup.prm and prm_in_child_process(args)
        with concurrent.futures.ThreadPoolExecutor(1, "sart-prm-load") as pool:
            prm_job = pool.submit(_load_prm, args, setup) if threaded else None
            try:
                engine = _build_engine(args, setup.model)
            except BaseException:
                if prm_job is not None and prm_job.exception() is None:
                    _stop(prm_job.result(), "close")
                raise
            try:
                if prm_job is not None:
                    prm = prm_job.result()
                else:
                    prm = _load_prm(args, setup) if setup.prm else None
            except BaseException:
                closing = _shutdown(engine)
                if closing is not None:
                    closing.close()  # nothing was opened yet: no need to run it
                raise

        def close() -> Any:
            _stop(prm, "close")
            return _shutdown(engine)

        return Backend(engine, prm, close)

    return load


def _shutdown(engine: Any) -> Any:
    """Stop what ``engine`` holds: the gateway's HTTP client (returned, to be awaited on
    the server's loop), vLLM's engine core, or SGLang's through its bridge."""
    if hasattr(engine, "aclose"):
        return engine.aclose()
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    elif hasattr(engine, "close"):
        engine.close()
    return None


def _stop(thing: object, method: str) -> None:
    stop = getattr(thing, method, None)
    if stop is not None:
        stop()


def _check_path(flag: str, value: str | None) -> None:
    """A local path that does not exist is refused now (a hub id is left to the loader)."""
    if (
        value
        and value.startswith(("/", "./", "../", "~"))
        and not Path(value).expanduser().exists()
    ):
        raise ConfigError(f"{flag}={value!r}: no such file or directory")


def _upstream_key(args: argparse.Namespace) -> str | None:
    return args.upstream_api_key or os.environ.get(UPSTREAM_KEY_ENV) or None


def _upstream_model(url: str, api_key: str | None) -> str:
    """The first model ``url``'s ``/v1/models`` lists."""
    import httpx

    from sart.engines.openai import _base

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(_base(url) + "/v1/models", headers=headers, timeout=10)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"--upstream {url}: could not read its model from /v1/models ({exc}); "
            "name it with --model"
        ) from None


def _gateway(args: argparse.Namespace, model: str) -> Any:
    """``OpenAIEngine`` over ``--upstream``, with the tokenizer if one is given or local."""
    from sart.registry import load_engine

    tokenizer = None
    source = args.tokenizer or (model if Path(model).expanduser().is_dir() else None)
    if source is not None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ConfigError(
                f"--tokenizer {source}: loading it needs transformers (pip install "
                f"'sart[hf]'): {exc}"
            ) from None
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    return load_engine("openai")(
        args.upstream,
        model,
        api_key=_upstream_key(args),
        tokenizer=tokenizer,
        affinity=args.placement == "request",
        explicit_abort=args.upstream_abort == "explicit",
    )


def _build_engine(args: argparse.Namespace, model: str) -> Any:
    if args.engine == "openai":
        return _gateway(args, model)
    if args.engine in ("hf", "vllm"):
        return _load_engine(args, model, args.batch_size)
    from sart.registry import load_engine

    if args.engine == "sglang":
        server_args = {
            "max_running_requests": args.batch_size,
            **({"trust_remote_code": True} if args.trust_remote_code else {}),
            **vllm_engine_args(args.sglang_arg, "--sglang-arg"),
        }
        return load_engine("sglang").from_args(model, **server_args).bridge()

    trust = {"trust_remote_code": True} if args.trust_remote_code else {}
    engine_args = {"max_num_seqs": args.batch_size, **trust, **vllm_engine_args(args.vllm_arg)}
    engine = load_engine(args.engine).from_engine_args(model, **engine_args)
    engine.check_batch_size(args.batch_size)
    return engine


def run_serve_command(args: argparse.Namespace) -> int:
    for module in args.plugin:
        importlib.import_module(module)
    setup = _setup(args)
    config = serve_config(args, has_prm=setup.prm is not None)
    import uvicorn  # before loading models: a missing extra is said at once

    from sart.serve import create_app

    load = backend_loader(args, setup)
    # Models load now, so that a wrong path or a missing extra ends the command with
    # its message; vLLM's AsyncLLM binds to the loop that builds it, so it is built
    # when the server starts, on the server's loop.
    backend = load if args.engine in LOOP_BOUND else load()
    try:
        app = create_app(config, backend)
    except BaseException:
        if not callable(backend) and backend.close is not None:
            backend.close()
        raise

    key = "on" if config.api_key else "off"
    if config.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"sart serve: warning: listening on {args.host} without --api-key: anyone who "
            "can reach this address can use the model",
            file=sys.stderr,
        )
    print(
        f"sart serve: {', '.join(config.models)} on {args.engine} (PRM: {setup.prm or 'none'}); "
        f"default method {config.method}, n={config.n}; B={config.batch_size}; API key {key}",
        flush=True,
    )
    # After the grace period, requests still running are cancelled (their branches
    # aborted) as the app shuts down.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=5,
    )
    return 0
