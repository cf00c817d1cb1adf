"""Every script in ``benchmarks/`` runs, in a quick mode, as a user runs it.

Each case runs ``python benchmarks/NAME.py ...`` from the repository root in a
subprocess (``OMP_NUM_THREADS=1``), with small arguments (the script's own
flags, or its ``--quick``), and checks that it exits 0 and prints its table:
a benchmark that crashes, or one that runs but measures nothing, fails here
instead of rotting until someone next needs its numbers. Nothing is timed:
the numbers of a quick run mean little, and this machine is shared.

``benchmarks/confidence_auroc.py`` is covered by its own file,
``tests/test_benchmarks_confidence_auroc.py``.

Where a case skips: without the packages it imports (torch, transformers,
math-verify, vLLM), and without ``../shared/data`` (the evaluation data beside
the project, which a user's clone does not have).

The cases that need vLLM are ``test_vllm_benchmark_runs``, apart from the
others, so that CI's vLLM stage (``.ci/run``) selects exactly them by node id
(``tests/test_benchmarks.py::test_vllm_benchmark_runs``): the others run once, in
the main stage, and a developer whose environment has vLLM still runs all of
them with a plain ``pytest``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from adapters import VLLM_ENV

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
MATH500 = ROOT.parent / "shared" / "data" / "math500" / "test.jsonl"
"""What ``grading_cost.py`` and ``math500_agreement.py`` read by default (DEFAULT_DATA)."""

NUMBER = r"[\d.,]+"
COVERED_ELSEWHERE = {"confidence_auroc.py": "tests/test_benchmarks_confidence_auroc.py"}


@attrs.frozen
class Case:
    script: str
    args: str
    """The command line's arguments, split on spaces."""
    expect: tuple[str, ...]
    """Regular expressions (multiline) that must each match the script's stdout."""
    needs: tuple[str, ...] = ()
    """Modules the script imports beyond sart's own dependencies."""
    data: Path | None = None
    timeout: float = 300.0

    @property
    def id(self) -> str:
        first = self.args.split()[0]
        return self.script.removesuffix(".py") + ("" if first.startswith("-") else f"-{first}")


