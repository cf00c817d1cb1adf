"""The transformers engine on tiny random models built here (no downloads).

The scenarios every real adapter shares (conformance, greedy, seeds, aborts,
forks, SART and Rebase runs...) run on it in ``test_engines_scenarios.py``;
this file holds what only the transformers engine does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import sart  # noqa: E402
from adapters import sart_requests  # noqa: E402
from sart.engines.hf import HFEngine  # noqa: E402


@pytest.fixture(scope="module")
def engine(demo_models: dict[str, Path]) -> HFEngine:
    return HFEngine.from_pretrained(str(demo_models["policy"]), dtype=torch.float32)


def test_the_tokenizer_loaded_is_the_one_saved(demo_models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    from sart.demo_models import build_tokenizer

    loaded = AutoTokenizer.from_pretrained(demo_models["policy"])
    text = "Step 2: check it: 19 - 7 = 12.\n\nSo the answer is \\boxed{12}."
    assert loaded.encode(text) == build_tokenizer().encode(text)
    assert loaded.convert_tokens_to_ids("<extra_0>") != loaded.unk_token_id


@pytest.mark.parametrize("kind", ["qwen", "shepherd"])
def test_sart_end_to_end_with_both_prm_styles(
    engine: HFEngine, demo_models: dict[str, Path], kind: str
) -> None:
    path = demo_models["qwen-prm" if kind == "qwen" else "shepherd-prm"]
    options = {} if kind == "qwen" else {"good_token": " +", "bad_token": " -"}
    prm = sart.load_prm(kind).from_pretrained(str(path), dtype=torch.float32, **options)
    e = HFEngine(engine.model, engine.tokenizer)
    results = sart.run(sart_requests(4, max_tokens=16), e, prm, batch_size=8)
    assert all(r.ok for r in results), [r.reason for r in results]
    assert all(r.prm_items > 0 for r in results)
    scored = [b.reward for r in results for b in r.branches if b.reward is not None]
    assert scored and all(0.0 <= x <= 1.0 for x in scored)
    assert e.stats() == sart.EngineStats(live_branches=0, kv_tokens=0)


# ------------------------------------------------------------ log-probabilities

PROMPT = "Step 1: add 3 and 4."


def _fresh(engine: HFEngine) -> HFEngine:
    """A new engine over the module's model (no request held from another test)."""
    return HFEngine(engine.model, engine.tokenizer)


def _drain(
    e: HFEngine, steps: int = 4
) -> tuple[dict[sart.BranchId, list[int]], dict[sart.BranchId, list[sart.TokenLogprobs]]]:
    """Step until no branch is live (in calls of a few steps, so that deltas span
    several steps); check each delta's shape; return each branch's tokens and
    log-probabilities in order."""
    tokens: dict[sart.BranchId, list[int]] = {}
    logprobs: dict[sart.BranchId, list[sart.TokenLogprobs]] = {}
    while e.stats().live_branches:
        for bid, delta in e.step(steps).deltas.items():
            assert len(delta.token_ids) == delta.new_tokens
            assert len(delta.logprobs) in (0, delta.new_tokens)
            tokens.setdefault(bid, []).extend(delta.token_ids)
            logprobs.setdefault(bid, []).extend(delta.logprobs)
    return tokens, logprobs


