"""The loader's process layout for vLLM on a machine without an accelerator
(``sart.launch.cpu_layout``, ``vllm_layout``). Needs vLLM (its CPU platform); CI runs it
in its vLLM stage."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from sart import cpu_layout as launch
from sart.cpu_layout import cpu_layout, vllm_layout
from sart.launch import LoadSpec

NAMES = (launch.IN_PROCESS_ENV, launch.BIND_ENV, launch.THREADS_ENV, launch.KV_CACHE_ENV)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """No layout variable set; ``torch.set_num_threads`` recorded, not applied."""
    import torch

    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _pid: set(range(4)))
    return calls


def test_on_cpu_the_engine_runs_here_unpinned_on_half_the_cores(
    clean_env: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = cpu_layout(LoadSpec("vllm", "m", prm="p"))  # a transformers PRM, own process
    assert chosen == {
        launch.IN_PROCESS_ENV: "0",
        launch.BIND_ENV: "nobind",
        launch.THREADS_ENV: "2",  # the PRM's process: the other half
        "engine threads": "2",
    }
    assert clean_env == [2]
    assert vllm_layout({"max_num_seqs": 8})["distributed_executor_backend"] == "uni"
    assert (
        vllm_layout({"distributed_executor_backend": "mp"})["distributed_executor_backend"] == "mp"
    )


def test_what_the_user_set_is_kept(clean_env: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(launch.IN_PROCESS_ENV, "1")
    monkeypatch.setenv(launch.THREADS_ENV, "3")
    chosen = cpu_layout(LoadSpec("vllm", "m", prm="p", prm_replicas=2))
    assert chosen == {launch.BIND_ENV: "nobind"}
    assert clean_env == []


def test_other_engines_get_only_the_core_split(clean_env: list[int]) -> None:
    assert cpu_layout(LoadSpec("hf", "m", prm="p", device="cuda:0", prm_device="cuda:1")) == {}
    # A vLLM PRM in this process (no process of its own): the engine core here, all cores.
    chosen = cpu_layout(LoadSpec("hf", "m", prm="p", prm_kind="vllm-cached"))
    assert chosen == {launch.IN_PROCESS_ENV: "0", launch.BIND_ENV: "nobind"}
    assert clean_env == []


def test_on_cpu_the_kv_cache_fits_unless_the_user_sized_it(
    clean_env: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM-CPU's own default (0.92 of the node's memory, refused when not free)
    # failed to start on a machine whose node 0 had 8.4 of 9.2 GiB free.
    import types

    import psutil

    for available, chosen in ((6 * 2**30, 3 * 2**30), (64 * 2**30, launch.KV_CACHE_MAX)):
        memory = types.SimpleNamespace(available=available)
        monkeypatch.setattr(psutil, "virtual_memory", lambda memory=memory: memory)
        assert vllm_layout({"max_num_seqs": 8})["kv_cache_memory_bytes"] == chosen
    for given in ({"gpu_memory_utilization": 0.5}, {"kv_cache_memory_bytes": 2**30}):
        assert vllm_layout(given).keys() - given.keys() == {"distributed_executor_backend"}
        assert vllm_layout(given).items() >= given.items()
    # AsyncLLM (--engine vllm-async): its engine core has a process of its own, and
    # only the KV cache is sized (it failed to start out of the box before).
    monkeypatch.delenv(launch.IN_PROCESS_ENV, raising=False)
    assert vllm_layout({"max_num_seqs": 8}, in_process=False).keys() == {
        "max_num_seqs",
        "kv_cache_memory_bytes",
    }
    assert launch.IN_PROCESS_ENV not in launch.os.environ
    monkeypatch.setenv(launch.KV_CACHE_ENV, "2")  # vLLM reads it: the user's size
    assert "kv_cache_memory_bytes" not in vllm_layout({})
