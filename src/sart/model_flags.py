"""The flags that say what to load, and the ``LoadSpec`` they make.

``add_model_flags`` adds the PRM's and the engine's options (``--prm``, ``--prm-kind``,
``--device``, ``--cuda-graphs``, ``--prm-device``, ``--prm-in-process``, ``--prm-replicas``,
``--prm-url``, ``--prm-api-key``, ``--trust-remote-code``, ``--vllm-arg``, ``--sglang-arg``) to
``sart bench``, ``sart eval`` and ``sart serve`` alike; ``load_spec`` turns them, with
``--engine`` and ``--model``, into a ``sart.launch.LoadSpec``, which refuses a flag the
engine (or PRM) would ignore, in the flag's own words.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from sart.errors import ConfigError
from sart.flags import FLAGS, check_name, default_of
from sart.launch import (
    REMOTE_PRM,
    Gateway,
    IgnoredSetting,
    LoadSpec,
    check_path,
    resolve_models,
)
from sart.registry import loadable_prms

PRM_KEY_ENV = "SART_PRM_API_KEY"
"""The PRM servers' API key when ``--prm-api-key`` is not given."""

MODEL_DESTS = (
    "prm",
    "prm_kind",
    "device",
    "cuda_graphs",
    "prm_device",
    "prm_in_process",
    "prm_replicas",
    "prm_url",
    "prm_api_key",
    "prm_timeout",
    "trust_remote_code",
    "vllm_arg",
    "sglang_arg",
)
"""The ``dest`` of each flag ``add_model_flags`` adds."""


def add_model_flags(p: Any, scope: str = "") -> None:
    """The flags of the PRM and of the engines' own options; ``scope`` prefixes the
    help texts of flags that only some runs read (e.g. "hf, vllm: ")."""
    p.add_argument(
        "--prm",
        default=None,
        help=f"{scope}the PRM's directory or hub id, or 'testbed' / 'testbed-long' (a shipped "
        "testbed's PRM; the default under that --model)",
    )
    p.add_argument(
        "--prm-kind",
        default=None,
        help=f"{scope}Qwen2.5-Math-PRM style on transformers (qwen, the default), "
        "Math-Shepherd style (shepherd), Qwen2.5-Math-PRM served by vLLM with STEP pooling, "
        "re-encoding each branch at every check (vllm-qwen), or served by vLLM from its prefix "
        "cache, each check computing only the new tokens (vllm-cached), or on vllm serve "
        "PRM servers (remote: what --prm-url implies)",
    )
    p.add_argument("--device", default=None, help="hf: the policy's torch device (default cpu)")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="hf on a CUDA --device: decode over buffers sart owns, each batch-size bucket's "
        "forward captured once as a CUDA graph and replayed (off by default until measured "
        "faster: docs/how-to/gpu.md)",
    )
    p.add_argument(
        "--prm-device",
        default=None,
        help="transformers PRMs (qwen, shepherd): their torch device (default --device, else cpu)",
    )
    p.add_argument(
        "--prm-in-process",
        action="store_true",
        help="transformers PRMs: run in this process, on a worker thread, instead of in a "
        "process of their own (the default: threads of one process share the interpreter "
        "lock, so on CPUs a PRM thread barely runs beside decoding)",
    )
    p.add_argument(
        "--prm-replicas",
        type=int,
        default=None,
        metavar="R",
        help="copies of the PRM scoring checks side by side, R checks in flight (default "
        f"{default_of(LoadSpec, 'prm_replicas')}): "
        "transformers PRMs in R processes of their own, a request's checks always on one; "
        "sart bench --engine sim: R simulated PRM GPUs per engine replica",
    )
    p.add_argument(
        "--prm-url",
        nargs="+",
        default=None,
        metavar="URL",
        help="score on these PRM servers (vllm serve of the PRM loaded as sart's LAST-pooled "
        "architecture, see docs/how-to/custom-prm.md) instead of a PRM in this process; "
        "a request's checks always go to one server. Implies --prm-kind remote; --prm "
        "then names the PRM's tokenizer",
    )
    p.add_argument(
        "--prm-api-key",
        default=None,
        help=f"--prm-url: the servers' API key (default ${PRM_KEY_ENV} if set)",
    )
    p.add_argument(
        "--prm-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="--prm-url: how long a server may take to answer a check before the check "
        f"fails (default {default_of(LoadSpec, 'prm_timeout'):g})",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help=f"{scope}allow the model and the PRM to run modelling code their checkpoints "
        "ship (needed by e.g. Qwen2.5-Math-PRM-7B; off by default, as in transformers and "
        "vLLM: that code runs with your permissions)",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm, vllm-async: an EngineArgs field for the policy model, e.g. "
        "tensor_parallel_size=2, dtype=bfloat16, enforce_eager=true (repeatable; VALUE is "
        "parsed as JSON when it can be). max_num_seqs defaults to --batch-size. Without a "
        "GPU (vLLM-CPU), vllm's engine core runs in sart's process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0, distributed_executor_backend=uni) unless you "
        "set either, with a KV cache of half the free memory, at most 4 GiB, unless you give "
        "gpu_memory_utilization, kv_cache_memory_bytes or VLLM_CPU_KVCACHE_SPACE",
    )
    p.add_argument(
        "--sglang-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="sglang: a ServerArgs field, e.g. tp_size=2, attention_backend=torch_native "
        "(repeatable; JSON values). max_running_requests defaults to --batch-size",
    )


