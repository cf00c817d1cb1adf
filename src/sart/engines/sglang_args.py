"""SGLang's ``ServerArgs`` fields checked before ``sglang.Engine`` starts.

SGLang takes its settings as keyword arguments and checks most of them in its
scheduler's child process, which on a bad value tells the parent with SIGQUIT
and the parent kills its whole process tree, sart's included. So a key
``ServerArgs`` lacks is refused here naming the closest field (as vLLM's
``EngineArgs`` keys are, ``sart.engines.vllm_common.check_engine_args``), a
value outside a field's ``choices`` naming them, and a key sart sets itself or
that would break its calls is refused saying why. Aliases SGLang's command line
takes (``tensor_parallel_size`` for ``tp_size``) are taken. A JSON value given
for a field SGLang reads as a JSON string (``json_model_override_args``) is
passed as that string.
"""

from __future__ import annotations

import difflib
import inspect
import json
import typing
from collections.abc import Mapping
from typing import Any

from sart.errors import ConfigError

#: Fields sart sets, or that would break what it sends: why each is refused.
REFUSED: dict[str, str] = {
    "model_path": "the model is sart's model (--model, or from_args' model_path)",
    "served_model_name": (
        "sart, not SGLang, answers the API: name the model with sart serve --served-model-name"
    ),
    "custom_sigquit_handler": "sart sets its own, to report a child that fails to start",
}


def checked_server_args(server_args_class: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` as ``ServerArgs`` keywords, checked (module docstring); ``ConfigError``
    naming the first bad one."""
    try:  # a class written with postponed annotations keeps them as strings
        params = inspect.signature(server_args_class, eval_str=True).parameters
    except (NameError, TypeError):
        params = inspect.signature(server_args_class).parameters
    aliases = {
        alias.lstrip("-").replace("-", "_"): name
        for name, param in params.items()
        for alias in (getattr(_arg(param), "aliases", None) or ())
    }
    out: dict[str, Any] = {}
    for key, value in args.items():
        name = key if key in params else aliases.get(key)
        if name is None:
            near = difflib.get_close_matches(key, sorted(params), n=1)
            # A short form (tp for tp_size) is too far from its field for difflib.
            near = near or sorted((p for p in params if p.startswith(f"{key}_")), key=len)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(
                f"sglang_args={key}={value!r}: SGLang's ServerArgs has no field {key!r}{hint}"
            )
        if name in REFUSED:
            raise ConfigError(f"sglang_args={key}={value!r} is not taken: {REFUSED[name]}")
        choices = getattr(_arg(params[name]), "choices", None)
        if choices and value is not None and value not in choices:
            near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(
                f"sglang_args={key}={value!r}: SGLang's {name} must be one of {list(choices)}{hint}"
            )
        if _is_str(params[name].annotation) and not isinstance(value, str):
            value = json.dumps(value)  # a JSON object SGLang reads from a string
        out[name] = value
    return out


def _arg(param: inspect.Parameter) -> Any:
    """The ``Arg`` record SGLang keeps in a field's ``Annotated`` metadata, if any."""
    for meta in getattr(param.annotation, "__metadata__", ()):
        if hasattr(meta, "choices") or hasattr(meta, "aliases"):
            return meta
    return None


def _is_str(annotation: Any) -> bool:
    """Whether a field's type is ``str`` (or ``Optional[str]``), under ``Annotated``."""
    base = typing.get_args(annotation)[0] if hasattr(annotation, "__metadata__") else annotation
    if base is str:
        return True
    options = typing.get_args(base)
    return typing.get_origin(base) is typing.Union and set(options) == {str, type(None)}
