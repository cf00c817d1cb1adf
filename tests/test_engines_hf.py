"""The transformers engine on tiny random models built here (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import sart  # noqa: E402
from sart.demo_models import build_demo_models  # noqa: E402
from sart.engines.base import BranchSpec  # noqa: E402
from sart.engines.hf import HFEngine  # noqa: E402
from sart.testing import ScriptedPRM, check_engine  # noqa: E402
from sart.types import BranchId, BranchStatus, FinishReason  # noqa: E402

PROMPTS = ("Step 1: add 3 and 4.", "Step 1: add 12 and 7. Then check it: 12 + 7 =")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_demo_models(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def engine(models: dict[str, Path]) -> HFEngine:
    return HFEngine.from_pretrained(str(models["policy"]), dtype=torch.float32)


def fresh(engine: HFEngine) -> HFEngine:
    return HFEngine(engine.model, engine.tokenizer)


def run_to_end(engine: HFEngine, chunk: int = 5) -> dict[BranchId, list[int]]:
    ids: dict[BranchId, list[int]] = {}
    while engine.stats().live_branches:
        for bid, delta in engine.step(chunk).deltas.items():
            ids.setdefault(bid, []).extend(delta.token_ids)
    return ids


def test_the_tokenizer_loaded_is_the_one_saved(models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    from sart.demo_models import build_tokenizer

    loaded = AutoTokenizer.from_pretrained(models["policy"])
    text = "Step 2: check it: 19 - 7 = 12.\n\nSo the answer is \\boxed{12}."
    assert loaded.encode(text) == build_tokenizer().encode(text)
    assert loaded.convert_tokens_to_ids("<extra_0>") != loaded.unk_token_id


def test_passes_the_conformance_suite(engine: HFEngine) -> None:
    check_engine(lambda: fresh(engine), prompts=PROMPTS)


@pytest.mark.parametrize("with_neighbours", [False, True])
def test_greedy_equals_generate(engine: HFEngine, with_neighbours: bool) -> None:
    e = fresh(engine)
    greedy = sart.SamplingSettings(temperature=0.0, max_tokens=24)
    e.prefill("a", PROMPTS[0], greedy)
    e.start_branches("a", [BranchSpec(0, 1)])
    if with_neighbours:  # batched with branches of another, longer prompt
        e.prefill("b", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=30))
        e.start_branches("b", [BranchSpec(0, 5), BranchSpec(1, 6)])
    ids = run_to_end(e)[BranchId("a", 0)]
    prompt = e.tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
    expected = engine.model.generate(
        prompt, do_sample=False, max_new_tokens=24, pad_token_id=e.tokenizer.pad_token_id
    )[0, prompt.shape[1] :].tolist()
    eos = next(iter(e.eos_ids))
    if eos in expected:  # generate pads after EOS; the branch stops at it
        expected = expected[: expected.index(eos) + 1]
    assert ids == expected


def test_seeded_branches_are_reproducible_and_differ(engine: HFEngine) -> None:
    def sample() -> dict[BranchId, list[int]]:
        e = fresh(engine)
        e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=1.0, max_tokens=12))
        e.start_branches("a", [BranchSpec(0, 100), BranchSpec(1, 101)])
        return run_to_end(e, chunk=3)

    first, again = sample(), sample()
    assert first == again
    assert first[BranchId("a", 0)] != first[BranchId("a", 1)]


def test_max_tokens_truncates_and_abort_frees(engine: HFEngine) -> None:
    e = fresh(engine)
    e.prefill("a", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=4, seed=3))
    e.start_branches("a", [BranchSpec(j, j) for j in range(3)])
    prompt_len = e.stats().kv_tokens
    out = e.step(2)
    assert e.stats().kv_tokens == prompt_len + 3 * 2
    e.abort([BranchId("a", 1)])
    assert e.stats() == sart.EngineStats(live_branches=2, kv_tokens=prompt_len + 2 * 2)
    out = e.step(10)
    for delta in out.deltas.values():
        assert delta.finish in (FinishReason.LENGTH, FinishReason.STOP)
        if delta.finish is FinishReason.LENGTH:
            assert delta.new_tokens == 2 and delta.end_offset == 2
    e.release_prefix("a")
    assert e.stats() == sart.EngineStats(live_branches=0, kv_tokens=0)


def test_stop_strings_end_the_branch_and_are_cut(engine: HFEngine) -> None:
    e = fresh(engine)
    e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=0.0, max_tokens=24))
    e.start_branches("a", [BranchSpec(0, 0)])
    text = "".join(d.text for _ in range(30) for d in e.step(1).deltas.values())
    assert len(text) > 6
    stop = text[3:6]
    e = fresh(engine)
    e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=0.0, max_tokens=24, stop=(stop,)))
    e.start_branches("a", [BranchSpec(0, 0)])
    deltas = []
    while e.stats().live_branches:
        deltas.extend(e.step(4).deltas.values())
    assert deltas[-1].finish is FinishReason.STOP
    assert "".join(d.text for d in deltas) == text[: text.index(stop)]


def test_a_fork_continues_from_its_parent(engine: HFEngine) -> None:
    e = fresh(engine)
    e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=0.0, max_tokens=10))
    e.start_branches("a", [BranchSpec(0, 0)])
    head = e.step(4).deltas[BranchId("a", 0)].token_ids
    e.start_branches("a", [BranchSpec(1, 1, parent=0)])
    rest = run_to_end(e)
    # Greedy: the fork continues exactly as its parent does.
    assert rest[BranchId("a", 1)] == rest[BranchId("a", 0)]
    assert len(head) + len(rest[BranchId("a", 0)]) <= 10


def test_sart_end_to_end_with_a_scripted_prm(engine: HFEngine) -> None:
    e = fresh(engine)
    prm = ScriptedPRM(every=4)
    requests = [
        sart.Request(
            f"q{i}",
            prompt,
            sart.sart(4, interval=4),
            sampling=sart.SamplingSettings(temperature=1.0, max_tokens=16),
        )
        for i, prompt in enumerate(PROMPTS)
    ]
    results = sart.run(requests, e, prm, batch_size=6)
    assert all(r.ok for r in results)
    assert all(r.num_completed >= 1 for r in results)
    assert e.stats() == sart.EngineStats(live_branches=0, kv_tokens=0)
    assert all(b.num_tokens <= 16 for r in results for b in r.branches)
    assert all(b.status.is_ended for r in results for b in r.branches)


def test_a_failing_prm_fails_only_its_request(engine: HFEngine) -> None:
    e = fresh(engine)
    prm = ScriptedPRM(every=4, fail_on={BranchId("q0", 1)})
    requests = [
        sart.Request(
            f"q{i}",
            prompt,
            sart.sart(2, interval=4),
            sampling=sart.SamplingSettings(temperature=1.0, max_tokens=16),
        )
        for i, prompt in enumerate(PROMPTS)
    ]
    results = sart.run(requests, e, prm, batch_size=4)
    assert [r.ok for r in results] == [False, True]
    assert all(b.status is BranchStatus.FAILED for b in results[0].branches)
    assert e.stats() == sart.EngineStats(live_branches=0, kv_tokens=0)


@pytest.mark.parametrize("kind", ["qwen", "shepherd"])
def test_sart_end_to_end_with_both_prm_styles(
    engine: HFEngine, models: dict[str, Path], kind: str
) -> None:
    path = models["qwen-prm" if kind == "qwen" else "shepherd-prm"]
    options = {} if kind == "qwen" else {"good_token": " +", "bad_token": " -"}
    prm = sart.load_prm(kind).from_pretrained(str(path), dtype=torch.float32, **options)
    e = fresh(engine)
    requests = [
        sart.Request(
            f"q{i}",
            prompt,
            sart.sart(4, interval=4),
            sampling=sart.SamplingSettings(temperature=1.0, max_tokens=16),
        )
        for i, prompt in enumerate(PROMPTS)
    ]
    results = sart.run(requests, e, prm, batch_size=8)
    assert all(r.ok for r in results), [r.reason for r in results]
    assert all(r.prm_items > 0 for r in results)
    scored = [b.reward for r in results for b in r.branches if b.reward is not None]
    assert scored and all(0.0 <= x <= 1.0 for x in scored)
    assert e.stats() == sart.EngineStats(live_branches=0, kv_tokens=0)
