"""The flags the commands share, and errors in their words.

``sart bench``, ``sart eval`` and ``sart serve`` take the same flags for the same
things, built here once:

- what to load: ``sart.model_flags`` (``add_model_flags``, ``load_spec``);
- ``add_sampling_flags``: ``--max-tokens``, ``--temperature``, ``--top-p`` ->
  ``sampling`` (the testbed's calibration under ``--model testbed``);
- ``add_plugin_flag``: ``--plugin MODULE`` (a module that registers methods,
  engines or PRMs), imported by ``import_plugins`` before anything is checked;
- ``in_flags``: a ``ConfigError`` about a field, in the words of the flag that set it;
- argparse types for numbers with a range (``positive_number``, ``fraction``), and
  ``cost_model_from_model``, the simulator's former ``--model PRESET``;
- ``default_of``: a config class's default, for a flag's default and its help (a
  default lives in its class; the command line shows it from there).
"""

from __future__ import annotations

import argparse
import enum
import importlib
import math
import sys
from collections.abc import Callable
from typing import Any

import attrs

from sart.errors import ConfigError
from sart.launch import (
    TESTBED_MAX_TOKENS,
    sampling_defaults,
)
from sart.policies.equivalence import Equivalence
from sart.testbed.specs import LONG
from sart.types import SamplingSettings

FLAGS = {
    # What to load (sart.launch.LoadSpec).
    "engine": "--engine",
    "model": "--model",
    "prm": "--prm",
    "prm_kind": "--prm-kind",
    "device": "--device",
    "cuda_graphs": "--cuda-graphs",
    "prm_device": "--prm-device",
    "prm_in_process": "--prm-in-process",
    "prm_urls": "--prm-url",
    "prm_replicas": "--prm-replicas",
    "prm_api_key": "--prm-api-key",
    "prm_timeout": "--prm-timeout",
    "trust_remote_code": "--trust-remote-code",
    "vllm_args": "--vllm-arg",
    "sglang_args": "--sglang-arg",
    "gateway": "--upstream",
    "upstreams": "--upstream",
    "tokenizer": "--tokenizer",
    "stream_interval": "--upstream-stream-interval",
    "stream_timeout": "--upstream-timeout",
    "chat": "--chat",
    "generation_config": "--generation-config",
    "override_generation_config": "--override-generation-config",
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
    "intervals": "--interval",
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
    # sart tune's own.
    "min_accuracy": "--min-accuracy",
    "slack": "--slack",
}
"""Config field -> the flag that sets it, so that errors use the user's words."""


def default_of(cls: type, name: str) -> Any:
    """The default of the attrs class ``cls``'s field ``name``: what a flag that sets it
    defaults to, and what its help says, read from the one place it is set (a literal
    repeated in a flag and its help drifts from the class's own)."""
    default = attrs.fields_dict(cls)[name].default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        raise TypeError(f"{cls.__name__}.{name}'s default is computed: no one value to show")
    return default


def in_flags(exc: ConfigError, renames: dict[str, str] | None = None) -> ConfigError:
    """``exc`` in the words of the command line: "batch_size=0 must be ..." becomes
    "--batch-size 0 must be ..." (messages about anything else are kept). ``renames``
    overrides ``FLAGS`` for one command."""
    table = FLAGS | (renames or {})
    field, sep, rest = str(exc).partition("=")
    return ConfigError(f"{table[field]} {rest}") if sep and field in table else exc


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0 (a rate, a latency objective)."""
    return _number(text, lambda v: v > 0, "a finite number > 0")


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1] (an accuracy, a slack on one)."""
    return _number(text, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def _number(text: str, ok: Callable[[float], bool], rule: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be {rule}")
    return value


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
        help=f"{scope}nucleus sampling mass (default {default_of(SamplingSettings, 'top_p')}; "
        "testbed: 1.0, as calibrated: a cut "
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


def _add_enum_flag(
    p: Any, flag: str, choices: type[enum.Enum], default: enum.Enum, help: str
) -> None:
    p.add_argument(flag, choices=[c.value for c in choices], default=default.value, help=help)


def add_equivalence_flag(p: Any, default: str | None = "exact") -> None:
    """``--equivalence``: how votes and agreement stops group answers (``default``
    ``None`` where a command must tell whether the flag was given)."""
    p.add_argument(
        "--equivalence",
        choices=["exact", "math-verify"],
        default=default,
        help="how votes (sc, rebase, particle) and agreement stops (sart-rebranch) group "
        "answers: exact strings (default), or math-verify: \\frac12, \\dfrac{1}{2} and "
        "0.5 are one answer, for math models (needs the eval extra)",
    )


def equivalence_of(name: str | None) -> Equivalence | None:
    """The grouping ``--equivalence NAME`` asks for (``None``: the methods' own, exact
    strings, also where the flag was not given)."""
    if name in (None, "exact"):
        return None
    from sart.eval.equivalence import named_equivalence  # math-verify's stack: only if asked

    return named_equivalence(name)


def add_scoring_flag(p: Any) -> None:
    """``--scoring``: whether decoding waits for the PRM's checks (``sart.Scoring``)."""
    from sart.types import Scoring

    _add_enum_flag(
        p,
        "--scoring",
        Scoring,
        Scoring.OVERLAPPED,
        "overlapped (default): decoding goes on while the PRM scores, decisions apply "
        "when its rewards arrive; blocking: decoding waits for every PRM check "
        "(Algorithm 1 as written)",
    )


def add_admission_flag(p: Any) -> None:
    """``--admission``: when freed batch slots are refilled (``sart.Admission``)."""
    from sart.types import Admission

    _add_enum_flag(
        p,
        "--admission",
        Admission,
        Admission.CHUNK,
        "chunk (default): freed slots are refilled between decode chunks (Algorithm "
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


def cost_model_from_model(model: str, command: str) -> str:
    """``--model PRESET`` on the simulator, the former spelling of ``--cost-model
    PRESET``: taken for a release with a one-line warning. Any other ``--model``
    (``testbed``, a path, a hub id) is a model for a real engine, and the warning's
    advice would fail at once: refused, saying what to give instead."""
    from sart.engines.costs import PRESETS

    if model not in PRESETS:
        where = (
            "sart tune runs on the simulator"
            if command == "sart tune"
            else f"{command} on the simulator (--engine sim, the default) runs no model"
        )
        raise ConfigError(
            f"--model {model}: {where}; the simulated hardware and model are --cost-model, "
            f"one of {sorted(PRESETS)}"
            + (
                ""
                if command == "sart tune"
                else "; to run the model, add --engine hf (or vllm, sglang)"
            )
        )
    deprecated(f"--model {model}", f"--cost-model {model}")
    return model


def deprecated(old: str, new: str) -> None:
    """A former spelling, taken for a release: one line on stderr saying the new one."""
    print(f"sart: warning: {old} is deprecated; use {new}", file=sys.stderr)


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


__all__ = [
    "FLAGS",
    "add_methods_flag",
    "add_output_flags",
    "add_plugin_flag",
    "add_sampling_flags",
    "check_name",
    "import_plugins",
    "in_flags",
    "sampling",
]
