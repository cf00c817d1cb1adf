"""``scripts/gpu_check.py --engine hf``: the transformers engine and PRM on one GPU.

Needs only torch and transformers (the machine's own), downloads nothing: the
testbed's shipped checkpoints, and random-weight models of real shapes built on the
device. One line per check, as ``gpu_check.py``; ``--json FILE`` writes them with
their numbers; exit 1 if any failed. Checks:

- ``environment``: torch and transformers versions, the GPU;
- ``conformance``: ``check_engine`` on ``HFEngine`` over the testbed policy, on the device;
- ``greedy parity``: the testbed policy's greedy tokens on the device equal the CPU's;
- ``graph parity``: the long testbed's policy decoding over CUDA graphs
  (``cuda_graphs=True``, ``sart.engines.hf_graphs``) makes the default path's tokens,
  through a rebuild (a branch aborted) and past a column bucket;
- ``step cost``: the long testbed's policy decoding 8, 32 and 64 branches: ms per
  steady step and kernel launches per step (on a CPU: aten operations), and those
  of a step that rebuilds the batch (a branch ended); ``graph steps``: the same
  over CUDA graphs (each bucket captured in the untimed first steps);
- ``prm cost``: the long testbed's PRM checking as many branches in one forward,
  from their caches: kernel launches (aten operations) per check;
- ``7b decode``: a 7B-shape policy (Qwen2.5-7B's: 28 layers, hidden 3,584, GQA 28/4,
  vocabulary 152,064; random bfloat16 weights) through ``HFEngine`` at batch 1 to 64:
  ms per step and tokens/s, beside the bound of reading its weights once a step;
  ``7b graphs``: the same over CUDA graphs;
- ``7b prm``: a 7B-shape token-classification PRM through ``QwenMathPRM``, 32
  branches scored twice (fresh, then 64 tokens more each): PRM tokens/s;
- ``bench``: ``sart bench --engine hf`` on the long testbed, N = 8, Vanilla, SC and
  SART, at ``--rate``: P50 and P97 per method;
  ``bench graphs``: the same with ``--cuda-graphs`` (on a GPU only).

``--json`` is rewritten after every check, so a run stopped at a time limit keeps
the checks it finished (the benches run last: their time on a GPU is the least
known).

``--quick`` (with ``--allow-cpu``, as CI runs it) shrinks every shape and count (and
benches the short testbed) so the whole runs in a minute on a CPU: the code paths,
not the numbers. On a CPU the graph checks run the graphs' forward without capturing
it (``StaticDecode(capture=False)``): the code path, not the capture.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from check_report import Report

QWEN_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=1024,
)


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled(device: Any, run: Callable[[], object]) -> int:
    """Kernel and graph launches (on a CPU: aten operations) while ``run`` runs."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run()
        synchronize(device)
    events = prof.key_averages()
    if device.type == "cuda":  # a CUDA graph's replay is one launch
        return sum(e.count for e in events if "LaunchKernel" in e.key or "GraphLaunch" in e.key)
    return sum(e.count for e in events if e.key.startswith("aten::"))


def graphed(engine: Any, column_bucket: int | None = None) -> Any:
    """``engine`` decoding over CUDA graphs (``cuda_graphs=True``'s path); on a CPU the
    same forward, not captured."""
    from sart.engines.hf_graphs import COLUMN_BUCKET, StaticDecode

    engine.static = StaticDecode(engine.model, column_bucket=column_bucket or COLUMN_BUCKET)
    return engine


def environment(device: Any) -> tuple[str, dict[str, Any]]:
    import torch
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    data = {"torch": torch.__version__, "transformers": transformers.__version__, "device": name}
    return f"torch {torch.__version__}, transformers {transformers.__version__}, {name}", data


def conformance(device: Any) -> tuple[str, dict[str, Any]]:
    from sart.engines.conformance import check_engine
    from sart.engines.hf import HFEngine
    from sart.testbed import SHORT

    check_engine(
        lambda: HFEngine.from_pretrained(str(SHORT.policy_path), device=str(device)),
        prompts=("p1 3 p2 5 ", "p1 7 p2 1 p3 4 "),
        max_tokens=16,
    )
    return "check_engine passed (lifecycle, seeds, abort, until_first_end, forks)", {}


