"""The ``sart serve`` command: build the engine and the PRM, then serve them with uvicorn.

``sart serve`` with no flags serves the shipped testbed (``--model testbed``:
its policy on transformers, its PRM in a process of its own) on
``127.0.0.1:8000``. Models load as every command loads them (``sart.launch``,
the same flags: ``sart.flags``, ``sart.model_flags``); ``--engine`` picks the adapter:

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
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from sart.errors import ConfigError
from sart.flags import (
    add_admission_flag,
    add_equivalence_flag,
    add_plugin_flag,
    add_scoring_flag,
    check_name,
    default_of,
    equivalence_of,
    import_plugins,
    in_flags,
)
from sart.flags import sampling as sampling_flags
from sart.generation_config import AUTO
from sart.launch import (
    TESTBED,
    TESTBED_INTERVAL,
    TESTBED_MAX_TOKENS,
    Gateway,
    LoadSpec,
    check_path,
)
from sart.launch import load as load_models
from sart.methods import method_names
from sart.model_flags import add_model_flags, load_spec
from sart.registry import loadable_engines
from sart.serve.config import Backend, ServeConfig
from sart.serve.http_flags import API_KEY_ENV, add_http_flags
from sart.serve.model_defaults import (
    check_honoured,
    check_named,
    json_object,
    with_model_defaults,
    within,
)
from sart.serve.upstream_check import UPSTREAM_KEY_ENV, check_upstreams, upstream_model
from sart.testbed.specs import LONG, testbed

REAL_TEMPERATURE: float = default_of(ServeConfig, "temperature")
"""Temperature of requests that do not say, for a model other than the testbed."""
MAX_TOKENS: int = default_of(ServeConfig, "max_tokens")
"""Tokens per branch of requests that do not say, for a model other than the testbed."""
LOOP_BOUND = frozenset({"vllm-async"})
"""Engines built on the server's event loop, when it starts."""