CASES = [
    Case(
        "frontier.py",
        "--quick --out /tmp/sart-frontier-quick.png",
        (
            rf"^\s+2 SART-rebranch 4\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}  ",
            r"^wrote /tmp/sart-frontier-quick.png$",
        ),
    ),
    Case(
        "fork_model.py",
        "--quick",
        (
            r"^\d+ forks from 1 file\(s\)$",
            rf"^fit: intercept -{NUMBER}, slope {NUMBER} \(ForkModel: ",
            rf"^0.60-0.70\s+\d+\s+{NUMBER}\s+{NUMBER}$",
        ),
    ),
    Case(
        "rebranch_variants.py",
        "--requests 12 --n 4 --rate 2 --methods sart rb-softmax rb-balance "
        "--out /tmp/sart-bench-rebranch-variants --no-plots",
        tuple(
            rf"^\s+2\s+{method}\s+4\s+{NUMBER}\s" for method in ("SART", "rb-softmax", "rb-balance")
        ),
    ),
    Case(
        "rebranch_variants.py",
        "--seeds 2 --requests 12 --n 4 --rate 2 --methods sart rb-busy-prune "
        "--out /tmp/sart-bench-rebranch-seeds",
        (
            r"^means over seeds 0-1; P97 ratio and accuracy gain against the first method$",
            rf"^\s+2 sart\s+{NUMBER}\s+\+0\.0\s+{NUMBER}\s+1\.00\s+1\.00\s",
            rf"^\s+2 rb-busy-prune\s+{NUMBER}\s+[+-]{NUMBER}(\s+{NUMBER}){{4}}",
        ),
    ),
    Case(
        "rebranch_variants.py",
        "--seeds 2 --requests 12 --n 4 --rate 2 --cost-model cpu-testbed "
        "--methods sart rb-rows-off rb-agree-off --out /tmp/sart-bench-rebranch-cpu",
        tuple(
            rf"^\s+2 {method}\s+{NUMBER}\s+[+-]{NUMBER}(\s+{NUMBER}){{4}}"
            for method in ("rb-rows-off", "rb-agree-off")
        ),
    ),
    Case(
        "step_cost.py",
        "--requests 12 --n 4 --rate 2 --methods sart-rebranch --out /tmp/sart-bench-step-cost",
        (
            r"^\d+ load views, [1-9]\d* with a fit$",
            rf"^\s+last\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+(\d+|any)$",
        ),
    ),
    Case(
        "scheduler_overhead.py",
        "--batch-sizes 8 16 --intervals 16 --median-length 100",
        (
            r"^\s+B\s+T\s+requests\s+steps\s+us/step\s+peak\s+wall s$",
            rf"^\s+8\s+16\s+4\s+[1-9]\d*\s+{NUMBER}\s+\d+\s+{NUMBER}$",
            rf"^\s+16\s+16\s+8\s+[1-9]\d*\s+{NUMBER}\s+\d+\s+{NUMBER}$",
        ),
    ),
    Case(
        "bench_memory.py",
        "--quick",
        (
            r"^\s+requests\s+runs\s+wall s\s+CPU s\s+CPU ms/req/run\s+peak MB\s+out MB$",
            rf"^\s+20\s+4(\s+{NUMBER}){{3}}\s+[1-9]\d*\s+{NUMBER}$",
            rf"^\s+60\s+4(\s+{NUMBER}){{3}}\s+[1-9]\d*\s+{NUMBER}$",
        ),
    ),
    Case(
        "serve_memory.py",
        "--quick",
        (
            r"^\s+requests\s+RSS MB\s+ms/req\s+gc objects$",
            rf"^\s+100\s+{NUMBER}\s+{NUMBER}\s+\+0$",
            rf"^\s+300\s+{NUMBER}\s+{NUMBER}\s+[+-][\d,]+$",
        ),
        needs=("fastapi", "uvicorn", "openai"),
    ),
    Case(
        "simulator_speed.py",
        "--requests 50 --methods sart sc",
        (
            r"^generated 50 requests x 8 branches in ",
            r"^\s+method\s+wall s\s+requests/s\s+decode calls\s+sim time s$",
            rf"^\s+sart\s+{NUMBER}\s+{NUMBER}\s+[1-9][\d,]*\s+{NUMBER}$",
            rf"^\s+sc\s+{NUMBER}\s+{NUMBER}\s+[1-9][\d,]*\s+{NUMBER}$",
        ),
    ),
    Case(
        "prm_capacity.py",
        "--quick",
        (
            r"^SC / SART at P97, N = 8, 40 requests, rates 4 req/s$",
            r"^tp8, gaokao$",
            rf"^\s+free\s+{NUMBER}\s+{NUMBER}$",
            *(
                rf"^\s+{pricing}, {replicas} x H100\s+{NUMBER}\s+{NUMBER}%\s+{NUMBER}$"
                for pricing in ("reencode", "incremental", "cached")
                for replicas in (1, 2)
            ),
            r"^\s+(smallest within 15% of free: .+|no allocation here is within 15% of the free)",
        ),
    ),
    Case(
        "hf_overhead.py",
        "--n 2 --max-tokens 16 --threads 1",
        (
            r"^\d+ requests, SART n=2, B=16, T=16, max_tokens=16: [1-9]\d* decode steps in ",
            rf"^\s+model forward\s+{NUMBER}\s+{NUMBER}%$",
            rf"^\s*engine \(repack, sample, text\)\s+-?{NUMBER}\s+-?{NUMBER}%$",
            rf"^\s+sart scheduler\s+{NUMBER}\s+{NUMBER}%$",
        ),
        needs=("torch", "transformers"),
    ),
    Case(
        "hf_decode.py",
        "--requests 2 --n 2 --steps 12 --stagger 4 --split-cost 0",
        (
            r"^long testbed, 2 requests x 2 branches, 12 steps, 4 steps apart \(max_tokens 2048\)"
            r", torch threads 1, split cost 0$",
            rf"^\s+split by length\s+12\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}%\s+{NUMBER}$",
            rf"^\s+one batch\s+12\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}%\s+{NUMBER}$",
            rf"^\s+transformers cache\s+12\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}%\s+{NUMBER}$",
            rf"^\s+own buffers\s+12\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}%\s+{NUMBER}$",
            rf"^same tokens: yes; split by length is faster by {NUMBER}x one batch's, "
            rf"{NUMBER}x transformers cache's, {NUMBER}x own buffers's$",
        ),
        needs=("torch", "transformers"),
    ),
    Case(
        "grading_cost.py",
        "--problems 5",
        (
            rf"^grade \(main thread\)\s+median\s+{NUMBER} ms\s+mean\s+{NUMBER} ms",
            r"^same, different answers, warm\s+median ",
            r"^same, fraction vs decimal, cold\s+median ",
            rf"^worker start \(spawn\)\s+{NUMBER} ms once$",
            r"^grade from a thread\s+median ",
            r"^vote n=64, 4 answers\s+median ",
        ),
        needs=("math_verify",),
        data=MATH500,
    ),
    Case(
        "math500_agreement.py",
        "--quick",
        (
            r"^self-verification: \d+/20",
            r"^rewrites failing: \{'sentence': \d+, .*'inline math': \d+\}$",
            r"^cross pairs: \d+ of 380 ordered pairs of different answers verify .* 2 processes",
        ),
        needs=("math_verify",),
        data=MATH500,
    ),
    Case(
        "prm_batching.py",
        "--branches 1 2 --warm 16 --new 4 --checks 1 --repeats 1",
        (
            r"^testbed PRM, torch threads 1; responses 16 -> 20 tokens",
            rf"^\s*one-by-one\s+2\s+{NUMBER}\s+{NUMBER}\s+2\.0\s+{NUMBER}$",
            rf"^\s*batched\s+2\s+{NUMBER}\s+{NUMBER}\s+1\.0\s+{NUMBER}$",
        ),
        needs=("torch", "transformers"),
    ),
    Case(
        "prm_cost.py",
        "--lengths 300 --intervals 100 --strides 1 32 --context-limit 128",
        (
            r"^synthetic response: \d+ tokens, \d+ steps; PRM context 600$",
            rf"^\s+100\s+300\s+3\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$",
            r"^context limit 128, incremental, L = 300$",
            rf"^\s+100\s+1\s+{NUMBER}$",
            rf"^\s+100\s+32\s+{NUMBER}$",
        ),
        needs=("torch", "transformers"),
    ),
    Case(
        "prm_window.py",
        "quality --quick",
        (
            r"^64 branches: [\d.]+ generated tokens on average",
            r"^\s+window\s+seen 50%\s+AUROC 50%\s+AUROC 100%\s+best-of-8$",
            *(rf"^\s+{w}(\s+(nan|[\d.]+)){{4}}$" for w in ("full", 64, 32, 16, 8)),
        ),
        needs=("torch", "transformers"),
    ),
    Case(
        "testbed_prm_ablation.py",
        "--quick",
        (
            r"^judge\s+AUROC 50%\s+AUROC 100%\s+best-of-8$",
            *(
                rf"^{re.escape(judge)}(\s+(nan|[\d.]+)){{3}}$"
                for judge in (
                    "hidden state",
                    "likelihood",
                    "all features",
                    "shipped PRM",
                    "oracle: on track",
                    "oracle: on track + ahead",
                )
            ),
            r"^branch accuracy [\d.]+; \d+ s$",
        ),
        needs=("torch", "transformers"),
    ),
]