def greedy_parity(device: Any) -> tuple[str, dict[str, Any]]:
    from sart.engines.hf import HFEngine
    from sart.messages import BranchSpec
    from sart.testbed import LONG, make_questions
    from sart.types import SamplingSettings

    question = make_questions(0, 1, LONG.difficulties, cycle=LONG.cycle)[0]
    settings = SamplingSettings(temperature=0.0, max_tokens=128)

    def tokens(where: str) -> list[int]:
        engine = HFEngine.from_pretrained(str(LONG.policy_path), device=where)
        engine.prefill("g", question.prompt, settings)
        engine.start_branches("g", [BranchSpec(0, 0)])
        out: list[int] = []
        while engine.stats().live_branches:
            for delta in engine.step(16).deltas.values():
                out.extend(delta.token_ids)
        return out

    cpu, dev = tokens("cpu"), tokens(str(device))
    if cpu != dev:
        first = next(i for i, (a, b) in enumerate(zip(cpu, dev)) if a != b)
        raise AssertionError(f"greedy tokens differ from token {first} on ({len(cpu)} on cpu)")
    return f"{len(cpu)} greedy tokens identical on {device} and cpu", {"tokens": len(cpu)}


def graph_parity(device: Any, steps: int, column_bucket: int) -> tuple[str, dict[str, Any]]:
    from sart.engines.hf import HFEngine
    from sart.messages import BranchSpec
    from sart.testbed import LONG, make_questions
    from sart.types import BranchId, SamplingSettings

    questions = make_questions(3, 2, LONG.difficulties, cycle=LONG.cycle)
    settings = SamplingSettings(temperature=1.0, max_tokens=steps, ignore_eos=True)

    def tokens(graphs: bool) -> tuple[dict[BranchId, list[int]], int]:
        engine = HFEngine.from_pretrained(str(LONG.policy_path), device=str(device))
        if graphs:
            graphed(engine, column_bucket)
        for r, q in enumerate(questions):
            engine.prefill(f"q{r}", q.prompt, settings)
            engine.start_branches(f"q{r}", [BranchSpec(j, seed=10 * r + j) for j in range(3)])
        out: dict[BranchId, list[int]] = {}

        def run(count: int) -> None:
            for bid, delta in engine.step(count).deltas.items():
                out.setdefault(bid, []).extend(delta.token_ids)

        run(steps // 3)
        engine.abort([BranchId("q0", 1)])  # the next step rebuilds the rows
        run(steps)
        if graphs and engine.static is None:  # a capture failed: it decoded on without
            raise AssertionError(f"no CUDA graphs: {engine.graphs_failed}")
        captures = engine.static.captures if engine.static is not None else 0
        return out, captures

    (plain, _), (fast, captures) = tokens(False), tokens(True)
    for bid in plain:
        if fast[bid] != plain[bid]:
            first = next(i for i, (a, b) in enumerate(zip(plain[bid], fast[bid])) if a != b)
            raise AssertionError(f"{bid}: tokens over graphs differ from token {first} on")
    count = sum(map(len, plain.values()))
    return (
        f"{count} sampled tokens of {len(plain)} branches identical ({captures} graphs captured)",
        {"tokens": count, "captures": captures},
    )


def step_cost(
    device: Any, counts: list[int], steps: int, graphs: bool = False
) -> tuple[str, dict[str, Any]]:
    from sart.engines.hf import HFEngine
    from sart.messages import BranchSpec
    from sart.testbed import LONG, make_questions
    from sart.types import BranchId, SamplingSettings

    engine = HFEngine.from_pretrained(str(LONG.policy_path), device=str(device))
    if graphs:
        engine.split_cost = None
        graphed(engine)
    settings = SamplingSettings(temperature=1.0, max_tokens=2048, ignore_eos=True)
    out: dict[str, Any] = {}
    for branches in counts:
        questions = make_questions(2, max(1, branches // 8), LONG.difficulties, cycle=LONG.cycle)
        ids = [f"s{branches}-{i}" for i in range(len(questions))]
        for rid, q in zip(ids, questions):
            engine.prefill(rid, q.prompt, settings)
            engine.start_branches(rid, [BranchSpec(j, seed=j) for j in range(branches // len(ids))])
        engine.step(8)  # past the batch's first build (and its graph's capture)
        synchronize(device)
        started = time.perf_counter()
        engine.step(steps)
        synchronize(device)
        ms = 1000 * (time.perf_counter() - started) / steps
        launches = profiled(device, lambda: engine.step(4)) / 4
        # A branch ends: the next step rebuilds the batch of the others.
        engine.abort([BranchId(ids[0], 0)])
        rebuild = profiled(device, lambda: engine.step(1))
        for rid in ids:
            engine.release_prefix(rid)
        out[str(branches)] = {
            "ms_per_step": ms,
            "launches_per_step": launches,
            "launches_per_rebuild_step": rebuild,
        }
    unit = "kernel launches" if device.type == "cuda" else "aten ops"
    detail = "; ".join(
        f"{b} branches {v['ms_per_step']:.2f} ms, {v['launches_per_step']:.0f} {unit} "
        f"({v['launches_per_rebuild_step']:.0f} rebuilding)"
        for b, v in out.items()
    )
    return detail + " a step" + over_budget(engine), out


def over_budget(engine: Any) -> str:
    """What a graphs row must say if some of its steps ran without the buffers (their
    bucket was over the memory budget: ``StaticDecode.over_budget``)."""
    steps = engine.static.over_budget if engine.static is not None else 0
    return f" ({steps} steps over the buffers' memory budget ran without graphs)" * (steps > 0)


def prm_cost(device: Any, counts: list[int]) -> tuple[str, dict[str, Any]]:
    """The long testbed's PRM checking 8, 32 (and 64) branches in one forward each:
    kernel launches (on a CPU: aten operations) per check, from the caches."""
    import random

    from sart.prm.base import ScoreItem
    from sart.prm.hf import QwenMathPRM
    from sart.testbed import LONG, make_question, noisy_trace
    from sart.types import BranchId

    prm = QwenMathPRM.from_pretrained(
        str(LONG.prm_path), device=str(device), **LONG.prm_kwargs(), batch_size=max(counts)
    )
    rng = random.Random(0)
    question = make_question(rng, 8)
    out: dict[str, Any] = {}
    for rows in counts:
        texts = [noisy_trace(question, rng).split(" ") * 4 for _ in range(rows)]

        def check(words: int, rows: int = rows, texts: list = texts) -> list[ScoreItem]:
            return [
                ScoreItem(
                    BranchId(f"c{rows}", j), question.prompt, " ".join(t[:words]), words, False
                )
                for j, t in enumerate(texts)
            ]

        prm.score(check(40))  # fresh rows
        prm.score(check(80))  # from the caches
        synchronize(device)
        started = time.perf_counter()
        prm.score(check(120))
        synchronize(device)
        ms = 1000 * (time.perf_counter() - started)
        launches = profiled(device, lambda: prm.score(check(160)))
        prm.release(f"c{rows}")
        out[str(rows)] = {"launches_per_check": launches, "ms_per_check": ms}
    unit = "kernel launches" if device.type == "cuda" else "aten ops"
    detail = "; ".join(
        f"{r} rows {v['ms_per_check']:.1f} ms, {v['launches_per_check']:,} {unit}"
        for r, v in out.items()
    )
    return detail + " a check", out


def bench(
    device: Any, model: str, requests: int, rate: float, graphs: bool = False
) -> tuple[str, dict[str, Any]]:
    import contextlib
    import io

    from sart.cli import main

    out = io.StringIO()
    argv = [
        "bench", "--engine", "hf", "--device", str(device), "--prm-device", str(device),
        "--model", model, "--requests", str(requests), "--n", "8",
        "--rate", str(rate), "--batch-size", "32", "--methods", "vanilla", "sc", "sart",
        "--json", "--no-plots", "--out", tempfile.mkdtemp(prefix="gpu-check-bench-"),
        *(["--cuda-graphs"] if graphs else []),
    ]  # fmt: skip
    with contextlib.redirect_stdout(out):
        code = main(argv)
    if code:
        raise RuntimeError(f"sart bench exited {code}")
    data = {
        run["method"]: {
            "accuracy": run["summary"]["accuracy"],
            "p50": run["summary"]["e2e"]["p50"],
            "p97": run["summary"]["e2e"]["p97"],
        }
        for run in json.loads(out.getvalue())["runs"]
    }
    detail = "; ".join(
        f"{m} {v['accuracy']:.0%} P50 {v['p50']:.2f} s P97 {v['p97']:.2f} s"
        for m, v in data.items()
    )
    return f"{model}, {requests} requests at {rate:g}/s, N = 8: {detail}", data


def shaped_model(shape: dict[str, int], device: Any, classify: bool = False) -> Any:
    """A random-weight Qwen2-shape model built on ``device`` (bfloat16 on a GPU)."""
    import torch
    from cost_model_check import build_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return build_model(shape, device, dtype, classify=classify)


def weight_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_7b(
    device: Any, shape: dict[str, int], batches: list[int], steps: int, graphs: bool = False
) -> tuple[str, dict[str, Any]]:
    import torch

    from sart.demo_models import build_tokenizer
    from sart.engines.hf import HFEngine
    from sart.messages import BranchSpec
    from sart.types import SamplingSettings

    model = shaped_model(shape, device)
    engine = HFEngine(model, build_tokenizer())
    engine.split_cost = None
    if graphs:
        graphed(engine)
    settings = SamplingSettings(temperature=1.0, max_tokens=steps + 32, ignore_eos=True)
    prompt = list(range(5, 5 + 128))  # token ids: the tokenizer is not the shape's
    from sart.engines.costs import H100, H200

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    # The simulator's datasheet bandwidths, found by the GPU's name ("H100", "H200").
    known = (H100, H200)
    bandwidth = next((a.bandwidth for a in known if a.name.split("-")[0] in name), None)
    bound = None if bandwidth is None else 1000 * weight_bytes(model) / bandwidth
    out: dict[str, Any] = {"weights_gb": weight_bytes(model) / 1e9, "bound_ms": bound}
    for batch in batches:
        rid = f"d{batch}"
        engine.prefill(rid, prompt, settings)
        engine.start_branches(rid, [BranchSpec(j, seed=j) for j in range(batch)])
        engine.step(8)
        synchronize(device)
        started = time.perf_counter()
        engine.step(steps)
        synchronize(device)
        ms = 1000 * (time.perf_counter() - started) / steps
        engine.release_prefix(rid)
        out[str(batch)] = {"ms_per_step": ms, "tokens_per_s": 1000 * batch / ms}
    detail = "; ".join(
        f"batch {b} {v['ms_per_step']:.1f} ms ({v['tokens_per_s']:,.0f} tok/s)"
        for b, v in out.items()
        if isinstance(v, dict)
    )
    if bound is not None:
        detail += f"; weights-read bound {bound:.1f} ms a step"
    return detail + over_budget(engine), out


def prm_7b(device: Any, shape: dict[str, int], branches: int) -> tuple[str, dict[str, Any]]:
    from sart.demo_models import STEP_SEPARATOR, build_tokenizer
    from sart.prm.base import ScoreItem
    from sart.prm.hf import QwenMathPRM
    from sart.types import BranchId

    model = shaped_model(shape, device, classify=True)
    prm = QwenMathPRM(
        model, build_tokenizer(), system_prompt=None, step_separator=STEP_SEPARATOR,
        batch_size=branches, max_length=4096,
    )  # fmt: skip
    steps = [f"step {i}: {i} + {i + 1} = {2 * i + 1}." for i in range(400)]

    def items(count: int) -> list[ScoreItem]:
        return [
            ScoreItem(BranchId("p", j), "add", "\n\n".join(steps[j % 7 : j % 7 + count]), 0, False)
            for j in range(branches)
        ]

    rates = []
    for count in (24, 32):  # fresh, then each branch ~64 tokens longer from its cache
        before = prm.tokens_processed
        synchronize(device)
        started = time.perf_counter()
        rewards = prm.score(items(count))
        synchronize(device)
        rates.append((prm.tokens_processed - before) / (time.perf_counter() - started))
        if not all(0.0 <= r <= 1.0 for r in rewards):
            raise AssertionError(f"rewards outside [0, 1]: {rewards[:4]}")
    data = {"fresh_tokens_per_s": rates[0], "cached_tokens_per_s": rates[1]}
    return (
        f"{branches} branches: {rates[0]:,.0f} PRM tokens/s fresh, {rates[1]:,.0f} from caches",
        data,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["hf"], default="hf")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU (no GPU)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and counts (CI)")
    parser.add_argument("--rate", type=float, default=2.0, help="bench: requests per second")
    parser.add_argument("--requests", type=int, default=40, help="bench: requests")
    parser.add_argument("--json", type=Path, default=None, help="write the checks here")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("FAIL  environment    torch sees no GPU (--allow-cpu runs on the CPU)")
        return 1
    device = torch.device(args.device if torch.cuda.is_available() else "cpu")
    quick = args.quick
    report = Report(width=14, json_path=args.json)
    report.check("environment", lambda: environment(device))
    report.check("conformance", lambda: conformance(device))
    report.check("greedy parity", lambda: greedy_parity(device))
    # Past a column bucket: 256 columns on a GPU; 16 in the quick run.
    report.check("graph parity", lambda: graph_parity(device, *((24, 16) if quick else (300, 256))))
    counts, steps = ([8, 32], 8) if quick else ([8, 32, 64], 64)
    report.check("step cost", lambda: step_cost(device, counts, steps))
    report.check("graph steps", lambda: step_cost(device, counts, steps, graphs=True))
    report.check("prm cost", lambda: prm_cost(device, counts))
    shape = TINY if quick else QWEN_7B
    batches = [1, 8] if quick else [1, 8, 32, 64]
    step7 = 8 if quick else 32
    report.check("7b decode", lambda: decode_7b(device, shape, batches, step7))
    report.check("7b graphs", lambda: decode_7b(device, shape, batches, step7, graphs=True))
    report.check("7b prm", lambda: prm_7b(device, shape, 4 if quick else 32))
    # The benches last: the longest checks, whose time on a given GPU is the least
    # known (a run stopped at its time limit keeps every row before, in --json).
    requests = 8 if quick else args.requests
    bed = "testbed" if quick else "testbed-long"
    rate = 8.0 if quick else args.rate
    report.check("bench", lambda: bench(device, bed, requests, rate))
    if device.type == "cuda":  # --cuda-graphs needs one
        report.check("bench graphs", lambda: bench(device, bed, requests, rate, graphs=True))
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
