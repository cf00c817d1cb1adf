"""sart's test stand-in for ``sgl_kernel`` (SGLang's kernel wheel, ``sglang-kernel``).

What it replaces. ``sglang-kernel`` ships SGLang's compiled CUDA kernels and,
for CPUs, AMX kernels registered as ``torch.ops.sgl_kernel.*``; its wheels on
PyPI need CUDA. SGLang's CPU path (``SGLANG_USE_CPU_ENGINE=1``) imports
names from ``sgl_kernel`` at module level all the same, so without a
``sgl_kernel`` SGLang does not import. This package defines the one op that a
Llama model under ``--attention-backend torch_native`` calls,
``assign_req_to_token_pool_cpu`` (SGLang's ``mem_cache/allocation.py``: it
writes a batch's new KV slots into the request-to-token table), in pure torch;
every other name imports as a placeholder that raises ``NotImplementedError``
when called (``_sart_shim``).

Why tests on it still test SGLang. No ``torch.ops.sgl_kernel.*`` op is
registered, so SGLang's own check ``_is_intel_amx_backend_available()`` is
False and SGLang chooses its non-AMX CPU paths, as it does on a CPU without
sgl-kernel's AMX ops: torch-native attention, RMSNorm, rotary embedding,
activations and sampling, all SGLang's own code. SGLang's scheduler,
radix cache, KV pool, tokenizer manager, detokenizer, streaming and abort run
unchanged; only the table write above is ours, and a wrong one would corrupt
the KV and show up as wrong greedy tokens (the scenario suite compares them).

What would break it. A model, backend or feature that calls any other
``sgl_kernel`` op (AMX-packed weights, quantized GEMMs, MoE, the CUDA
attention backends, speculative decoding's kernels, a newer SGLang whose CPU
path calls another op): the placeholder raises ``NotImplementedError`` naming
the op, in SGLang's scheduler process (the request then fails, or the engine
does not start). Registering ``torch.ops.sgl_kernel.convert_weight_packed``
would make SGLang take its AMX paths, which this stand-in does not have.
"""

from __future__ import annotations

import torch
from _sart_shim import stand_in

__version__ = "0.0.0+sart.standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` = request
    ``i``'s slice of ``out_cache_loc`` (the slices lie one after another, in batch
    order): what SGLang's Triton kernel ``assign_req_to_token_pool`` does on GPUs."""
    del pool_len  # the row length; torch indexing knows it
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), starts, ends, strict=True):
        req_to_token[row, start:end] = out_cache_loc[offset : offset + end - start]
        offset += end - start


__getattr__ = stand_in(__name__)