VLLM_CASES = [
    Case(
        "prm_window.py",
        "cost --lengths 256 --intervals 128 --windows 64",
        (
            r"^synthetic response: \d+ tokens; question prefix \d+ tokens$",
            r"^\s+T\s+L\s+checks\s+hf incr\s+vLLM full\s+W=64\s+vLLM s$",
            rf"^\s+128\s+256\s+2(\s+{NUMBER}){{4}}$",
        ),
        needs=("vllm", "torch", "transformers"),
        timeout=600,
    ),
    Case(
        "prm_cached.py",
        "--quick",
        (
            r"^synthetic response: \d+ tokens; vLLM prefix-cache blocks: 32 tokens$",
            r"^\s+T\s+L\s+step \(re-encode\)\s+cached \(vLLM\)\s+hf incremental$",
            # One row in each table: the whole branch, then past the context.
            rf"^\s+128\s+512(\s+{NUMBER}){{3}}\n\n"
            r"Past a 256-token context: the window's start moves in strides of 64 tokens.*\n"
            rf".*\n\s+128\s+512(\s+{NUMBER}){{3}}$",
        ),
        needs=("vllm", "torch", "transformers"),
        timeout=600,
    ),
    Case(
        "vllm_overhead.py",
        "--part all --eager --batch-size 2 --max-tokens 8 --repeats 1 --interval 4 "
        "--n 2 --requests 2 --gen-tokens 8 --rate 50 --prune-interval 4",
        (
            r"^vLLM import [\d.]+ s, engine start [\d.]+ s \(eager",
            rf"^\s+raw vLLM LLMEngine\s+{NUMBER} tokens/s$",
            rf"^\s+through sart\s+{NUMBER} tokens/s\s+ratio {NUMBER}",
            rf"^\s+sart's own time\s+-?{NUMBER} ms per decode step",
            *(
                rf"^\s+{re.escape(method)}\s+2(\s+{NUMBER}){{4}}\s"
                for method in (
                    "SC, vLLM n=N final",
                    "SC, vLLM n=N delta",
                    "SC through sart",
                    "SART, hf PRM",
                    "SART, hash PRM",
                )
            ),
            r"^\s+SC native and SC through sart generated the same branch lengths",
        ),
        needs=("vllm", "torch", "transformers"),
        timeout=600,
    ),
    Case(
        "gateway_overhead.py",
        # One level: each run starts vLLM's load generator, 20 s of imports on CI.
        "--prompts 16 --concurrency 4 --repeats 1 --output-len 16 --pin "
        "--plot /tmp/sart-gateway-overhead-quick.png",
        (
            *(
                r"^vllm serve and sart serve --engine openai --method vanilla in front of it: 16 "
                rf"prompts, {level} in flight.*; vllm serve on CPU \d+, the rest on \[[\d, ]+\]$"
                for level in (4,)
            ),
            rf"^\s+direct(\s+{NUMBER}){{7}}$",
            rf"^\s+through sart(\s+{NUMBER}){{7}}$",
            r"^figure: /tmp/sart-gateway-overhead-quick.png$",
            rf"^gateway / direct throughput {NUMBER}; added latency TTFT [+-]{NUMBER} ms, "
            rf"P50 [+-]{NUMBER} ms, P99 ",
            r"^CPU \[[\d, ]+\] busy during the load: direct (\d+|nan)%, through sart (\d+|nan)%; "
            r"the client .* allow at most .* req/s through sart \(.* of it reached\)$",
        ),
        needs=("vllm", "torch", "transformers", "httpx", "fastapi"),
        timeout=900,
    ),
    Case(
        "gateway_upstream.py",
        "--prompts 8 --concurrency 4 --output-len 8 --repeats 1",
        (
            r"^vllm serve: 8 streamed completions, 4 in flight, 32 in / 8 out tokens, median of 1$",
            *(
                rf"^\s+{re.escape(name)}(\s+{NUMBER}){{3}}$"
                for name in (
                    "fields bare",
                    "fields all: the gateway's body",
                    "client httpx pool",
                    "client httpx + aiohttp",
                    "client aiohttp",
                )
            ),
        ),
        needs=("vllm", "torch", "transformers", "httpx", "aiohttp"),
        timeout=600,
    ),
    Case(
        "gateway_sart.py",
        "--requests 3 --rate 2 --n 2 --max-tokens 32 --pin",
        (
            r"^SART N=2 on the long testbed: 3 requests at 2 req/s \(Poisson, seed 0\), B = 32; "
            r"the same vLLM engine arguments; VLLM::\w+(, VLLM::\w+)* on CPU \d+, "
            r"the rest on \[[\d, ]+\]$",
            rf"^\s+in process(\s+{NUMBER}){{4}}$",
            rf"^\s+gateway(\s+{NUMBER}){{4}}$",
            rf"^gateway / in process P97 {NUMBER}$",
        ),
        needs=("vllm", "torch", "transformers", "httpx", "fastapi", "openai"),
        timeout=900,
    ),
    Case(
        "gateway.py",
        "--n 2 --requests 2 --prompt-words 40 --max-tokens 4 --width 2 --repeats 1 --burners 1 "
        "--kill-tokens 3000 --kill-after 1",
        (
            r"^servers http://\S+ http://\S+; N=2, 2 requests of ~40 words$",
            r"^placement=request hits .*; servers per request 1\.00; ",
            r"^placement=branch  hits .*; servers per request [\d.]+; ",
            r"^placement=one     hits .* \(per server [\d.]+\); generated tokens on the "
            r"busier server 100\.0%; servers per request 1\.00; ",
            *(
                rf"^abort {how} burners={burners}: tokens per aborted branch after the call "
                for how in ("disconnect", "explicit  ")
                for burners in (0, 1)
            ),
            r"^kill the second server after 1 s: its requests \d+ failed, \d+ completed; the "
            r"other server's 0 failed, \d+ completed$",
        ),
        needs=("vllm", "torch", "transformers", "httpx"),
        timeout=600,
    ),
]


