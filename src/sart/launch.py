"""One model loader for every command: building what a ``LoadSpec`` describes.

``sart bench``, ``sart eval``, ``sart serve``, ``python -m sart.serve.bench`` and
``scripts/gpu_check.py`` describe the policy engine and the PRM they need as a
frozen ``LoadSpec`` and build it here (``load``, or ``build_engine`` and
``build_prm``), so that a model loads the same way whichever command asks.

The spec (``sart.load_spec``, re-exported here) knows which of its fields each
engine and each PRM kind reads, and refuses a field set where it would be
ignored. The commands build specs from one set of flags (``sart.model_flags``).

``--model testbed`` (``TESTBED``) stands for the shipped testbed policy, and, unless
another PRM is named, its PRM with the options it is calibrated for
(``resolve_models``).

Nothing here imports torch or an engine until a build function runs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import difflib
import functools
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import attrs

from sart.cpu_layout import cpu_layout
from sart.errors import ConfigError
from sart.load_spec import (  # re-exported: the loader's names, as before
    ENGINE_READS,
    PRM_READS,
    REMOTE_PRM,
    VLLM_PRMS,
    Gateway,
    IgnoredSetting,
    LoadSpec,
)
from sart.types import SamplingSettings

TESTBED = "testbed"
"""``--model testbed``: the shipped (short) testbed policy, PRM and questions
(``sart.testbed``); ``--model testbed-long`` is the long one (``sart.testbed.specs``)."""
TESTBED_MAX_TOKENS = 256
"""Above the longest testbed trace (under 256 tokens with its prompt)."""
TESTBED_INTERVAL = 16
"""``T`` for the testbed: its traces are tens of tokens long, not thousands."""


def resolve_models(
    model: str, prm: str | None, prm_kind: str, *, local: bool = True
) -> tuple[str, str | None, dict[str, Any]]:
    """``(model, prm, prm options)`` with a testbed's name (``testbed``,
    ``testbed-long``) resolved: as the model, the shipped policy and, unless ``prm``
    names another, its PRM with the options it is calibrated for; as the PRM, that
    testbed's PRM. ``local=False``: the model is a remote server's model name, kept
    as given."""
    from sart.testbed.specs import testbed

    bed = testbed(model) if local else None
    prm_bed = testbed(prm) or (bed if prm is None else None)
    for named in (bed, prm_bed):
        if named is not None and not (named.weights / "manifest.json").is_file():
            raise ConfigError(
                f"model={named.name!r}: its weights are not in this install "
                f"({named.weights}); 'sart testbed train --model long --out DIR' makes "
                "them (then give --model DIR/policy --prm DIR/prm)"
            )
    if prm_bed is not None:
        if prm_kind in (*VLLM_PRMS, REMOTE_PRM):
            # Its model class is custom transformers code (auto_map), which vLLM's
            # pooling runner cannot load.
            raise ConfigError(
                f"prm_kind={prm_kind!r}: the testbed PRM runs on transformers only "
                "('qwen', the default; the policy may still run on vLLM)"
            )
        prm, options = str(prm_bed.prm_path), prm_bed.prm_kwargs()
    else:
        options = {}
    return (str(bed.policy_path) if bed is not None else model), prm, options


def sampling_defaults(
    model: str | None,
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    default_max_tokens: int,
    default_temperature: float,
) -> SamplingSettings:
    """Sampling settings from what was given, with the given defaults, or a testbed's
    calibration (its ``max_tokens``, temperature 1.0, top-p 1.0) for a testbed."""
    from sart.testbed.specs import testbed

    bed = testbed(model)
    settings = SamplingSettings(
        temperature=(1.0 if bed else default_temperature) if temperature is None else temperature,
        max_tokens=(bed.max_tokens if bed else default_max_tokens)
        if max_tokens is None
        else max_tokens,
    )
    if top_p is not None:
        return attrs.evolve(settings, top_p=top_p)
    if bed:
        # The calibration samples the full distribution: the testbed's slips are
        # low-probability tokens that a top-p cut would mostly remove.
        return attrs.evolve(settings, top_p=1.0)
    return settings


def check_path(field: str, value: str | None) -> None:
    """A local path that does not exist is refused now; a hub id is left to the loader.

    A relative name counts as local where its directory exists here and holds a name
    close to it (``demo/polcy`` beside ``demo/policy``): looked up on the hub, a typo
    costs half a minute of retries before it fails."""
    if not value:
        return
    path = Path(value).expanduser()
    if path.exists():
        return
    if value.startswith(("/", "./", "../", "~")):
        raise ConfigError(f"{field}={value!r}: no such file or directory")
    parent = path.parent
    if str(parent) != "." and parent.is_dir():
        near = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir()], n=1)
        if near:
            raise ConfigError(
                f"{field}={value!r}: no such file or directory "
                f"(did you mean {str(parent / near[0])!r}?)"
            )


@contextlib.contextmanager
def loading(field: str, value: str) -> Iterator[None]:
    """Around a model's load: a failure to find or fetch it (transformers' and the
    hub's ``OSError``) is a ``ConfigError`` naming the field, not a traceback."""
    try:
        yield
    except OSError as exc:
        where = "" if Path(value).expanduser().exists() else "not a local path, and "
        raise ConfigError(f"{field}={value!r}: {where}it could not be loaded: {exc}") from exc


