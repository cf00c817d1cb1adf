"""What to load (``LoadSpec``): the policy on an engine, optionally a PRM, and which of
its fields each engine and PRM kind reads.

A field set where the chosen engine or PRM would ignore it is refused with an
``IgnoredSetting`` (a ``ConfigError`` naming it), so no command silently drops a
flag. ``sart.launch`` builds what a spec describes; ``sart.cpu_layout`` reads one
to lay processes out on CPUs. Pure values: nothing here imports an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from sart import converters
from sart.errors import ConfigError, config_check, int_at_least, number_above
from sart.registry import loadable_engines, loadable_prms

VLLM_PRMS = ("vllm-qwen", "vllm-cached")
"""PRM kinds that run on a vLLM engine."""

TRANSFORMERS_PRMS = ("qwen", "shepherd")
"""PRM kinds that load with transformers, on a torch device, in a process of their own
by default."""
REMOTE_PRM = "remote"
"""The PRM kind that scores on ``vllm serve`` PRM servers (``prm_urls``) over HTTP."""

ENGINE_READS: dict[str, tuple[str, ...]] = {
    "device": ("hf",),
    "cuda_graphs": ("hf",),
    "vllm_args": ("vllm", "vllm-async"),
    "sglang_args": ("sglang",),
    "chat": ("hf", "vllm", "vllm-async", "sglang"),
    "gateway": ("openai",),
}
"""``LoadSpec`` fields only some engines read -> those engines."""
PRM_READS: dict[str, tuple[str, ...]] = {
    "prm_device": TRANSFORMERS_PRMS,
    "prm_in_process": TRANSFORMERS_PRMS,
    "prm_replicas": TRANSFORMERS_PRMS,
    "prm_urls": (REMOTE_PRM,),
    "prm_api_key": (REMOTE_PRM,),
    "prm_timeout": (REMOTE_PRM,),
}
"""``LoadSpec`` fields only some PRM kinds read -> those kinds."""


class IgnoredSetting(ConfigError):
    """A ``LoadSpec`` field set where the chosen engine or PRM would ignore it."""

    def __init__(self, field: str, value: Any, kind: str, chosen: str | None,
                 readers: tuple[str, ...]) -> None:  # fmt: skip
        self.field, self.value, self.kind, self.chosen, self.readers = (
            field,
            value,
            kind,
            chosen,
            readers,
        )
        where = f"with {kind} {chosen!r}" if chosen is not None else "without a PRM (prm=None)"
        only = f" (only {', '.join(readers)} read{'s' if len(readers) == 1 else ''} it)"
        super().__init__(f"{field}={value!r} has no effect {where}{only if readers else ''}")


def _mapping(value: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(value or {})


UPSTREAM_TIMEOUT = 300.0
"""Seconds a gateway's branch stream may go without a byte before it fails: the default of
``Gateway.stream_timeout`` and of ``OpenAIEngine``'s ``timeout`` (``--upstream-timeout``)."""
PRM_TIMEOUT = 60.0
"""Seconds a PRM server may take to answer a check before it fails: the default of
``LoadSpec.prm_timeout`` and of ``RemotePRM``'s ``timeout`` (``--prm-timeout``)."""


@attrs.frozen
class Gateway:
    """``engine="openai"``: sart in front of OpenAI-compatible servers of one model."""

    upstreams: tuple[str, ...] = attrs.field(converter=converters.strs)
    api_key: str | None = None
    tokenizer: str | None = None
    """A tokenizer directory or hub id (chat templates, exact token counts)."""
    affinity: bool = True
    """Every branch of a request on one upstream (its prompt prefilled once)."""
    explicit_abort: bool = False
    """Also POST vLLM's abort endpoint for a pruned branch (not only disconnect)."""
    stream_interval: int = attrs.field(default=1, validator=int_at_least(1))
    """Tokens per streamed chunk asked of the upstreams (``OpenAIEngine``)."""
    stream_timeout: float = attrs.field(default=UPSTREAM_TIMEOUT, validator=number_above(0))
    """Seconds a branch's stream may go without a byte before it fails (``OpenAIEngine``)."""

    def __attrs_post_init__(self) -> None:
        config_check(bool(self.upstreams), "upstreams", self.upstreams, "at least one URL")


