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

# How the loader builds each built-in from a ``LoadSpec`` (``sart.builders``); a name
# without one is built by its class's ``from_spec(spec)``. The simulator and the fake
# engine are built by their callers, not from a model name.
_ENGINE_BUILDERS: dict[str, Any] = {
    "hf": "sart.builders:hf_engine",
    "vllm": "sart.builders:vllm_engine",
    "vllm-async": "sart.builders:vllm_engine",
    "sglang": "sart.builders:sglang_engine",
    "openai": "sart.builders:gateway_engine",
}
_PRM_BUILDERS: dict[str, Any] = {
    "qwen": "sart.builders:transformers_prm",
    "shepherd": "sart.builders:transformers_prm",
    "vllm-qwen": "sart.builders:vllm_prm",
    "vllm-cached": "sart.builders:vllm_prm",
    "remote": "sart.builders:remote_prm",
}
_NOT_LOADABLE = {"engine": ("fake", "sim"), "prm": ("scripted",)}
# Engines whose builder gives an async, streaming engine: only ``sart serve`` (its
# ``AsyncDriver``) runs them; ``sart bench`` and ``sart eval`` step their engine.
_STREAMING: set[str] = {"vllm-async", "openai"}

# Which extra provides a third-party module, for the error message (one table for
# sart; a name here so that tests can swap it).
_EXTRAS = EXTRAS


def register_engine(
    name: str, target: str | type, *, build: Any = None, streaming: bool = False
) -> None:
    """Register an engine class, or its ``"module:Class"`` path, under ``name``.

    Every command can then load it by name (``--engine NAME``, after ``--plugin``
    imports the module that registers it): ``build(spec)`` (a callable or its
    ``"module:function"`` path) builds it from a ``sart.LoadSpec``, by default the
    class's ``from_spec(spec)``. ``streaming``: what it builds is an async engine
    (``sart.AsyncEngine``), which only ``sart serve`` runs."""
    _ENGINES[name] = target
    _ENGINE_BUILDERS.pop(name, None)
    if build is not None:
        _ENGINE_BUILDERS[name] = build
    (_STREAMING.add if streaming else _STREAMING.discard)(name)


def register_prm(name: str, target: str | type, *, build: Any = None) -> None:
    """Register a PRM class, or its ``"module:Class"`` path, under ``name``
    (``--prm-kind NAME``); ``build`` as for ``register_engine``."""
    _PRMS[name] = target
    _PRM_BUILDERS.pop(name, None)
    if build is not None:
        _PRM_BUILDERS[name] = build


def engine_names() -> list[str]:
    return sorted(_ENGINES)


def prm_names() -> list[str]:
    return sorted(_PRMS)


def loadable_engines() -> list[str]:
    """Engines a command can load from a model name (every one but the simulator and
    the fake engine, which their callers build): the names ``--engine`` takes."""
    return sorted(set(_ENGINES) - set(_NOT_LOADABLE["engine"]))


def step_engines() -> list[str]:
    """Loadable engines that step (``sart.Engine``): what ``sart bench`` and ``sart eval``
    drive."""
    return [name for name in loadable_engines() if name not in _STREAMING]


def loadable_prms() -> list[str]:
    """PRM kinds a command can load (every one but the scripted test PRM)."""
    return sorted(set(_PRMS) - set(_NOT_LOADABLE["prm"]))


def engine_builder(name: str) -> Any:
    """What builds engine ``name`` from a ``LoadSpec`` (see ``register_engine``)."""
    return _builder(_ENGINES, _ENGINE_BUILDERS, name, "engine")


def prm_builder(name: str) -> Any:
    """What builds PRM kind ``name`` from a ``LoadSpec`` (see ``register_prm``)."""
    return _builder(_PRMS, _PRM_BUILDERS, name, "prm")


def _builder(table: dict[str, Any], builders: dict[str, Any], name: str, kind: str) -> Any:
    if name in builders:
        build = builders[name]
        if not isinstance(build, str):
            return build
        module_name, _, attr = build.partition(":")
        return getattr(importlib.import_module(module_name), attr)
    cls = _load(table, name, kind)
    build = getattr(cls, "from_spec", None)
    if not callable(build):
        raise UnknownComponentError(
            f"{kind} {name!r} ({getattr(cls, '__qualname__', cls)!r}) cannot be loaded from "
            "a model name: register it with build=..., or give its class a "
            "from_spec(spec) classmethod"
        )
    return build


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