def build_engine(spec: LoadSpec) -> Any:
    """The policy's engine, sized to ``spec.batch_size`` branches, built by the
    registry's builder for ``spec.engine`` (``sart.builders``, or a plugin's)."""
    from sart.registry import engine_builder

    return engine_builder(spec.engine)(spec)


def build_prm(spec: LoadSpec) -> Any:
    """The PRM (``None`` without one), built by the registry's builder for
    ``spec.prm_kind``: a transformers PRM in a ``PRMProcess`` (``PRMPool`` for
    ``prm_replicas`` > 1) unless ``prm_in_process``."""
    from sart.registry import prm_builder

    if spec.prm is None:
        return None
    build = prm_builder(spec.prm_kind)
    if not spec.prm_process:
        return build(spec)
    from sart.prm.process import PRMPool, PRMProcess

    # The process builds it from the spec there (both pickle: a function and a value).
    factory = functools.partial(build, spec)
    return PRMPool(factory, spec.prm_replicas) if spec.prm_replicas > 1 else PRMProcess(factory)


@attrs.define
class Loaded:
    """A loaded engine and PRM; ``close()`` (or ``with``) stops what they hold."""

    engine: Any
    prm: Any = None

    def close(self) -> None:
        """Stop the PRM (its process) and the engine (vLLM's engine core, SGLang's
        processes, the gateway's HTTP client), from synchronous code."""
        _stop(self.prm, "close")
        if hasattr(self.engine, "aclose"):
            self.engine.close()  # the gateway's own close, with no loop running
        else:
            shutdown_engine(self.engine)

    def close_on_loop(self) -> Awaitable[None] | None:
        """Stop the PRM now; what the engine must await on the loop it runs on (the
        gateway's HTTP client), or ``None``."""
        _stop(self.prm, "close")
        return shutdown_engine(self.engine)

    def __enter__(self) -> Loaded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shutdown_engine(engine: Any) -> Any:
    """Stop what ``engine`` holds: the gateway's HTTP client (a coroutine is returned,
    to be awaited on the loop the engine runs on), vLLM's engine core, or SGLang's
    processes through its bridge."""
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


def load(spec: LoadSpec, *, with_prm: bool = True) -> Loaded:
    """The engine and (with ``with_prm`` and ``spec.prm``) the PRM.

    A PRM in its own process (``PRMProcess``, the default) starts on a thread while
    the engine loads; one in this process loads after the engine, on this thread.

    Why not both on threads: transformers 5 resolves its names lazily, and two threads
    importing it at once can see it half-built ("cannot import name
    'AutoModelForCausalLM' from 'transformers'": seen here, 1 start in a few, and
    reported against transformers 5 and vLLM). So the PRM's module is imported on this
    thread before its thread starts, which then only starts its process while this one
    builds the engine; and a PRM that would load its model on that thread
    (``prm_in_process``, ``vllm-qwen``) is not given one. Whatever fails, nothing
    loaded stays running."""
    from sart.registry import load_prm

    wants_prm = with_prm and spec.prm is not None
    cpu_layout(spec, with_prm=wants_prm)
    if wants_prm:
        load_prm(spec.prm_kind)
    threaded = wants_prm and spec.prm_process
    with concurrent.futures.ThreadPoolExecutor(1, "sart-prm-load") as pool:
        prm_job = pool.submit(build_prm, spec) if threaded else None
        try:
            engine = build_engine(spec)
        except BaseException:
            if prm_job is not None and prm_job.exception() is None:
                _stop(prm_job.result(), "close")
            raise
        try:
            if prm_job is not None:
                prm = prm_job.result()
            else:
                prm = build_prm(spec) if wants_prm else None
        except BaseException:
            Loaded(engine).close()
            raise
    return Loaded(engine, prm)


__all__ = [
    "ENGINE_READS",
    "PRM_READS",
    "REMOTE_PRM",
    "TESTBED",
    "TESTBED_INTERVAL",
    "TESTBED_MAX_TOKENS",
    "Gateway",
    "IgnoredSetting",
    "LoadSpec",
    "Loaded",
    "build_engine",
    "build_prm",
    "check_path",
    "load",
    "loading",
    "resolve_models",
    "sampling_defaults",
    "shutdown_engine",
]