@attrs.frozen
class LoadSpec:
    """What to load: the policy on an engine, and optionally a PRM.

    Fields an engine (or PRM kind) does not read must keep their defaults: see
    ``ENGINE_READS`` and ``PRM_READS``."""

    engine: str
    model: str
    """A model directory or hub id (resolved: not ``'testbed'``, see ``resolve_models``);
    the upstreams' model name for ``openai``."""
    prm: str | None = None
    prm_kind: str = "qwen"
    prm_options: dict[str, Any] = attrs.field(factory=dict, converter=_mapping)
    """Keyword arguments of the PRM's constructor (the testbed's calibration)."""
    device: str | None = None
    """``hf``: the policy's torch device (``None``: cpu)."""
    cuda_graphs: bool = False
    """``hf`` on a CUDA device: decode steps replayed as CUDA graphs
    (``HFEngine(cuda_graphs=True)``)."""
    prm_device: str | None = None
    """Transformers PRMs: their torch device (``None``: ``device``, else cpu)."""
    prm_in_process: bool = False
    """Transformers PRMs: load in this process (on its thread) instead of a process of
    their own (``PRMProcess``): threads share the interpreter lock, so on CPUs a PRM
    thread barely runs beside decoding."""
    prm_replicas: int = 1
    """Transformers PRMs: processes hosting a copy of the PRM each, scoring checks side
    by side (``sart.prm.process.PRMPool``; the driver keeps as many in flight)."""
    prm_urls: tuple[str, ...] = attrs.field(default=(), converter=converters.strs)
    """``remote`` (and only it, which needs them): ``vllm serve`` servers of the PRM
    to score on (``sart.prm.remote.RemotePRM``); ``prm`` is then the PRM's tokenizer
    (its directory or hub id)."""
    prm_api_key: str | None = None
    """``prm_urls``: the servers' API key."""
    prm_timeout: float = attrs.field(default=PRM_TIMEOUT, validator=number_above(0))
    """``prm_urls``: seconds a server may take to answer a check before it fails (the
    check's requests fail, the server is left out for a while); a SART request whose
    check hangs waits that long (a server that stops cuts it short: ``RemotePRM.cancel``)."""
    trust_remote_code: bool = False
    vllm_args: dict[str, Any] = attrs.field(factory=dict, converter=_mapping)
    """``vllm``, ``vllm-async``: ``EngineArgs`` fields (``max_num_seqs`` defaults to
    ``batch_size``)."""
    sglang_args: dict[str, Any] = attrs.field(factory=dict, converter=_mapping)
    """``sglang``: ``ServerArgs`` fields (``max_running_requests`` defaults to
    ``batch_size``)."""
    batch_size: int = 16
    """The branch budget ``B``: the engine is sized to run that many branches at once."""
    chat: bool = False
    """Prompts go through the model's chat template."""
    gateway: Gateway | None = None

    def __attrs_post_init__(self) -> None:
        engines, kinds = loadable_engines(), loadable_prms()
        config_check(self.engine in engines, "engine", self.engine, f"one of {engines}")
        config_check(bool(self.model), "model", self.model, "a model name or path")
        config_check(self.batch_size >= 1, "batch_size", self.batch_size, ">= 1")
        config_check(self.prm_kind in kinds, "prm_kind", self.prm_kind, f"one of {kinds}")
        config_check(
            isinstance(self.prm_replicas, int) and self.prm_replicas >= 1,
            "prm_replicas",
            self.prm_replicas,
            "an int >= 1",
        )
        if self.prm_replicas > 1 and self.prm_in_process:
            raise ConfigError(
                f"prm_replicas={self.prm_replicas} needs processes of their own; "
                "prm_in_process=True runs one PRM in this process"
            )
        if (self.engine == "openai") != (self.gateway is not None):
            config_check(False, "gateway", self.gateway, "set exactly when engine='openai'")
        defaults = {f.name: f.default for f in attrs.fields(LoadSpec)}
        for name, readers in ENGINE_READS.items():
            _refuse_unread(self, name, defaults[name], readers, "engine", self.engine)
        if self.cuda_graphs:  # refused before a model is loaded, not after
            where = str(self.device or "cpu")
            rule = "a CUDA device (cuda_graphs is on)"
            config_check(where.startswith("cuda"), "device", where, rule)
        if self.prm is None:
            unread = ("prm_kind", "prm_device", "prm_in_process", "prm_replicas", "prm_urls")
            for name in (*unread, "prm_api_key", "prm_timeout"):
                if getattr(self, name) != _default(defaults[name]):
                    raise IgnoredSetting(name, getattr(self, name), "PRM kind", None, ())
            return
        for name, readers in PRM_READS.items():
            _refuse_unread(self, name, defaults[name], readers, "PRM kind", self.prm_kind)
        if self.prm_kind == REMOTE_PRM and not self.prm_urls:
            config_check(False, "prm_urls", self.prm_urls, f"at least one URL with {REMOTE_PRM!r}")

    @property
    def prm_process(self) -> bool:
        """Whether ``build_prm`` hosts the PRM in a ``PRMProcess`` (or a ``PRMPool``: it
        loads its model there) rather than loading it in this process (vLLM's PRMs are
        engines of their own; remote ones are servers)."""
        return (
            self.prm is not None
            and self.prm_kind in TRANSFORMERS_PRMS
            and not (self.prm_in_process)
        )

    @property
    def resolved_prm_device(self) -> str | None:
        """The transformers PRM's torch device (``None`` for other PRMs)."""
        if self.prm is None or self.prm_kind not in TRANSFORMERS_PRMS:
            return None
        return self.prm_device or self.device or "cpu"

    def describe(self) -> dict[str, Any]:
        """What was loaded, for a results file: accuracies and latencies are not
        comparable across runs without it."""
        return {
            "model": self.model,
            "prm": self.prm,
            "prm_kind": self.prm_kind if self.prm else None,
            "prm_options": self.prm_options,
            "prm_process": self.prm_process,
            # Overlapped checks only overlap if the PRM has its own device (or cores).
            "prm_device": self.resolved_prm_device,
            "prm_replicas": self.prm_replicas if self.prm_process else None,
            "prm_urls": list(self.prm_urls),
        }


def _default(value: Any) -> Any:
    """An attrs field's default value (a ``Factory``'s product)."""
    factory = getattr(value, "factory", None)
    return factory() if callable(factory) and hasattr(value, "takes_self") else value


def _refuse_unread(
    spec: LoadSpec, name: str, default: Any, readers: tuple[str, ...], kind: str, chosen: str
) -> None:
    value = getattr(spec, name)
    if chosen not in readers and value != _default(default):
        raise IgnoredSetting(name, value, kind, chosen, readers)
