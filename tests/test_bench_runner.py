"""The benchmark runner's PRM: free or priced, blocking or overlapped, own or shared device."""

from __future__ import annotations

import attrs
import pytest

import sart
from sart.bench import workloads
from sart.bench.runner import BenchConfig, RunRecord, run_bench, run_method, sim_prm, traces
from sart.types import Scoring

#: The gaokao preset before it was refitted to real rollouts (sart.rollouts).
RECORDED_GAOKAO = attrs.evolve(
    workloads.GAOKAO, branch_sigma=0.55, sigma_spread=0.0, overthink=0.0, loop_share=0.0
)

SMALL = BenchConfig(methods=("sart",), ns=(4,), rates=(4.0,), num_requests=30)


def run(**changes: object) -> RunRecord:
    (record,) = run_bench(attrs.evolve(SMALL, **changes))
    return record


def test_the_default_prices_a_re_encoding_prm_on_its_own_device_overlapped() -> None:
    config = BenchConfig()
    assert (config.prm_cost, config.prm_placement, config.scoring) == (
        "reencode",
        "own",
        Scoring.OVERLAPPED,
    )
    # The steps model has no seconds to price a PRM in; a real engine's PRM is real.
    assert BenchConfig(cost="steps").prm_cost == "free"
    real = BenchConfig(engine="hf", model="m")
    assert (real.prm_cost, real.prm_placement) == (None, None)


