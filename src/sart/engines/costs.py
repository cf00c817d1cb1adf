"""Cost models of an accelerator serving a model: how long a decode step and a prefill take.

The model is a roofline, stated so that every number can be checked:

- **Decode step** = ``step_overhead`` + max(memory time, compute time), where
  memory time = (weight bytes + KV bytes read) / (bandwidth x ``bandwidth_efficiency``)
  and compute time = 2 x params x live branches / (peak FLOP/s x ``flops_efficiency``).
  Every live branch's attention reads its whole context (prompt + generated,
  including the token being decoded) each step: paged attention reads the
  shared prefix blocks once *per branch*, although they are *stored* once.
- **Prefill** = ``step_overhead`` + 2 x params x prompt tokens
  / (peak FLOP/s x ``flops_efficiency``).
- **KV capacity** (tokens) = (HBM x ``memory_utilization`` - weights) / KV bytes per token,
  summed over the tensor-parallel group.

Hardware numbers are NVIDIA's datasheet figures (dense BF16, no sparsity):
H100 SXM5 80 GB: 3.35 TB/s HBM3, 989 TFLOP/s. H200 SXM 141 GB: 4.8 TB/s
HBM3e, 989 TFLOP/s. Model numbers come from the models' ``config.json``
(parameter counts from their model cards): DeepSeek-R1-Distill-Qwen-14B
(Qwen2.5-14B: 48 layers, 8 KV heads of dim 128, 14.8 B parameters) and
DeepSeek-R1-Distill-Llama-70B (Llama-3.3-70B: 80 layers, 8 KV heads of dim
128, 70.6 B parameters), both in BF16.

Assumptions (not measured here; change them with ``attrs.evolve``): 75% of
peak bandwidth and 50% of peak FLOP/s are achieved; ``memory_utilization`` is
vLLM's default ``gpu_memory_utilization`` 0.9; a decode step costs 1 ms of
fixed overhead (scheduling, sampling, kernel launches with CUDA graphs), plus,
under tensor parallelism, two all-reduces per layer at 8 us each.

The ``steps`` model prices a decode step at exactly 1 time unit and a prefill
at 0, for exact cross-checks with hand-computed schedules.
"""

from __future__ import annotations

import attrs

from sart.errors import config_check
from sart.registry import preset


@attrs.frozen
class Accelerator:
    name: str
    hbm_bytes: float
    bandwidth: float
    """Bytes per second."""
    peak_flops: float
    """Dense BF16 FLOP/s."""


@attrs.frozen
class ModelSpec:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    heads: int | None = None
    """Query heads (only the PRM cost model, which prices attention FLOPs, needs them)."""
    context: int | None = None
    """Tokens of context the model takes (``None``: not limited here)."""

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V, every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


H100 = Accelerator("H100-SXM5-80GB", hbm_bytes=80e9, bandwidth=3.35e12, peak_flops=989e12)
H200 = Accelerator("H200-SXM-141GB", hbm_bytes=141e9, bandwidth=4.8e12, peak_flops=989e12)
QWEN_14B = ModelSpec(
    "DeepSeek-R1-Distill-Qwen-14B", params=14.8e9, layers=48, kv_heads=8, head_dim=128
)
LLAMA_70B = ModelSpec(
    "DeepSeek-R1-Distill-Llama-70B", params=70.6e9, layers=80, kv_heads=8, head_dim=128
)


def non_negative(_inst: object, attr: attrs.Attribute, value: float) -> None:
    """attrs validator: ``value >= 0`` (``ConfigError`` naming the field otherwise)."""
    config_check(value >= 0, attr.name, value, ">= 0")