def _reference(e: HFEngine, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The raw log-probabilities of each generated token's position, from one plain
    forward of the model over prompt + generated tokens (no cache, no batching):
    row ``t`` is the distribution ``generated[t]`` was drawn from."""
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logits = e.model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def _check_against_reference(
    e: HFEngine,
    prompt: list[int],
    generated: list[int],
    reported: list[sart.TokenLogprobs],
    k: int,
    skip: int = 0,
) -> None:
    """``reported`` (for ``generated[skip:]``) equals the reference within 1e-4."""
    ref = _reference(e, prompt, generated)[skip:]
    assert len(reported) == len(generated) - skip > 0
    for row, token, lp in zip(ref, generated[skip:], reported):
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert lp.token_id == token
        top = row.topk(k).values.tolist() if k else []
        assert list(lp.top) == pytest.approx(top, abs=1e-4)
        # Which tokens: each id's reference value is the value reported beside it.
        assert len(lp.top_ids) == k
        assert [float(row[t]) for t in lp.top_ids] == pytest.approx(list(lp.top), abs=1e-4)


def _prefill(e: HFEngine, request_id: str, sampling: sart.SamplingSettings) -> list[int]:
    from sart.engines.prompts import prompt_ids

    e.prefill(request_id, PROMPT, sampling)
    return prompt_ids(e.tokenizer, PROMPT)


def test_logprobs_have_one_entry_per_token_sorted_and_non_positive(engine: HFEngine) -> None:
    e = _fresh(engine)
    _prefill(e, "r", sart.SamplingSettings(temperature=1.0, max_tokens=10, logprobs=3))
    e.start_branches("r", [sart.BranchSpec(0, seed=1), sart.BranchSpec(1, seed=2)])
    tokens, logprobs = _drain(e, steps=3)
    assert set(logprobs) == {sart.BranchId("r", 0), sart.BranchId("r", 1)}
    for bid, lps in logprobs.items():
        assert len(lps) == len(tokens[bid]) > 0
        for lp in lps:
            assert len(lp.top) == 3
            assert list(lp.top) == sorted(lp.top, reverse=True)
            assert lp.logprob <= 0.0 and all(v <= 0.0 for v in lp.top)
            assert lp.logprob <= lp.top[0] + 1e-6


def test_greedy_sampled_logprob_is_the_top_one(engine: HFEngine) -> None:
    e = _fresh(engine)
    _prefill(e, "r", sart.SamplingSettings(temperature=0.0, max_tokens=12, logprobs=3))
    e.start_branches("r", [sart.BranchSpec(0, seed=0)])
    _, logprobs = _drain(e)
    lps = logprobs[sart.BranchId("r", 0)]
    assert lps and all(lp.logprob == lp.top[0] for lp in lps)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_a_plain_forward_of_the_model(engine: HFEngine, temperature: float) -> None:
    # Raw log-probabilities: with temperature 0.7 and top_p 0.8 they are still the
    # model's own log_softmax, not the tempered, truncated distribution. Three
    # branches are batched together (left padding, masks) and checked each.
    e = _fresh(engine)
    sampling = sart.SamplingSettings(temperature=temperature, top_p=0.8, max_tokens=12, logprobs=3)
    prompt = _prefill(e, "r", sampling)
    e.start_branches("r", [sart.BranchSpec(j, seed=10 + j) for j in range(3)])
    tokens, logprobs = _drain(e, steps=5)
    for bid, generated in tokens.items():
        _check_against_reference(e, prompt, generated, logprobs[bid], k=3)


def test_no_logprobs_unless_asked(engine: HFEngine) -> None:
    e = _fresh(engine)
    _prefill(e, "r", sart.SamplingSettings(temperature=1.0, max_tokens=8))
    e.start_branches("r", [sart.BranchSpec(0, seed=1)])
    tokens, logprobs = _drain(e)
    assert tokens[sart.BranchId("r", 0)] and logprobs[sart.BranchId("r", 0)] == []


def test_logprobs_zero_gives_the_sampled_token_only(engine: HFEngine) -> None:
    e = _fresh(engine)
    prompt = _prefill(e, "r", sart.SamplingSettings(temperature=1.0, max_tokens=8, logprobs=0))
    e.start_branches("r", [sart.BranchSpec(0, seed=1)])
    tokens, logprobs = _drain(e)
    bid = sart.BranchId("r", 0)
    assert all(lp.top == () for lp in logprobs[bid])
    _check_against_reference(e, prompt, tokens[bid], logprobs[bid], k=0)


def test_k_larger_than_the_vocabulary_is_clamped(engine: HFEngine) -> None:
    e = _fresh(engine)
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    _prefill(e, "r", sart.SamplingSettings(temperature=1.0, max_tokens=3, logprobs=vocab + 50))
    e.start_branches("r", [sart.BranchSpec(0, seed=1)])
    _, logprobs = _drain(e)
    lps = logprobs[sart.BranchId("r", 0)]
    assert lps and all(len(lp.top) == vocab for lp in lps)


def test_only_the_request_that_asked_gets_logprobs(engine: HFEngine) -> None:
    # Both requests' branches decode in one batch; each request has its own k.
    e = _fresh(engine)
    prompt = _prefill(e, "asks", sart.SamplingSettings(temperature=1.0, max_tokens=10, logprobs=2))
    _prefill(e, "plain", sart.SamplingSettings(temperature=1.0, max_tokens=10))
    e.start_branches("asks", [sart.BranchSpec(0, seed=3)])
    e.start_branches("plain", [sart.BranchSpec(0, seed=3), sart.BranchSpec(1, seed=4)])
    tokens, logprobs = _drain(e)
    asked = sart.BranchId("asks", 0)
    _check_against_reference(e, prompt, tokens[asked], logprobs[asked], k=2)
    for j in (0, 1):
        bid = sart.BranchId("plain", j)
        assert tokens[bid] and logprobs[bid] == []


def test_a_fork_reports_logprobs_for_its_own_tokens_only(engine: HFEngine) -> None:
    e = _fresh(engine)
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=12, logprobs=3)
    prompt = _prefill(e, "r", sampling)
    e.start_branches("r", [sart.BranchSpec(0, seed=5)])
    first = e.step(4).deltas[sart.BranchId("r", 0)]
    assert first.finish is None, "the parent must still be live to be forked"
    e.start_branches("r", [sart.BranchSpec(1, seed=6, parent=0)])
    fork = sart.BranchId("r", 1)
    tokens, logprobs = _drain(e)
    assert len(logprobs[fork]) == len(tokens[fork]) > 0
    inherited = list(first.token_ids)
    _check_against_reference(
        e, prompt, inherited + tokens[fork], logprobs[fork], k=3, skip=len(inherited)
    )


def test_a_sampled_branch_paused_and_resumed_makes_the_same_tokens(engine: HFEngine) -> None:
    """Pausing drops the KV but keeps the tokens and the sampler's state: resumed, the
    branch goes on exactly as if it had not been paused (its KV recomputed)."""
    from sart.engines.base import BranchSpec

    # ignore_eos: the branch is still live when it pauses, whatever it draws.
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=30, ignore_eos=True)

    def run(pause_at: int | None) -> list[int]:
        e = _fresh(engine)
        e.prefill("a", PROMPT, sampling)
        e.start_branches("a", [BranchSpec(0, 7), BranchSpec(1, 8)])
        tokens: list[int] = []
        if pause_at is not None:
            tokens += e.step(pause_at).deltas[sart.BranchId("a", 0)].token_ids
            e.pause([sart.BranchId("a", 0)])
            assert e.usage("a") == (1, e.usage("a")[1])  # one live branch left
            e.step(3)  # the other one goes on
            e.start_branches("a", [BranchSpec(0, 7, resume=True)])
        tokens += _drain(e)[0].get(sart.BranchId("a", 0), [])
        e.release_prefix("a")
        return tokens

    assert run(pause_at=5) == run(pause_at=None)
