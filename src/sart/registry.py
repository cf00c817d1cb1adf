"""Lazy registries of engines and PRMs: a name maps to ``"module:attribute"`` (or a class).

Nothing is imported until ``load_engine``/``load_prm`` is called, so optional
backends (torch, vLLM, SGLang) cost nothing until used. Users register their
own with ``register_engine("mine", "my_pkg.engine:MyEngine")`` or by passing
the class itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, TypeVar

from sart.errors import EXTRAS, MissingDependencyError, UnknownComponentError, install_hint

T = TypeVar("T")

# Built-ins: every name here loads an adapter that exists and is tested (the API
# reference must name each one: tests/test_docs.py).
_ENGINES: dict[str, Any] = {
    "fake": "sart.engines.fake:FakeEngine",
    "sim": "sart.engines.sim:SimEngine",
    "hf": "sart.engines.hf:HFEngine",
    "vllm": "sart.engines.vllm:VLLMEngine",
    "openai": "sart.engines.openai:OpenAIEngine",
    "vllm-async": "sart.engines.vllm_async:VLLMAsyncEngine",
    "sglang": "sart.engines.sglang:SGLangEngine",
}
_PRMS: dict[str, Any] = {
    "scripted": "sart.prm.scripted:ScriptedPRM",
    "qwen": "sart.prm.hf:QwenMathPRM",
    "shepherd": "sart.prm.hf:StepTagPRM",
    "vllm-qwen": "sart.prm.vllm:VLLMQwenPRM",
    "vllm-cached": "sart.prm.vllm_cached:VLLMCachedPRM",
    "remote": "sart.prm.remote:RemotePRM",
}

# Which extra provides a third-party module, for the error message (one table for
# sart; a name here so that tests can swap it).
_EXTRAS = EXTRAS


def register_engine(name: str, target: str | type) -> None:
    """Register an engine class, or its ``"module:Class"`` path, under ``name``."""
    _ENGINES[name] = target


def register_prm(name: str, target: str | type) -> None:
    """Register a PRM class, or its ``"module:Class"`` path, under ``name``."""
    _PRMS[name] = target


def engine_names() -> list[str]:
    return sorted(_ENGINES)


def prm_names() -> list[str]:
    return sorted(_PRMS)


def load_engine(name: str) -> Any:
    """The engine class registered as ``name`` (imported now)."""
    return _load(_ENGINES, name, "engine")


def load_prm(name: str) -> Any:
    """The PRM class registered as ``name`` (imported now)."""
    return _load(_PRMS, name, "prm")


def preset(table: Mapping[str, T], name: str, kind: str) -> T:
    """``table[name]``, or ``UnknownComponentError`` naming ``kind`` and the choices."""
    try:
        return table[name]
    except KeyError:
        raise UnknownComponentError(f"{kind} {name!r} must be one of {sorted(table)}") from None


def _load(table: dict[str, Any], name: str, kind: str) -> Any:
    try:
        target = table[name]
    except KeyError:
        raise UnknownComponentError(
            f"{kind}={name!r} must be one of {sorted(table)} (or register your own)"
        ) from None
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        extra = _EXTRAS.get(missing)
        hint = f"; install it with: {install_hint(extra)}" if extra else ""
        raise MissingDependencyError(f"{kind} {name!r} needs the module {missing!r}{hint}") from exc
    return getattr(module, attr)