def key_values(pairs: list[str], flag: str) -> dict[str, Any]:
    """``["tensor_parallel_size=2", "dtype=bfloat16"]`` -> keyword arguments (``flag``
    names the option in errors). A value is parsed as JSON when it can be (numbers,
    ``true``, lists), else kept as a string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag}={pair!r} must be KEY=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        # vLLM's and SGLang's command lines spell fields with dashes, their classes
        # with underscores: either is taken.
        out[key.strip().replace("-", "_")] = value
    return out


def load_spec(
    args: argparse.Namespace,
    *,
    batch_size: int,
    chat: bool = False,
    gateway: Gateway | None = None,
) -> LoadSpec:
    """What ``args`` say to load (``--model testbed`` resolved; a local path that does
    not exist, or a flag the engine or PRM would ignore, refused)."""
    engine = args.engine
    check_name("--prm-kind", args.prm_kind, loadable_prms())
    local = engine != "openai"
    check_path("model", args.model if local else None)
    check_path("prm", args.prm)
    if args.prm_url and not args.prm:
        raise ConfigError(
            "--prm-url needs --prm: the PRM's tokenizer (its directory or hub id), which "
            "encodes each check as the servers' model reads it"
        )
    if args.prm_url and args.prm_kind not in (None, REMOTE_PRM):
        raise ConfigError(
            f"--prm-url scores on PRM servers (--prm-kind {REMOTE_PRM}, which it implies); "
            f"--prm-kind {args.prm_kind} loads a PRM here: give one or the other"
        )
    if args.prm_kind == REMOTE_PRM and not args.prm_url:
        raise ConfigError(f"--prm-kind {REMOTE_PRM} needs --prm-url: the PRM servers to score on")
    prm_kind = args.prm_kind or (REMOTE_PRM if args.prm_url else "qwen")
    model, prm, prm_options = resolve_models(args.model, args.prm, prm_kind, local=local)
    try:
        return _spec(args, engine, model, prm, prm_kind, prm_options, batch_size, chat, gateway)
    except IgnoredSetting as exc:
        flag = FLAGS.get(exc.field, exc.field)
        if exc.chosen is None:
            raise ConfigError(f"{flag} has no effect without a PRM (--prm)") from None
        by = "--engine" if exc.kind == "engine" else "--prm-kind"
        raise ConfigError(
            f"{flag} has no effect with {by} {exc.chosen} (it is for {by} "
            f"{' or '.join(exc.readers)})"
        ) from None


def _given(value: Any, field: str) -> Any:
    """A flag's value, or ``LoadSpec``'s default for ``field`` where it was left out."""
    return default_of(LoadSpec, field) if value is None else value


def _spec(
    args: argparse.Namespace,
    engine: str,
    model: str,
    prm: str | None,
    prm_kind: str,
    prm_options: dict[str, Any],
    batch_size: int,
    chat: bool,
    gateway: Gateway | None,
) -> LoadSpec:
    return LoadSpec(
        engine=engine,
        model=model,
        prm=prm,
        prm_kind=prm_kind,
        prm_options=prm_options,
        device=args.device,
        cuda_graphs=args.cuda_graphs,
        prm_device=args.prm_device,
        prm_in_process=args.prm_in_process,
        prm_replicas=_given(args.prm_replicas, "prm_replicas"),
        prm_urls=tuple(args.prm_url or ()),
        prm_api_key=(args.prm_api_key or os.environ.get(PRM_KEY_ENV) or None)
        if args.prm_url
        else args.prm_api_key,
        prm_timeout=_given(args.prm_timeout, "prm_timeout"),
        trust_remote_code=args.trust_remote_code,
        vllm_args=key_values(args.vllm_arg, "--vllm-arg"),
        sglang_args=key_values(args.sglang_arg, "--sglang-arg"),
        batch_size=batch_size,
        chat=chat,
        gateway=gateway,
    )


__all__ = ["MODEL_DESTS", "PRM_KEY_ENV", "add_model_flags", "key_values", "load_spec"]
