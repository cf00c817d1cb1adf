"""Decode steps over the engine's own buffers (``sart.engines.hf_graphs``).

What a CUDA graph replays, run here without the capture (no GPU in CI): the same
tokens and log-probabilities as the engine's default path on a mix of requests,
forks, aborts, pauses and resumes, through rebuilds in place, padded rows, column
buckets crossed and buffers that grow. The capture itself runs only on a GPU
(``scripts/gpu_check.py --engine hf``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import examples

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sart.engines.hf import HFEngine  # noqa: E402
from sart.engines.hf_graphs import StaticDecode, row_bucket, supported  # noqa: E402
from sart.errors import ConfigError  # noqa: E402
from sart.messages import BranchSpec  # noqa: E402
from sart.types import BranchId, SamplingSettings  # noqa: E402
from test_engines_hf_kv import FORWARDS, _same_branches, _serve  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tokenizer(demo_models: dict[str, Path]) -> tuple[object, object]:
    loaded = HFEngine.from_pretrained(str(demo_models["policy"]), dtype=torch.float32)
    return loaded.model, loaded.tokenizer


def test_rows_are_padded_to_the_next_power_of_two() -> None:
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]


@pytest.mark.parametrize("column_bucket", [8, 256])
def test_static_buffers_give_the_default_paths_tokens(
    model_and_tokenizer: tuple[object, object], column_bucket: int
) -> None:
    # 8 columns a bucket: the batch crosses buckets every few steps and its buffers
    # grow several times; 256: one bucket, padded rows (5 branches in 8 rows).
    made: list[StaticDecode] = []

    def static(engine: HFEngine) -> None:
        engine.static = StaticDecode(engine.model, capture=False, column_bucket=column_bucket)
        made.append(engine.static)

    fast = _serve(*model_and_tokenizer, in_place=True, setup=static)
    reference = _serve(*model_and_tokenizer, in_place=True)
    assert fast[FORWARDS][0] == 4  # three prefills and a resume: no step went by _forward
    _same_branches(fast, reference)
    assert len(fast[BranchId("a", 3)][0]) > 6 and len(fast[BranchId("a", 1)][0]) == 40
    columns = made[0].kv[0][0].shape[2]
    assert columns >= 40 and (columns % column_bucket == 0)


def _position_bytes(model: object) -> int:
    """Bytes of KV one row takes per column in the buffers (float32 model)."""
    config = model.config  # type: ignore[attr-defined]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4


def test_steps_over_the_memory_budget_decode_by_the_default_path(
    model_and_tokenizer: tuple[object, object],
) -> None:
    # Buffers may hold 4 rows x 32 columns: the mix's wider and longer steps go by
    # the default path from wherever the spans are, and back to the buffers when the
    # batch fits again (its rows rebuilt from the step batches): the same tokens.
    made: list[StaticDecode] = []
    budget = 4 * 32 * _position_bytes(model_and_tokenizer[0])

    def static(engine: HFEngine) -> None:
        engine.static = StaticDecode(engine.model, capture=False, column_bucket=8, max_bytes=budget)
        made.append(engine.static)

    fast = _serve(*model_and_tokenizer, in_place=True, setup=static)
    reference = _serve(*model_and_tokenizer, in_place=True)
    over = made[0].over_budget
    # Some steps by each path: beyond the 3 prefills and a resume, one forward by the
    # default path per step over budget, and fewer of those than the steps in all.
    assert 0 < fast[FORWARDS][0] - 4 == over < reference[FORWARDS][0] - 4
    assert sum(k.nbytes + v.nbytes for k, v in made[0].kv) <= budget
    _same_branches(fast, reference)


def test_the_budget_is_lowered_to_what_ran_out_of_memory(
    model_and_tokenizer: tuple[object, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = HFEngine(*model_and_tokenizer)
    static = engine.static = StaticDecode(engine.model, capture=False, column_bucket=8)
    settings = SamplingSettings(temperature=1.0, max_tokens=30, ignore_eos=True)
    engine.prefill("a", "Step 1: add 3 and 4.", settings)
    engine.start_branches("a", [BranchSpec(i, seed=i) for i in range(3)])
    engine.step(2)
    assert static.over_budget == 0 and static.max_bytes is None
    real = torch.Tensor.new_zeros

    def out_of_memory(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (planted)")

    monkeypatch.setattr(torch.Tensor, "new_zeros", out_of_memory)
    deltas = engine.step(20).deltas  # crosses the 8-column buckets: the buffers grow
    monkeypatch.setattr(torch.Tensor, "new_zeros", real)
    assert static.over_budget >= 1 and static.max_bytes is not None
    assert static.max_bytes < 4 * 24 * _position_bytes(engine.model)
    assert all(len(delta.token_ids) == 20 for delta in deltas.values())
    engine.release_prefix("a")


def test_static_buffers_keep_the_batch_between_steps(
    model_and_tokenizer: tuple[object, object],
) -> None:
    # A steady step writes one column; only a change in the live branches rebuilds.
    engine = HFEngine(*model_and_tokenizer)
    static = engine.static = StaticDecode(engine.model, capture=False, column_bucket=64)
    fills = [0]
    import sart.engines.hf_graphs as module

    real = module.fill

    def counted(*args: object, **kwargs: object) -> None:
        fills[0] += 1
        real(*args, **kwargs)  # type: ignore[arg-type]

    module.fill = counted  # type: ignore[assignment]
    try:
        settings = SamplingSettings(temperature=1.0, max_tokens=30, ignore_eos=True)
        engine.prefill("a", "Step 1: add 3 and 4.", settings)
        engine.start_branches("a", [BranchSpec(index=i, seed=i) for i in range(3)])
        engine.step(10)
        assert fills[0] == 1
        engine.abort([BranchId("a", 2)])
        engine.step(5)
        assert fills[0] == 2
        assert static.kv[0][0].shape[0] == 4  # three rows, padded to four; never shrunk
    finally:
        module.fill = real
    engine.release_prefix("a")


def test_cuda_graphs_need_a_cuda_device(model_and_tokenizer: tuple[object, object]) -> None:
    with pytest.raises(ConfigError, match=r"cuda_graphs=True needs a CUDA device.*cpu"):
        HFEngine(*model_and_tokenizer, cuda_graphs=True)


def test_sliding_window_models_are_not_supported() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    def model(**extra: object) -> object:
        config = AutoConfig.for_model(
            "qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, vocab_size=64, **extra,
        )  # fmt: skip
        return AutoModelForCausalLM.from_config(config)

    assert supported(model())
    sliding = model(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert not supported(sliding)


def test_a_graphed_steps_work_outside_its_graph_does_not_grow_with_the_branches() -> None:
    # What a CUDA graph leaves to launch one by one: sampling, the inputs' upload, the
    # logits' copy. Counted on a CPU as aten operations: the step's minus the forward's
    # (what the graph captures), at 8 and 32 branches of the long testbed.
    from torch.profiler import ProfilerActivity, profile

    from sart.testbed import LONG, make_questions

    def counted(run: object) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()  # type: ignore[operator]
        return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))

    def outside(branches: int) -> float:
        engine = HFEngine.from_pretrained(str(LONG.policy_path))
        static = engine.static = StaticDecode(engine.model, capture=False)
        settings = SamplingSettings(temperature=1.0, max_tokens=2048, ignore_eos=True)
        questions = make_questions(1, branches // 8, LONG.difficulties, cycle=LONG.cycle)
        for i, q in enumerate(questions):
            engine.prefill(f"r{i}", q.prompt, settings)
            engine.start_branches(f"r{i}", [BranchSpec(j, seed=j) for j in range(8)])
        engine.step(3)
        step = counted(lambda: engine.step(4)) / 4
        bucket = (static.kv[0][0].shape[0], static.column_bucket)
        with torch.inference_mode():
            graph = counted(lambda: static._forward(*bucket, static._cache(*bucket)))
        assert graph > 5 * (step - graph)  # most of a step is in the graph
        return step - graph

    few, many = outside(8), outside(32)
    assert few == many and many <= 150, (few, many)


def test_a_capture_that_fails_leaves_the_engine_decoding_without_graphs(
    model_and_tokenizer: tuple[object, object],
) -> None:
    # Here the capture fails for want of CUDA; on a GPU a model that reads a tensor
    # back mid-forward would. The run goes on without graphs, from the same KV.
    engines: list[HFEngine] = []

    def failing(engine: HFEngine) -> None:
        engine.static = StaticDecode(engine.model, capture=True)
        engines.append(engine)

    with pytest.warns(RuntimeWarning, match="CUDA graph failed.*decoding without CUDA graphs"):
        fast = _serve(*model_and_tokenizer, in_place=True, setup=failing)
    reference = _serve(*model_and_tokenizer, in_place=True)
    _same_branches(fast, reference)
    assert engines[0].static is None
    assert "capturing the decode forward at 8 rows x 256 columns" in str(engines[0].graphs_failed)


def test_the_forward_a_graph_captures_reads_nothing_back_to_the_host() -> None:
    # A capture fails on a read back (.item(), a truth test of a tensor, nonzero) or
    # an upload of host data (torch.tensor): on a CPU they show as these operations.
    # transformers' own mask building tests a 2D mask with .all(): the 4D mask built
    # in the graph skips it.
    from torch.profiler import ProfilerActivity, profile

    from sart.testbed import LONG, make_questions

    engine = HFEngine.from_pretrained(str(LONG.policy_path))
    static = engine.static = StaticDecode(engine.model, capture=False)
    settings = SamplingSettings(temperature=1.0, max_tokens=2048, ignore_eos=True)
    question = make_questions(1, 1, LONG.difficulties, cycle=LONG.cycle)[0]
    engine.prefill("r", question.prompt, settings)
    engine.start_branches("r", [BranchSpec(j, seed=j) for j in range(3)])
    engine.step(3)
    bucket = (static.kv[0][0].shape[0], static.column_bucket)
    with torch.inference_mode():
        cache = static._cache(*bucket)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            static._forward(*bucket, cache)
    ops = {e.key for e in prof.key_averages()}
    host = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero"}
    assert "aten::index_copy_" in ops and not ops & (host | {"aten::lift_fresh"}), ops & host


# A schedule of engine calls, drawn: the default path, the graphs' buffers (rebuilt in
# place, small column buckets) and transformers' own cache must report the same deltas.
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(1, 3)),
        st.tuples(st.just("fork"), st.integers(0, 50)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("pause"), st.integers(0, 50)),
        st.tuples(st.just("resume"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 6)),
    ),
    min_size=3,
    max_size=14,
)
_PROMPTS = ("Step 1: add 3 and 4.", "Q: 12 + 7 - 3 =", "Step 2: check it", "1 2 3 4 5 6 7 8 9")


@given(ops=_OPS)
@settings(max_examples=examples(100), deadline=None)
def test_any_schedule_gives_the_default_paths_deltas(
    model_and_tokenizer: tuple[object, object], ops: list[tuple[str, int]]
) -> None:
    plain = HFEngine(*model_and_tokenizer)
    fast = HFEngine(*model_and_tokenizer)
    fast.static = StaticDecode(fast.model, capture=False, column_bucket=8)
    copied = HFEngine(*model_and_tokenizer)  # transformers' own cache, rebuilt every step
    copied.in_place = False
    tight = HFEngine(*model_and_tokenizer)  # buffers of 4 x 24 at most: both paths in turn
    budget = 4 * 24 * _position_bytes(tight.model)
    tight.static = StaticDecode(tight.model, capture=False, column_bucket=8, max_bytes=budget)
    others = (fast, copied, tight)
    settings_ = SamplingSettings(temperature=1.0, max_tokens=24, logprobs=1)
    requests: dict[str, int] = {}  # request -> branches started
    paused: list[BranchId] = []

    def live() -> list[BranchId]:
        return sorted(plain._ledger.branches)

    def both(call: str, *args: object) -> None:
        for engine in (plain, *others):
            getattr(engine, call)(*args)

    for op, arg in ops:
        if op == "start":
            rid = f"r{len(requests)}"
            both("prefill", rid, _PROMPTS[len(requests) % len(_PROMPTS)], settings_)
            both(
                "start_branches",
                rid,
                [BranchSpec(i, seed=7 * len(requests) + i) for i in range(arg)],
            )
            requests[rid] = arg
        elif op == "fork" and live():
            parent = live()[arg % len(live())]
            index = requests[parent.request_id]
            requests[parent.request_id] += 1
            both(
                "start_branches",
                parent.request_id,
                [BranchSpec(index, seed=99 + index, parent=parent.index)],
            )
        elif op in ("abort", "pause") and live():
            target = live()[arg % len(live())]
            both(op, [target])
            if op == "pause":
                paused.append(target)
        elif op == "resume" and paused:
            target = paused.pop(arg % len(paused))
            if target.request_id in plain.prefixes:
                both(
                    "start_branches",
                    target.request_id,
                    [BranchSpec(target.index, seed=0, resume=True)],
                )
        elif op == "step":
            a = plain.step(arg)
            for b in (engine.step(arg) for engine in others):
                assert a.steps == b.steps
                assert a.deltas.keys() == b.deltas.keys()
                for bid, delta in a.deltas.items():
                    other = b.deltas[bid]
                    assert (delta.token_ids, delta.text, delta.finish, delta.end_offset) == (
                        other.token_ids, other.text, other.finish, other.end_offset,
                    ), bid  # fmt: skip
                    assert [lp.logprob for lp in delta.logprobs] == pytest.approx(
                        [lp.logprob for lp in other.logprobs], abs=1e-4
                    )
    for rid in requests:
        both("release_prefix", rid)
    assert plain.stats() == fast.stats() == copied.stats() == tight.stats()


class _FailingLater(StaticDecode):
    """Captures "succeed" (the forward replayed without a graph) until ``fail_after``
    of them, then fail: a failure after rows were moved in the buffers."""

    fail_after = 1

    def _capture(self, rows: int, columns: int) -> tuple[object, object]:
        if self.captures >= self.fail_after:
            raise RuntimeError("operation not permitted when stream is capturing")
        cache = self._cache(rows, columns)

        class Replay:
            @staticmethod
            def replay() -> None:
                self._forward(rows, columns, cache)

        return Replay(), cache


def test_a_capture_failing_after_a_rebuild_in_place_decodes_on_from_the_moved_rows(
    model_and_tokenizer: tuple[object, object],
) -> None:
    # Three branches in four rows; one aborted, the other two move up a row and the
    # batch takes a bucket of two rows, whose capture fails: the spans must follow
    # the rows, or the default path reads one branch's KV for another's.
    settings = SamplingSettings(temperature=1.0, max_tokens=20, ignore_eos=True)

    def run(engine: HFEngine) -> dict[BranchId, list[int]]:
        engine.prefill("a", "Step 1: add 3 and 4.", settings)
        engine.start_branches("a", [BranchSpec(i, seed=i) for i in range(3)])
        out: dict[BranchId, list[int]] = {}
        for call in ("step", "abort", "step"):
            if call == "abort":
                engine.abort([BranchId("a", 0)])
                continue
            for bid, delta in engine.step(8).deltas.items():
                out.setdefault(bid, []).extend(delta.token_ids)
        engine.release_prefix("a")
        return out

    failing = HFEngine(*model_and_tokenizer)
    failing.static = _FailingLater(failing.model, capture=True, column_bucket=256)
    with pytest.warns(RuntimeWarning, match="at 2 rows x 256 columns"):
        got = run(failing)
    assert failing.static is None
    assert got == run(HFEngine(*model_and_tokenizer))
