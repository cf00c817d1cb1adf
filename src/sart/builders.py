"""How each built-in engine and PRM is built from a ``LoadSpec``: the registry's builders.

``sart.registry`` maps a name to its class and, for the built-ins, to one of these
functions; ``sart.launch.build_engine`` / ``build_prm`` call the builder the registry
names, so the loader has no list of engines of its own. An engine or PRM registered
by a plugin without a builder is built by its class's ``from_spec(spec)``.

Each builder imports its adapter (and so torch or an engine) only when it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sart.cpu_layout import vllm_layout
from sart.devices import check_device
from sart.engines.sglang_args import REFUSED
from sart.errors import ConfigError, install_hint
from sart.launch import loading
from sart.load_spec import LoadSpec
from sart.registry import load_engine, load_prm


def _options(spec: LoadSpec) -> dict[str, Any]:
    """Keyword arguments every model-loading engine takes from the spec."""
    options: dict[str, Any] = {"trust_remote_code": True} if spec.trust_remote_code else {}
    if spec.chat:
        options["chat"] = True
    return options


def hf_engine(spec: LoadSpec) -> Any:
    """``HFEngine`` on ``spec.device`` (cpu by default)."""
    cls = load_engine(spec.engine)
    options = _options(spec) | ({"cuda_graphs": True} if spec.cuda_graphs else {})
    check_device("device", spec.device or "cpu")
    with loading("model", spec.model):
        return cls.from_pretrained(spec.model, device=spec.device or "cpu", **options)


def vllm_engine(spec: LoadSpec) -> Any:
    """``VLLMEngine`` or ``VLLMAsyncEngine``, sized to the branch budget."""
    engine_args = {"max_num_seqs": spec.batch_size, **_options(spec), **spec.vllm_args}
    # On a CPU: LLMEngine's core in this process, and either's KV cache sized to fit
    # (vLLM-CPU's default asks for 0.92 of the memory and refuses to start).
    engine_args = vllm_layout(engine_args, in_process=spec.engine == "vllm")
    engine = load_engine(spec.engine).from_engine_args(spec.model, **engine_args)
    # sart's branch budget, not vLLM's queue, must decide admission.
    engine.check_batch_size(spec.batch_size)
    return engine


def sglang_engine(spec: LoadSpec) -> Any:
    """``SGLangEngine`` behind its ``SyncBridge``: sglang.Engine runs its calls on its
    own loop, and the bridge drives it."""
    server_args = {"max_running_requests": spec.batch_size, **spec.sglang_args}
    if "model_path" in server_args:  # from_args takes it as its own argument
        raise ConfigError(f"sglang_args=model_path=... is not taken: {REFUSED['model_path']}")
    if server_args.get("skip_tokenizer_init"):
        raise ConfigError(
            "sglang_args=skip_tokenizer_init=true is not taken: sart's commands send text "
            "prompts and stop strings, which need SGLang's tokenizer"
        )
    with loading("model", spec.model):
        engine = load_engine(spec.engine).from_args(spec.model, **_options(spec), **server_args)
    # sart's branch budget, not SGLang's queue, must decide admission.
    engine.check_batch_size(spec.batch_size)
    return engine.bridge()


def gateway_engine(spec: LoadSpec) -> Any:
    """``OpenAIEngine`` over the upstreams, with the tokenizer if one is given or local."""
    gateway = spec.gateway
    if gateway is None:
        raise ConfigError(f"engine={spec.engine!r} needs a gateway (its upstream servers)")
    tokenizer = None
    source = gateway.tokenizer or (spec.model if Path(spec.model).expanduser().is_dir() else None)
    if source is not None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ConfigError(
                f"tokenizer={source!r}: loading it needs transformers ({install_hint('hf')}): {exc}"
            ) from None
        with loading("tokenizer", source):
            tokenizer = AutoTokenizer.from_pretrained(
                source, trust_remote_code=spec.trust_remote_code
            )
    return load_engine(spec.engine)(
        list(gateway.upstreams),
        spec.model,
        api_key=gateway.api_key,
        tokenizer=tokenizer,
        affinity=gateway.affinity,
        explicit_abort=gateway.explicit_abort,
        stream_interval=gateway.stream_interval,
        timeout=gateway.stream_timeout,
    )


def _trust(spec: LoadSpec) -> dict[str, Any]:
    return {"trust_remote_code": True} if spec.trust_remote_code else {}


def transformers_prm(spec: LoadSpec) -> Any:
    """A transformers PRM in this process (``sart.launch.build_prm`` hosts it in a
    process of its own unless ``prm_in_process``: it calls this there)."""
    cls = load_prm(spec.prm_kind)
    if spec.resolved_prm_device is not None:
        check_device("prm_device", spec.resolved_prm_device)
    with loading("prm", str(spec.prm)):
        return cls.from_pretrained(
            spec.prm, device=spec.resolved_prm_device, **_trust(spec), **spec.prm_options
        )


def vllm_prm(spec: LoadSpec) -> Any:
    """A PRM on a vLLM engine of its own."""
    options = vllm_layout({**_trust(spec), **spec.prm_options})
    return load_prm(spec.prm_kind).from_engine_args(spec.prm, **options)


def remote_prm(spec: LoadSpec) -> Any:
    """``RemotePRM`` on the ``vllm serve`` PRM servers at ``spec.prm_urls``."""
    return load_prm(spec.prm_kind)(
        spec.prm_urls,
        spec.prm,
        api_key=spec.prm_api_key,
        timeout=spec.prm_timeout,
        trust_remote_code=spec.trust_remote_code,
        **spec.prm_options,
    )