def _serve_default(name: str) -> Any:
    return default_of(ServeConfig, name)


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
        default="hf",
        help="the engine (default hf); openai: a gateway in front of --upstream servers",
    )
    add_model_flags(g)
    add_plugin_flag(g)

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
        "--upstream-stream-interval",
        type=int,
        default=None,
        metavar="K",
        help="tokens per streamed chunk asked of vLLM upstreams (its per-request "
        f"stream_interval; default {default_of(Gateway, 'stream_interval')}: every token). "
        "Larger K: less work per token on both "
        "sides, but branches are seen K tokens at a time, so checks and prunes come later: "
        "for vanilla and sc traffic, not for methods that check running branches",
    )
    g.add_argument(
        "--upstream-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a branch's stream may go without a byte before it fails (default "
        f"{default_of(Gateway, 'stream_timeout'):g}): a hung upstream holds its requests "
        "that long. vLLM sends nothing while a request waits in its queue, so keep it above "
        "the longest wait there",
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
    n, max_n = _serve_default("n"), _serve_default("max_n")
    g.add_argument("--n", type=int, default=n, help=f"branches of requests that do not say ({n})")
    g.add_argument(
        "--max-n", type=int, default=max_n, help=f"the most branches per request ({max_n})"
    )
    most = _serve_default("max_logprobs")
    g.add_argument(
        "--max-logprobs", type=int, default=most, help=f"the most top_logprobs per token ({most})"
    )
    g.add_argument(
        "--interval",
        type=int,
        default=None,
        help=f"T, decode steps between checks (default {_serve_default('interval')}; testbed "
        f"{TESTBED_INTERVAL}, "
        f"testbed-long {LONG.interval})",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens per branch of requests that do not say (default {MAX_TOKENS}; testbed "
        f"{TESTBED_MAX_TOKENS}, testbed-long {LONG.max_tokens})",
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
        help=f"top_p of requests that do not say (default {_serve_default('top_p')}; testbed 1.0)",
    )
    g.add_argument(
        "--generation-config",
        default=AUTO,
        metavar="auto|sart|DIR",
        help="defaults of requests that do not set temperature, top_p, top_k, min_p, the "
        "penalties or max_tokens, as vllm serve's: 'auto', the model's generation_config.json "
        "(--tokenizer's under --engine openai); 'sart', sart's own; or a directory holding one "
        "(default auto). --temperature, --top-p and --max-tokens win over it",
    )
    g.add_argument(
        "--override-generation-config",
        type=json_object,
        default=None,
        metavar="JSON",
        help="laid over the generation config, e.g. '{\"temperature\": 0.5}', as vllm serve's",
    )
    add_equivalence_flag(g)

    g = p.add_argument_group("scheduling")
    batch_size = _serve_default("batch_size")
    g.add_argument(
        "--batch-size",
        type=int,
        default=batch_size,
        help=f"branch budget B, over all requests ({batch_size})",
    )
    add_scoring_flag(g)
    add_admission_flag(g)
    g.add_argument(
        "--priority-aging",
        type=float,
        default=_serve_default("aging"),
        metavar="SECONDS",
        help="requests carry 'priority' (lower is more urgent, as vLLM's); a waiting "
        f"request gains one level per SECONDS waited, so none starves "
        f"({_serve_default('aging'):g}; 0: strict)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=_serve_default("max_queue"),
        help="the most requests waiting for a slot; past it, 429 at once "
        f"({_serve_default('max_queue')})",
    )

    add_http_flags(p)
    p.set_defaults(func=run_serve_command)


def serve_config(args: argparse.Namespace, *, has_prm: bool) -> ServeConfig:
    """The ``ServeConfig`` the flags describe (a testbed's defaults under ``--model testbed``
    or ``testbed-long``;
    ``args.model`` resolved, see ``load_spec_of``)."""
    bed = testbed(args.model)
    sampling = sampling_flags(args, MAX_TOKENS, REAL_TEMPERATURE)
    method = args.method or ("sart" if has_prm else "sc")
    if method not in method_names():
        raise ConfigError(f"--method={method!r} must be one of {method_names()}")
    return ServeConfig(
        models=tuple(args.served_model_name or [args.model]),
        root=str(args.model),
        method=method,
        n=args.n,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        interval=args.interval or (bed.interval if bed else _serve_default("interval")),
        # A limit given alone lowers the default to it (16384 past a limit of 4096 was
        # refused as max_tokens > max_tokens_limit).
        max_tokens=within(sampling.max_tokens, None if args.max_tokens else args.max_tokens_limit),
        max_tokens_limit=args.max_tokens_limit or sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        batch_size=args.batch_size,
        scoring=args.scoring,
        admission=args.admission,
        max_queue=args.max_queue,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        keepalive=args.keepalive,
        stream_interval=args.stream_interval,
        shutdown_grace=args.shutdown_grace,
        aging=args.priority_aging or None,
        equivalence=equivalence_of(args.equivalence),
    )


def load_spec_of(args: argparse.Namespace) -> LoadSpec:
    """What to load (the testbed's models under ``--model testbed``, the default);
    resolves ``args.model`` (the gateway asks its upstream for it)."""
    gateway = None
    if args.engine == "openai":
        if not args.upstream:
            raise ConfigError("--engine openai needs --upstream URL [URL ...]")
        check_path("tokenizer", args.tokenizer)
        key = _upstream_key(args)
        args.model = args.model or upstream_model(args.upstream[0], key)
        given = {  # the flags left out take Gateway's defaults
            "stream_interval": args.upstream_stream_interval,
            "stream_timeout": args.upstream_timeout,
        }
        gateway = Gateway(
            tuple(args.upstream),
            api_key=key,
            tokenizer=args.tokenizer,
            affinity=args.placement == "request",
            explicit_abort=args.upstream_abort == "explicit",
            **{name: value for name, value in given.items() if value is not None},
        )
    else:
        for flag, given in (
            ("--upstream", args.upstream),
            ("--tokenizer", args.tokenizer),
            ("--upstream-api-key", args.upstream_api_key),
            ("--upstream-stream-interval", args.upstream_stream_interval),
            ("--upstream-timeout", args.upstream_timeout),
        ):
            if given not in (None, []):
                raise ConfigError(f"{flag} is for --engine openai, not --engine {args.engine}")
    args.model = args.model or TESTBED
    return load_spec(args, batch_size=args.batch_size, gateway=gateway)


def backend_loader(spec: LoadSpec) -> Callable[[], Backend]:
    """What builds the engine and the PRM (``sart.launch.load``: a PRM in its own
    process starts while the engine loads), as the server's ``Backend``."""

    def build() -> Backend:
        loaded = load_models(spec)
        return Backend(loaded.engine, loaded.prm, loaded.close_on_loop)

    return build


def _upstream_key(args: argparse.Namespace) -> str | None:
    return args.upstream_api_key or os.environ.get(UPSTREAM_KEY_ENV) or None


def run_serve_command(args: argparse.Namespace) -> int:
    try:
        import_plugins(args.plugin)
        check_name("--engine", args.engine, loadable_engines())
        spec = load_spec_of(args)
        config = serve_config(args, has_prm=spec.prm is not None)
        check_named(args)
        if spec.gateway is not None:
            check_upstreams(spec.gateway.upstreams, spec.gateway.api_key, spec.model)
    except ConfigError as exc:
        raise in_flags(exc) from None
    return _serve(args, spec, config)


def _serve(args: argparse.Namespace, spec: LoadSpec, config: ServeConfig) -> int:
    import uvicorn  # before loading models: a missing extra is said at once

    from sart.serve import create_app

    load = backend_loader(spec)
    # Models load now, so that a wrong path or a missing extra ends the command with
    # its message; vLLM's AsyncLLM binds to the loop that builds it, so it is built
    # when the server starts, on the server's loop.
    try:
        backend = load if args.engine in LOOP_BOUND else load()
    except ConfigError as exc:  # a model not found, in the words of its flag
        raise in_flags(exc) from None
    try:
        config = with_model_defaults(config, args)
        if not callable(backend):
            check_honoured(config, backend.engine, args.engine)
    except ConfigError as exc:
        if not callable(backend) and backend.close is not None:
            backend.close()
        raise in_flags(exc) from None
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
        f"sart serve: {', '.join(config.models)} on {args.engine} (PRM: {spec.prm or 'none'}); "
        f"default method {config.method}, n={config.n}; B={config.batch_size}; API key {key}",
        flush=True,
    )
    defaults = {"temperature": config.temperature, "top_p": config.top_p, **config.sampling}
    print(
        f"sart serve: requests that do not say sample with {defaults}, max_tokens "
        f"{config.max_tokens} (--generation-config {args.generation_config})",
        flush=True,
    )
    from sart.serve.http_server import DrainingServer, log_config

    server = DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            log_config=log_config(args.log_level),
            access_log=not args.no_access_log,
            # uvicorn's own grace, after the service's drain: by then every handler
            # has answered, and this only bounds sending the answers.
            timeout_graceful_shutdown=5,
        ),
        app,
    )
    # uvicorn (0.29 on) raises the signal that stopped it again once it has shut down,
    # with the handler it found: SIGINT's raises KeyboardInterrupt, SIGTERM's default
    # kills the process (exit 143) after a clean shutdown. A server that shut down
    # cleanly exits 0, whichever of the two stopped it.
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _stopped(signum: int, frame: Any) -> None:
    """SIGTERM once uvicorn has shut down: nothing left to do (see ``_serve``)."""
