"""The lazy engine/PRM registry."""

from __future__ import annotations

import pytest

import sart
from sart import registry
from sart.testing import FakeEngine, ScriptedPRM


def test_builtins_load_by_name() -> None:
    assert sart.load_engine("fake") is FakeEngine
    assert sart.load_engine("sim").__name__ == "SimEngine"
    assert sart.load_prm("scripted") is ScriptedPRM
    assert {"qwen", "shepherd"} <= set(registry.prm_names())


def test_unknown_name_lists_the_known_ones() -> None:
    known = r"engine='nope' must be one of \['fake', 'hf', 'openai', 'sglang', 'sim', 'vllm'"
    with pytest.raises(sart.UnknownComponentError, match=known):
        sart.load_engine("nope")


def test_register_a_class_or_a_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_ENGINES", dict(registry._ENGINES))
    sart.register_engine("mine", FakeEngine)
    sart.register_engine("by-path", "sart.engines.fake:FakeEngine")
    assert sart.load_engine("mine") is FakeEngine
    assert sart.load_engine("by-path") is FakeEngine


def test_missing_dependency_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_PRMS", dict(registry._PRMS))
    sart.register_prm("ghost", "vllm_is_not_installed_here.prm:X")
    with pytest.raises(sart.MissingDependencyError, match="needs the module"):
        sart.load_prm("ghost")
    monkeypatch.setattr(registry, "_EXTRAS", {"vllm_is_not_installed_here": "vllm"})
    with pytest.raises(ImportError, match=r"pip install -e '\.\[vllm\]'"):
        sart.load_prm("ghost")