def test_fields_a_source_does_not_use_default_to_none() -> None:
    replay = BenchConfig(trace="t.jsonl")
    assert (replay.workload, replay.rates, replay.num_requests) == (None, None, None)
    real = BenchConfig(engine="hf", model="m")
    assert (real.workload, real.rates, real.num_requests) == (None, (1.0, 4.0), 200)
    generated = BenchConfig()
    assert (generated.workload, generated.rates, generated.num_requests) == (
        "gaokao",
        (1.0, 4.0),
        200,
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prm_cost": "cheap"}, "prm_cost='cheap' must be one of ('free', 'incremental'"),
        ({"prm_placement": "gpu1"}, "prm_placement='gpu1' must be one of ('own', 'shared')"),
        ({"cost": "steps", "prm_cost": "reencode"}, "prm_cost='reencode' must be 'free' under"),
        ({"engine": "hf", "prm_cost": "free"}, "prm_cost='free' must be None for a real engine"),
        ({"scoring": "lazy"}, "scoring='lazy' must be one of 'blocking', 'overlapped'"),
        ({"poll_steps": 0}, "poll_steps=0 must be None or >= 1"),
        ({"prm_replicas": 0}, "prm_replicas=0 must be an int >= 1"),
        ({"prm_gpu": "tpu"}, "prm_gpu='tpu' must be None or one of"),
        (
            {"prm_placement": "shared", "prm_replicas": 2},
            "prm_placement='shared' must be 'own' with prm_replicas > 1",
        ),
        # Only the fields the run uses are set (results.json records the config).
        ({"trace": "t.jsonl", "rates": (1.0,)}, "rates=(1.0,) has no effect with a trace"),
        ({"trace": "t.jsonl", "num_requests": 5}, "num_requests=5 has no effect with a trace"),
        ({"trace": "t.jsonl", "workload": "gaokao"}, "workload='gaokao' has no effect with a"),
        ({"engine": "hf", "workload": "gaokao"}, "workload='gaokao' has no effect on engine"),
        ({"engine": "hf", "trace": "t.jsonl"}, "trace='t.jsonl' must be None unless engine='sim'"),
        ({"workload": None}, "workload=None: a simulated run needs a workload or a trace"),
        ({"num_requests": None}, "num_requests=None must be >= 1"),
    ],
)
def test_bad_prm_settings_name_the_field(changes: dict, message: str) -> None:
    with pytest.raises(sart.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BenchConfig(**changes)


@pytest.mark.parametrize("scoring", ["blocking", "overlapped"])
def test_a_free_prm_reproduces_the_numbers_from_before_prm_pricing(
    scoring: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pinned from the commit before the PRM was priced (its default: a free ScriptedPRM),
    # on gaokao as it was then; Rebase's re-pinned when forks began to sample their
    # own continuations (TraceScript.fork); the fitted ForkModel moved them, and the
    # generated presets' leaving it (Trace.fork_model=None) moved them back.
    monkeypatch.setitem(workloads.WORKLOADS, "gaokao", RECORDED_GAOKAO)
    config = attrs.evolve(SMALL, methods=("sart", "rebase"), prm_cost="free", scoring=scoring)
    sart_run, rebase_run = run_bench(config)
    assert sart_run.summary.e2e.p97 == 182.28820529989483
    assert sart_run.summary.tokens_per_request == 8977.533333333333
    assert rebase_run.summary.e2e.p97 == 385.7872334046033
    assert rebase_run.summary.makespan == 393.3240624046033
    assert (sart_run.prm_busy, sart_run.prm_wait, sart_run.prm_tokens) == (0.0, 0.0, None)


def test_blocking_on_a_priced_prm_is_slower_than_overlapped() -> None:
    overlapped, blocking = run(), run(scoring="blocking")
    assert blocking.summary.e2e.p97 > overlapped.summary.e2e.p97
    assert blocking.summary.e2e.p50 > overlapped.summary.e2e.p50
    # Its own device and overlapped: decoding never waits; blocking: every PRM second is lost.
    assert overlapped.prm_busy > 0 and overlapped.prm_wait == 0.0
    assert blocking.prm_wait == pytest.approx(blocking.prm_busy, rel=0.02)
    assert blocking.summary.prm_wait.mean > 0 == overlapped.summary.prm_wait.max
    waits = [r.prm_wait_seconds for r in blocking.results]
    assert blocking.summary.prm_wait.mean == pytest.approx(sum(waits) / len(waits))


def test_a_prm_sharing_the_policys_device_holds_decoding_up_like_blocking() -> None:
    shared, blocking = run(prm_placement="shared"), run(scoring="blocking")
    assert shared.prm_wait > 0
    assert [r.timings for r in shared.results] == [r.timings for r in blocking.results]


def test_incremental_reads_fewer_tokens_than_re_encoding() -> None:
    reencode, incremental = run(), run(prm_cost="incremental")
    assert reencode.prm_tokens is not None and incremental.prm_tokens is not None
    # Not by L / (2T): gaokao's branches run to thousands of tokens, and one past the
    # PRM's 4096-token context re-encodes its moving window at every check (measured
    # 0.71x).
    assert incremental.prm_tokens < 0.8 * reencode.prm_tokens
    assert incremental.prm_busy < reencode.prm_busy


def test_poll_steps_reaches_the_scheduler() -> None:
    coarse, default = run(poll_steps=SMALL.interval), run()
    # Chunks are no longer cut while a PRM call is in flight: fewer, longer decodes.
    assert len(coarse.timeline) < len(default.timeline)


def test_the_pricer_forgets_every_request_by_the_end_of_a_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sart.bench import runner

    pricers = []

    def spy(config: BenchConfig, prm: object) -> tuple:
        priced, pricer = sim_prm(config, prm)  # type: ignore[arg-type]
        pricers.append(pricer)
        return priced, pricer

    monkeypatch.setattr(runner, "sim_prm", spy)
    run_bench(attrs.evolve(SMALL, prm_cost="incremental", methods=("sart", "rebase")))
    assert len(pricers) == 2 and all(p.tokens > 0 for p in pricers)
    assert all(p._cached == {} for p in pricers)  # released with each request's prefix


def test_sart_blocking_runs_blocking_checks_beside_overlapped_sart() -> None:
    from sart.bench.report import ratios

    config = attrs.evolve(SMALL, methods=("sc", "sart", "sart-blocking"))
    sc, overlapped, blocking = run_bench(config)
    assert (overlapped.prm_wait, blocking.method) == (0.0, "sart-blocking")
    # Every call stalls the branches that are running (a call with none holds none up).
    assert 0.9 * blocking.prm_busy < blocking.prm_wait <= blocking.prm_busy
    assert blocking.summary.e2e.p97 > overlapped.summary.e2e.p97
    # With blocking as the run's default, the two rows serve alike.
    same = run_bench(attrs.evolve(config, scoring="blocking"))
    assert same[1].results == same[2].results
    (row,) = ratios([sc, overlapped, blocking])
    assert row["sart_blocking_over_sart"] == pytest.approx(
        blocking.summary.e2e.p97 / overlapped.summary.e2e.p97
    )
    assert row["sc_over_sart_blocking"] == pytest.approx(
        sc.summary.e2e.p97 / blocking.summary.e2e.p97
    )


def test_preemption_is_counted_and_only_changes_time() -> None:
    # SC at N=8 on h100-14b outgrows the KV cache at 4 req/s (the table's "!" before
    # preemption was modelled).
    config = BenchConfig(methods=("sc",), ns=(8,), rates=(4.0,), num_requests=200)
    ((rate, trace),) = traces(config)
    modelled = run_method(trace, "sc", 8, config, rate)
    unlimited = run_method(trace, "sc", 8, attrs.evolve(config, preemption=False), rate)
    assert modelled.preemptions and modelled.preemptions > 0
    assert unlimited.preemptions == 0
    assert (
        modelled.summary.peak_kv_tokens <= modelled.kv_capacity < unlimited.summary.peak_kv_tokens
    )
    # The same answers, later.
    assert [r.answer for r in modelled.results] == [r.answer for r in unlimited.results]
    assert modelled.summary.e2e.p97 > unlimited.summary.e2e.p97


def test_an_overflow_inside_a_decode_call_is_marked_though_the_timeline_misses_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two 100-token branches of a 10-token prompt decode in one call (T = 400), on an
    engine with room for 150 KV tokens: they need 210 at their last step and are freed
    at the call's end, so no sample of the timeline sees more than the prompt."""
    from rich.console import Console

    from sart.bench.report import render
    from sart.bench.traces import Trace, TraceRequest
    from sart.engines import costs
    from sart.engines.scripts import BranchScript

    small = attrs.evolve(costs.STEPS, name="small", kv_capacity_tokens=150)
    monkeypatch.setitem(costs.PRESETS, "small", small)
    two = tuple(BranchScript(length=100, answer="1", filler="") for _ in range(2))
    trace = Trace.of(
        [TraceRequest(id="a", arrival=0.0, answer="1", branches=two, prompt_tokens=10)]
    )
    config = BenchConfig(
        cost="small", methods=("sc",), ns=(2,), interval=400, batch_size=2, preemption=False
    )
    record = run_method(trace, "sc", 2, config, None)
    assert record.summary.peak_kv_tokens <= 150 < 210
    assert record.kv_overflowed and record.over_capacity
    render(config, [record], Console(width=200))
    assert "KV above the model's KV capacity" in capsys.readouterr().out
    # With preemption (the default) the engine keeps within its cache instead.
    kept = run_method(trace, "sc", 2, attrs.evolve(config, preemption=True), None)
    assert kept.preemptions and not kept.over_capacity


def test_replicas_serve_every_request_once_and_share_the_load() -> None:
    config = BenchConfig(methods=("sc",), ns=(8,), rates=(4.0,), num_requests=120)
    ((rate, trace),) = traces(config)
    one = run_method(trace, "sc", 8, config, rate)
    four = run_method(trace, "sc", 8, attrs.evolve(config, replicas=4), rate)
    assert [r.request_id for r in four.results] == [r.id for r in trace]
    assert all(r.ok for r in four.results)
    # Four budgets and four KV caches: far less queueing at the same arrivals.
    assert four.summary.queueing.mean < one.summary.queueing.mean / 2
    assert four.summary.e2e.p97 < one.summary.e2e.p97
    # Each replica's timeline stays within its own budget.
    assert max(s.running_branches for s in four.timeline) <= four.batch_size


def test_replicas_must_be_positive() -> None:
    with pytest.raises(sart.ConfigError, match="replicas=0 must be >= 1"):
        BenchConfig(replicas=0)


def test_prm_replicas_score_side_by_side_in_the_simulator() -> None:
    # The paper's 8 H100s as one engine outrun one re-encoding PRM H100: checks land
    # late and branches run on. Two replicas keep two checks in flight.
    from sart.bench.runner import run_bench

    def sart_p97(replicas: int) -> tuple[float, float]:
        config = BenchConfig(
            cost="8xh100-14b-tp8", methods=("sart",), ns=(8,), rates=(4.0,),
            num_requests=60, prm_replicas=replicas,
        )  # fmt: skip
        (record,) = run_bench(config)
        return record.summary.e2e.p97, record.summary.tokens_per_request

    one, two = sart_p97(1), sart_p97(2)
    assert two[0] < one[0] and two[1] < one[1]


def test_request_usage_lists_the_requests_in_their_order() -> None:
    # The engine reports its open prefixes as a set, whose order follows the string
    # hash's seed: keyed in that order, runs.jsonl differed from one run to the next.
    record = run()
    ids = [result.request_id for result in record.results]
    assert list(record.request_usage) == [rid for rid in ids if rid in record.request_usage]
    assert len(record.request_usage) == len(ids)
