"""Processes and threads on a machine without an accelerator: what sart's loader picks.

On CPUs the policy and a PRM in a process of its own compete for the same cores,
and vLLM-CPU's default layout pins a thread to every core. ``cpu_layout`` splits the
cores and runs vLLM's engine core in sart's process; ``vllm_layout`` adds the matching
engine argument and a KV cache that fits. Both are called by ``sart.launch.load`` and
its build functions; neither changes anything on GPUs, nor a setting the user made.
"""

from __future__ import annotations

import os
from typing import Any

from sart.load_spec import VLLM_PRMS, LoadSpec

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's switch between its engine core in a process of its own (``1``, its default)
and in the caller's process (``0``)."""
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM-CPU's pinning of its OpenMP threads (``auto``, its default: one per core)."""
THREADS_ENV = "OMP_NUM_THREADS"
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
"""vLLM-CPU's KV cache size in GiB (its legacy setting; unset: a share of memory)."""
KV_CACHE_MAX = 4 * 2**30
"""The largest KV cache ``vllm_layout`` picks on vLLM-CPU: 4 GiB holds about 2M tokens
of the testbeds' models and 75k of Qwen2.5-7B's (bfloat16); a larger one is yours to set."""


def _on_vllm_cpu() -> bool:
    """Whether vLLM is installed and its platform here is the CPU."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # no vLLM: loading the engine says what to install
        return False
    return bool(current_platform.is_cpu())


def cpu_layout(spec: LoadSpec, *, with_prm: bool = True) -> dict[str, str]:
    """Where the policy runs on CPUs: split the cores between it and a PRM in a process of
    its own, and run vLLM's engine in this process; return the settings chosen (empty:
    none).

    On a CPU, a policy and a PRM that each take every core fight over them, and SART,
    which waits for the PRM, loses most: measured on this project's 2-core machine
    (the testbed, N = 8, 8 req/s, seed 0, no environment variables):

    - transformers (``sart bench --engine hf --model testbed --requests 40 --n 8
      --rate 8 --methods sc sart``): SC / SART at P97 0.54 and 0.47 (two runs) with
      every core each; 2.55 and 2.70 with the cores split as below;
    - vLLM-CPU (``--engine vllm``): 0.77 with vLLM's layout (an engine-core process
      with an OpenMP thread pinned to every core), 0.06 with the engine in sart's
      process still pinned to every core, 0.97-2.07 in repeats with it in sart's
      process on one unpinned thread.

    So, when the policy runs on the CPU (``hf`` on ``device`` cpu, or ``vllm`` on vLLM's
    CPU platform) and a transformers PRM has its own process(es) on the CPU, this
    process takes half the cores (``torch.set_num_threads``) and the PRM's processes
    the rest (``OMP_NUM_THREADS`` in their environment, split among ``prm_replicas``;
    at least one each). For the ``vllm`` engine (or a vLLM PRM) on vLLM's CPU platform
    its engine core also runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    and ``distributed_executor_backend="uni"`` in ``vllm_layout``), unpinned
    (``VLLM_CPU_OMP_THREADS_BIND=nobind``). Each setting stays the user's where the
    environment already has it; on GPUs nothing changes."""
    has_prm = with_prm and spec.prm is not None
    local_vllm_prm = has_prm and spec.prm_kind in VLLM_PRMS
    vllm_cpu = (spec.engine == "vllm" or local_vllm_prm) and _on_vllm_cpu()
    chosen: dict[str, str] = {}
    if vllm_cpu:
        for name, value in ((IN_PROCESS_ENV, "0"), (BIND_ENV, "nobind")):
            if name not in os.environ:
                os.environ[name] = chosen[name] = value
    policy_on_cpu = (spec.engine == "hf" and (spec.device or "cpu") == "cpu") or (
        spec.engine == "vllm" and vllm_cpu
    )
    prm_beside = has_prm and spec.prm_process and spec.resolved_prm_device == "cpu"
    if THREADS_ENV not in os.environ and policy_on_cpu and prm_beside:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        engine = max(1, cores // 2)
        prm = max(1, (cores - engine) // max(1, spec.prm_replicas))
        torch.set_num_threads(engine)
        # Read by the PRM's processes, which start after this (spawned: a fresh
        # interpreter takes its threads from the environment).
        os.environ[THREADS_ENV] = chosen[THREADS_ENV] = str(prm)
        chosen["engine threads"] = str(engine)
    return chosen


def _kv_cache_bytes() -> int:
    """A vLLM-CPU KV cache that fits beside everything else: half the memory available
    now, at most ``KV_CACHE_MAX``."""
    import psutil  # a vLLM dependency

    return int(min(KV_CACHE_MAX, psutil.virtual_memory().available // 2))


def vllm_layout(engine_args: dict[str, Any], *, in_process: bool = True) -> dict[str, Any]:
    """``engine_args`` for a vLLM ``LLMEngine`` (the ``vllm`` engine, vLLM PRMs): on
    vLLM's CPU platform, the single-process executor (``distributed_executor_backend=
    "uni"``, unless given) to go with the engine core in this process (``cpu_layout``),
    and a KV cache of half the available memory, at most 4 GiB (``kv_cache_memory_bytes``),
    unless ``gpu_memory_utilization``, ``kv_cache_memory_bytes`` or
    ``VLLM_CPU_KVCACHE_SPACE`` says otherwise; elsewhere unchanged. ``in_process=False``
    (``AsyncLLM``, whose engine core always runs in a process of its own): the KV
    cache's size only.

    vLLM-CPU's own default reserves ``gpu_memory_utilization`` (0.92) of the NUMA
    node's memory and refuses to start when that much is not free: on this project's
    2-core machine node 0 has 9.2 GiB, 8.4 free with nothing running, so
    ``sart bench --engine vllm`` failed out of the box (and a second vLLM engine, a
    vLLM PRM, could never start beside the first)."""
    if not _on_vllm_cpu():
        return engine_args
    sized = {"gpu_memory_utilization", "kv_cache_memory_bytes"} & engine_args.keys()
    if not sized and os.environ.get(KV_CACHE_ENV, "") == "":
        engine_args = {"kv_cache_memory_bytes": _kv_cache_bytes(), **engine_args}
    if not in_process:
        return engine_args
    os.environ.setdefault(IN_PROCESS_ENV, "0")
    return {"distributed_executor_backend": "uni", **engine_args}


__all__ = [
    "BIND_ENV",
    "IN_PROCESS_ENV",
    "KV_CACHE_ENV",
    "KV_CACHE_MAX",
    "THREADS_ENV",
    "cpu_layout",
    "vllm_layout",
]