@attrs.frozen
class CostModel:
    """Prices decode steps and prefills; see the module docstring for the formulas."""

    name: str
    weight_bytes: float = attrs.field(validator=non_negative)
    """Weights read per decode step (all GPUs of the group)."""
    kv_bytes_per_token: float = attrs.field(validator=non_negative)
    bandwidth: float = attrs.field(validator=non_negative)
    """Effective bytes/s of the group (datasheet x efficiency)."""
    flops: float = attrs.field(validator=non_negative)
    """Effective FLOP/s of the group (datasheet x efficiency)."""
    params: float = attrs.field(validator=non_negative)
    step_overhead: float = attrs.field(validator=non_negative)
    """Fixed seconds per decode step and per prefill."""
    kv_capacity_tokens: int | None = None
    """KV-cache tokens that fit in memory (``None``: unlimited)."""
    unit_steps: bool = False
    """The ``steps`` model: a decode step costs 1, a prefill 0."""
    accelerator: Accelerator | None = None
    """The kind of accelerator modelled (one of the group); ``None`` for ``steps``.
    The simulator's PRM runs on one of the same kind (``sart.engines.prm_costs``)."""

    def prefill_time(self, prompt_tokens: int) -> float:
        if self.unit_steps:
            return 0.0
        return self.step_overhead + 2.0 * self.params * prompt_tokens / self.flops

    def decode_time(self, contexts: list[int], active_steps: list[int]) -> float:
        """Time to decode ``max(active_steps)`` steps, where branch ``i`` starts with
        ``contexts[i]`` tokens of context and stays live for ``active_steps[i]`` steps.

        Exact in the memory-bound regime: between two branch ends the live set is
        fixed and the KV read grows by one token per branch per step, so the mean
        over the segment is exact.
        """
        horizon = max(active_steps, default=0)
        if self.unit_steps or horizon == 0:
            return float(horizon)
        order = sorted(range(len(contexts)), key=active_steps.__getitem__)
        live = len(order)
        ctx_sum = float(sum(contexts))
        total, start = 0.0, 0
        for i in order:
            end = active_steps[i]
            if end > start:
                k = end - start
                kv_mean = ctx_sum + live * (start + end + 1) / 2.0
                memory = (self.weight_bytes + kv_mean * self.kv_bytes_per_token) / self.bandwidth
                compute = 2.0 * self.params * live / self.flops
                total += k * (self.step_overhead + max(memory, compute))
                start = end
            live -= 1
            ctx_sum -= contexts[i]
        return total


def serving(
    name: str,
    accelerator: Accelerator,
    model: ModelSpec,
    tp: int = 1,
    *,
    bandwidth_efficiency: float = 0.75,
    flops_efficiency: float = 0.5,
    memory_utilization: float = 0.9,
    base_overhead: float = 1e-3,
    allreduce_latency: float = 8e-6,
) -> CostModel:
    """A cost model for ``model`` on ``tp`` tensor-parallel ``accelerator``s."""
    config_check(tp >= 1, "tp", tp, ">= 1")
    free = tp * accelerator.hbm_bytes * memory_utilization - model.weight_bytes
    config_check(free > 0, "tp", tp, f"large enough to hold {model.name}'s weights")
    overhead = base_overhead + (2 * model.layers * allreduce_latency if tp > 1 else 0.0)
    return CostModel(
        name=name,
        weight_bytes=model.weight_bytes,
        kv_bytes_per_token=model.kv_bytes_per_token,
        bandwidth=tp * accelerator.bandwidth * bandwidth_efficiency,
        flops=tp * accelerator.peak_flops * flops_efficiency,
        params=model.params,
        step_overhead=overhead,
        kv_capacity_tokens=int(free // model.kv_bytes_per_token),
        accelerator=accelerator,
    )


def compute_bound(name: str, fixed: float, per_row: float) -> CostModel:
    """A decode step of ``fixed`` seconds plus ``per_row`` seconds a running branch: an
    engine where each row costs its own compute (a CPU; no weights' read to share, no
    KV limit), as the scheduler's step-cost fit describes one
    (``sart.scheduler.step_cost``)."""
    config_check(fixed >= 0, "fixed", fixed, ">= 0")
    config_check(per_row > 0, "per_row", per_row, "> 0")
    return CostModel(
        name=name,
        weight_bytes=0,
        kv_bytes_per_token=0,
        bandwidth=1.0,
        # A row's compute is 2 * params / flops seconds: params 1 makes it per_row.
        flops=2.0 / per_row,
        params=1.0,
        step_overhead=fixed,
    )


STEPS = CostModel(
    name="steps",
    weight_bytes=0,
    kv_bytes_per_token=0,
    bandwidth=1,
    flops=1,
    params=0,
    step_overhead=0,
    unit_steps=True,
)

PRESETS: dict[str, CostModel] = {
    "steps": STEPS,
    "h100-14b": serving("h100-14b", H100, QWEN_14B, tp=1),
    "h200-14b": serving("h200-14b", H200, QWEN_14B, tp=1),
    "8xh100-70b": serving("8xh100-70b", H100, LLAMA_70B, tp=8),
    # The paper's hardware, 8 H100s serving DeepSeek-R1-Distill-Qwen-14B, as one
    # tensor-parallel group. As 8 data-parallel replicas: h100-14b with
    # `sart bench --replicas 8`.
    "8xh100-14b-tp8": serving("8xh100-14b-tp8", H100, QWEN_14B, tp=8),
}


def cost_model(name: str | CostModel) -> CostModel:
    """A preset by name (or a ``CostModel`` passed through)."""
    return name if isinstance(name, CostModel) else preset(PRESETS, name, "cost model")