def run(case: Case, env: dict[str, str] | None = None) -> str:
    """Run ``case`` as a user would; its stdout once it has exited 0 and printed
    every line ``case.expect`` asks for."""
    for module in case.needs:
        pytest.importorskip(module)
    if case.data is not None and not case.data.exists():
        pytest.skip(f"{case.data} is absent (../shared/data is beside the project, not in a clone)")
    done = subprocess.run(
        [sys.executable, f"benchmarks/{case.script}", *case.args.split()],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=case.timeout,
    )
    shown = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"{case.script} exited {done.returncode}\n{shown}"
    missing = [p for p in case.expect if not re.search(p, done.stdout, re.MULTILINE)]
    assert not missing, f"{case.script} did not print lines matching {missing}\n{shown}"
    return done.stdout


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_benchmark_runs(case: Case) -> None:
    run(case)


@pytest.mark.parametrize("case", VLLM_CASES, ids=lambda c: c.id)
def test_vllm_benchmark_runs(case: Case) -> None:
    # vLLM in this process, unpinned: how the scripts' docstrings run them on CPU.
    run(case, env={**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": "nobind"})


def test_every_benchmark_script_has_a_quick_run() -> None:
    """A new script in benchmarks/ gets a case here (or its own test file)."""
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    covered = {c.script for c in [*CASES, *VLLM_CASES]} | COVERED_ELSEWHERE.keys()
    assert scripts == covered
    for path in COVERED_ELSEWHERE.values():
        assert (ROOT / path).exists(), path
