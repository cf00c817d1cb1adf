"""The one model loader (``sart.launch``): what a spec accepts, what it builds, and that
whatever it started is stopped, with the engines and PRMs stood in for."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

import sart
import sart.builders
import sart.registry
from sart import testbed
from sart.launch import (
    Gateway,
    LoadSpec,
    build_engine,
    build_prm,
    load,
    resolve_models,
    sampling_defaults,
)


class StandIn:
    """An engine or PRM class that records how it was built and whether it was closed."""

    built: ClassVar[list[tuple[str, str, dict]]] = []
    closed: ClassVar[list[str]] = []
    fail: ClassVar[set[str]] = set()

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def _make(cls, how: str, model: str, **kwargs: Any) -> StandIn:
        if how in cls.fail:
            raise sart.ConfigError(f"{how} failed")
        cls.built.append((how, model, kwargs))
        return cls(how)

    @classmethod
    def from_pretrained(cls, model: str, **kwargs: Any) -> StandIn:
        return cls._make("from_pretrained", model, **kwargs)

    @classmethod
    def from_engine_args(cls, model: str, **kwargs: Any) -> StandIn:
        return cls._make("from_engine_args", model, **kwargs)

    def check_batch_size(self, batch_size: int) -> None:
        self.built.append(("check_batch_size", "", {"batch_size": batch_size}))

    def close(self) -> None:
        self.closed.append(self.name)


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    StandIn.built, StandIn.closed, StandIn.fail = [], [], set()
    for name in ("hf", "vllm", "vllm-async"):
        monkeypatch.setitem(sart.registry._ENGINES, name, StandIn)
    for name in ("qwen", "shepherd", "vllm-qwen"):
        monkeypatch.setitem(sart.registry._PRMS, name, StandIn)
    # The stand-ins are "placed" on devices this machine may lack (tests/test_devices.py
    # checks the check).
    monkeypatch.setattr(sart.builders, "check_device", lambda field, device: None)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"engine": "vllm", "device": "cuda:0"},
            "device='cuda:0' has no effect with engine 'vllm'",
        ),
        ({"engine": "hf", "vllm_args": {"dtype": "half"}}, "vllm_args={'dtype': 'half'} has no"),
        ({"engine": "vllm", "sglang_args": {"tp_size": 2}}, "sglang_args={'tp_size': 2} has no"),
        ({"engine": "hf", "prm_device": "cuda:1"}, "prm_device='cuda:1' has no effect without"),
        (
            {"engine": "hf", "prm": "p", "prm_kind": "vllm-qwen", "prm_device": "cuda:1"},
            "prm_device='cuda:1' has no effect with PRM kind 'vllm-qwen' (only qwen, shepherd",
        ),
        (
            {"engine": "vllm", "prm": "p", "prm_kind": "vllm-qwen", "prm_in_process": True},
            "prm_in_process=True has no effect with PRM kind 'vllm-qwen'",
        ),
        ({"engine": "openai"}, "gateway=None must be set exactly when engine='openai'"),
        ({"engine": "hf", "gateway": Gateway(("http://x",))}, "gateway=Gateway("),
        ({"engine": "tgi"}, "engine='tgi' must be one of"),
        (
            {"engine": "hf", "prm": "p", "prm_urls": ("http://x",)},
            "prm_urls=('http://x',) has no effect with PRM kind 'qwen' (only remote reads it)",
        ),
        ({"engine": "hf", "prm": "p", "prm_kind": "remote"}, "prm_urls=() must be at least one"),
        ({"engine": "hf", "batch_size": 0}, "batch_size=0 must be >= 1"),
    ],
)
def test_a_field_the_engine_or_prm_would_ignore_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(sart.ConfigError) as info:
        LoadSpec(model="m", **fields)
    assert message in str(info.value)


def test_the_loader_builds_every_registered_name_but_the_test_doubles() -> None:
    registry = sart.registry
    assert set(registry.loadable_engines()) == set(registry.engine_names()) - {"fake", "sim"}
    steps = set(registry.step_engines())
    assert {"hf", "vllm", "sglang"} <= steps and not steps & {"vllm-async", "openai"}
    assert set(registry.loadable_prms()) == set(registry.prm_names()) - {"scripted"}
    for name in registry.loadable_engines():
        assert callable(registry.engine_builder(name)), name
    for kind in registry.loadable_prms():
        assert callable(registry.prm_builder(kind)), kind
    with pytest.raises(sart.UnknownComponentError, match="cannot be loaded from a model name"):
        registry.engine_builder("fake")


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--prm-url", "http://x"], None),
        (["--prm-url", "http://x", "--prm-kind", "remote"], None),
        (["--prm-url", "http://x", "--prm-kind", "vllm-cached"], "give one or the other"),
        (["--prm-kind", "remote"], "--prm-kind remote needs --prm-url"),
    ],
)
def test_prm_url_means_the_remote_kind_and_nothing_else(flags: list[str], said: str | None) -> None:
    # --prm-url used to turn --prm-kind vllm-cached (a PRM on vLLM in this process)
    # silently into the remote PRM; now the remote PRM is a kind of its own.
    import argparse

    from sart.model_flags import add_model_flags, load_spec

    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="hf")
    parser.add_argument("--model", default="m")
    add_model_flags(parser)
    args = parser.parse_args(["--prm", "tok", *flags])
    if said is None:
        spec = load_spec(args, batch_size=4)
        assert spec.prm_kind == "remote" and spec.prm_urls == ("http://x",)
    else:
        with pytest.raises(sart.ConfigError, match=said):
            load_spec(args, batch_size=4)


def test_testbed_stands_for_the_shipped_policy_and_its_calibrated_prm() -> None:
    policy, prm, options = str(testbed.POLICY_PATH), str(testbed.PRM_PATH), testbed.prm_kwargs()
    assert resolve_models("testbed", None, "qwen") == (policy, prm, options)
    assert resolve_models("testbed", "other", "qwen") == (policy, "other", {})
    assert resolve_models("m", "testbed", "qwen") == ("m", prm, options)
    # A remote server's model named "testbed" is a name, not the shipped files.
    assert resolve_models("testbed", None, "qwen", local=False) == ("testbed", None, {})
    with pytest.raises(sart.ConfigError, match="the testbed PRM runs on transformers only"):
        resolve_models("testbed", None, "vllm-qwen")


def test_testbed_long_stands_for_the_long_testbeds_files_and_calibration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    long = testbed.LONG
    # An install without its weights (deleted, or a testbed registered before it
    # was trained) is named in the error, not left to fail inside transformers.
    monkeypatch.setitem(testbed.TESTBEDS, "testbed-long", attrs.evolve(long, weights=tmp_path))
    with pytest.raises(sart.ConfigError, match="'testbed-long': its weights are not in"):
        resolve_models("testbed-long", None, "qwen")
    monkeypatch.setitem(testbed.TESTBEDS, "testbed-long", long)
    policy, prm = str(long.policy_path), str(long.prm_path)
    options = long.prm_kwargs()
    assert options["max_length"] == 2304 and options["step_separator"] == "<step>"
    assert resolve_models("testbed-long", None, "qwen") == (policy, prm, options)
    assert resolve_models("m", "testbed-long", "qwen") == ("m", prm, options)
    assert resolve_models("testbed-long", "testbed", "qwen") == (
        policy,
        str(testbed.PRM_PATH),
        testbed.prm_kwargs(),
    )
    settings = sampling_defaults(
        "testbed-long",
        max_tokens=None,
        temperature=None,
        top_p=None,
        default_max_tokens=9,
        default_temperature=0.6,
    )
    assert (settings.max_tokens, settings.temperature, settings.top_p) == (2048, 1.0, 1.0)


def test_engines_are_sized_to_the_branch_budget_with_their_own_arguments() -> None:
    build_engine(LoadSpec("hf", "m", device="cuda:0", trust_remote_code=True, chat=True))
    build_engine(LoadSpec("hf", "m", device="cuda", cuda_graphs=True))
    spec = LoadSpec("vllm", "m", vllm_args={"dtype": "half", "max_num_seqs": 64}, batch_size=32)
    build_engine(spec)
    assert StandIn.built == [
        ("from_pretrained", "m", {"device": "cuda:0", "trust_remote_code": True, "chat": True}),
        ("from_pretrained", "m", {"device": "cuda", "cuda_graphs": True}),
        ("from_engine_args", "m", {"max_num_seqs": 64, "dtype": "half"}),
        ("check_batch_size", "", {"batch_size": 32}),
    ]


def test_prm_placement_and_hosting() -> None:
    spec = LoadSpec("hf", "m", prm="p", device="cuda:0", prm_in_process=True)
    assert (spec.prm_process, spec.resolved_prm_device) == (False, "cuda:0")
    build_prm(spec)
    assert StandIn.built[-1] == ("from_pretrained", "p", {"device": "cuda:0"})
    vllm_prm = LoadSpec("vllm", "m", prm="p", prm_kind="vllm-qwen", prm_options={"x": 1})
    assert (vllm_prm.prm_process, vllm_prm.resolved_prm_device) == (False, None)
    build_prm(vllm_prm)
    assert StandIn.built[-1] == ("from_engine_args", "p", {"x": 1})
    assert LoadSpec("vllm", "m", prm="p").resolved_prm_device == "cpu"
    assert LoadSpec("vllm", "m", prm="p").prm_process  # its own process by default
    assert build_prm(LoadSpec("hf", "m")) is None


def test_load_builds_both_and_close_stops_both() -> None:
    with load(LoadSpec("hf", "m", prm="p", prm_in_process=True)) as loaded:
        assert (loaded.engine.name, loaded.prm.name) == ("from_pretrained", "from_pretrained")
    assert StandIn.closed == ["from_pretrained", "from_pretrained"]
    StandIn.closed.clear()
    with load(LoadSpec("hf", "m", prm="p", prm_in_process=True), with_prm=False) as loaded:
        assert loaded.prm is None


def test_a_prm_that_fails_to_load_stops_the_engine_already_loaded() -> None:
    StandIn.fail = {"from_engine_args"}  # the PRM (vllm-qwen); the engine is hf
    with pytest.raises(sart.ConfigError, match="from_engine_args failed"):
        load(LoadSpec("hf", "m", prm="p", prm_kind="vllm-qwen"))
    assert StandIn.closed == ["from_pretrained"]


def test_on_a_cpu_the_policy_and_the_prm_process_split_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    from sart import cpu_layout as launch

    for name in (launch.IN_PROCESS_ENV, launch.BIND_ENV, launch.THREADS_ENV):
        monkeypatch.delenv(name, raising=False)
    threads: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _pid: set(range(6)))
    monkeypatch.setattr(launch, "_on_vllm_cpu", lambda: False)
    # The transformers policy on the CPU, the PRM in 3 processes of its own: 3 cores here,
    # one for each PRM process.
    chosen = launch.cpu_layout(LoadSpec("hf", "m", prm="p", prm_replicas=3))
    assert chosen == {launch.THREADS_ENV: "1", "engine threads": "3"} and threads == [3]
    assert launch.os.environ[launch.THREADS_ENV] == "1"
    # Set by the user: kept; on GPUs, or with the PRM in this process: nothing to split.
    assert launch.cpu_layout(LoadSpec("hf", "m", prm="p")) == {}
    monkeypatch.delenv(launch.THREADS_ENV)
    assert launch.cpu_layout(LoadSpec("hf", "m", prm="p", device="cuda:0")) == {}
    assert launch.cpu_layout(LoadSpec("hf", "m", prm="p", prm_in_process=True)) == {}
    assert launch.cpu_layout(LoadSpec("hf", "m")) == {}


def test_a_typo_beside_a_local_directory_is_refused_with_the_name_it_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: `--model demo/polcy` went to the hub, retried for half a minute and
    # ended in a traceback.
    from sart.launch import check_path

    (tmp_path / "demo" / "policy").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sart.ConfigError) as info:
        check_path("model", "demo/polcy")
    assert str(info.value) == (
        "model='demo/polcy': no such file or directory (did you mean 'demo/policy'?)"
    )
    with pytest.raises(sart.ConfigError, match=r"^prm='\./demo/prm': no such file or directory$"):
        check_path("prm", "./demo/prm")  # spelled as a path: nothing is close, still refused
    check_path("model", "demo/policy")  # there
    check_path("model", "demo/Qwen2.5-Math-7B")  # nothing close here: may be a hub id
    check_path("model", "Qwen/Qwen2.5-Math-7B")  # no local Qwen/: a hub id


def test_a_model_that_cannot_be_found_or_fetched_is_a_config_error() -> None:
    from sart.launch import loading

    with pytest.raises(sart.ConfigError) as info, loading("model", "nosuchorg/model"):
        raise OSError("We couldn't connect to 'https://huggingface.co'")
    assert str(info.value) == (
        "model='nosuchorg/model': not a local path, and it could not be loaded: "
        "We couldn't connect to 'https://huggingface.co'"
    )
    with pytest.raises(ValueError), loading("model", "m"):  # anything else is not hidden
        raise ValueError("a bug")


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--model", "nosuchorg/policy"], "--model 'nosuchorg/policy': not a local path, and"),
        # The PRM loads in a process of its own: its error crosses back as one line.
        (["--model", "testbed", "--prm", "nosuchorg/prm"], "--prm 'nosuchorg/prm': not a local"),
    ],
)
def test_bench_says_in_one_line_that_a_model_is_nowhere(
    flags: list[str], said: str, tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys

    pytest.importorskip("transformers")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q0", "prompt": "Step 1: add 2 and 5.", "answer": "7"}\n')
    done = subprocess.run(
        [sys.executable, "-m", "sart.cli", "bench", "--engine", "hf", *flags, "--prompts",
         str(prompts), "--n", "2", "--methods", "sc", "--out", str(tmp_path / "out")],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"\nsart: error: {said}" in f"\n{done.stderr}", done.stderr
    assert "Traceback" not in done.stderr
