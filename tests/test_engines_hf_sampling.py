"""vLLM's extra sampling fields on the transformers engine (``SamplingSettings``:
top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, min_tokens,
stop_token_ids, ignore_eos, skip_special_tokens, include_stop_str_in_output), each
checked against transformers' own ``generate`` where it has the same processor,
else against the rule written out here."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import sart  # noqa: E402
from sart.engines.hf import HFEngine  # noqa: E402
from sart.engines.prompts import prompt_ids  # noqa: E402

PROMPT = "Step 1: add 3 and 4."
MAX = 24


@pytest.fixture(scope="module")
def engine(demo_models: dict[str, Path]) -> HFEngine:
    return HFEngine.from_pretrained(str(demo_models["policy"]), dtype=torch.float32)


def run(
    engine: HFEngine, eos: int | None = None, seed: int = 1, **fields: object
) -> tuple[list[int], str, sart.FinishReason | None]:
    """One branch of ``PROMPT`` to its end (greedy unless ``fields`` say otherwise);
    ``eos``: the token that ends it as EOS does. Its tokens, text and finish."""
    e = HFEngine(engine.model, engine.tokenizer)
    if eos is not None:
        e.eos_ids = frozenset({eos})
    sampling = sart.SamplingSettings(**{"temperature": 0.0, "max_tokens": MAX, **fields})
    e.prefill("r", PROMPT, sampling)
    e.start_branches("r", [sart.BranchSpec(0, seed=seed)])
    tokens: list[int] = []
    text, finish = "", None
    while e.stats().live_branches:
        for delta in e.step(5).deltas.values():
            tokens += delta.token_ids
            text += delta.text
            finish = delta.finish or finish
    return tokens, text, finish


def generate(engine: HFEngine, **kwargs: object) -> list[int]:
    """transformers' greedy ``generate`` of ``PROMPT`` (the reference)."""
    ids = prompt_ids(engine.tokenizer, PROMPT)
    kwargs = {"do_sample": False, "max_new_tokens": MAX, "pad_token_id": 0, **kwargs}
    with torch.inference_mode():
        out = engine.model.generate(torch.tensor([ids]), **kwargs)
    return out[0, len(ids) :].tolist()


def test_repetition_penalty_is_transformers_own(engine: HFEngine) -> None:
    plain, _, _ = run(engine)
    tokens, _, _ = run(engine, repetition_penalty=1.8)
    assert tokens == generate(engine, repetition_penalty=1.8)
    assert tokens != plain  # the tiny model repeats itself: the penalty changes that


def test_min_tokens_holds_eos_back_as_transformers_min_new_tokens(engine: HFEngine) -> None:
    plain, _, _ = run(engine)
    eos = plain[6]  # greedy would end at its 7th token
    early, _, finish = run(engine, eos=eos)
    assert (len(early), finish) == (7, sart.FinishReason.STOP)
    tokens, _, _ = run(engine, eos=eos, min_tokens=10)
    assert len(tokens) >= 10
    assert tokens == generate(engine, eos_token_id=eos, min_new_tokens=10)[: len(tokens)]


def test_ignore_eos_goes_on_to_max_tokens(engine: HFEngine) -> None:
    plain, _, _ = run(engine)
    tokens, _, finish = run(engine, eos=plain[6], ignore_eos=True)
    assert (tokens, finish) == (plain, sart.FinishReason.LENGTH)


def test_a_stop_token_ends_the_branch_and_is_kept(engine: HFEngine) -> None:
    plain, _, _ = run(engine)
    stop = plain[4]
    end = plain.index(stop) + 1
    tokens, text, finish = run(engine, stop_token_ids=[stop])
    assert (tokens, finish) == (plain[:end], sart.FinishReason.STOP)
    assert text == engine.tokenizer.decode(plain[:end], skip_special_tokens=True)


@pytest.mark.parametrize("fields", [{"top_k": 1}, {"min_p": 1.0}])
def test_top_k_1_and_min_p_1_sample_the_greedy_token(engine: HFEngine, fields: dict) -> None:
    plain, _, _ = run(engine)
    for seed in (1, 2, 3):
        assert run(engine, seed=seed, temperature=1.0, **fields)[0] == plain


def test_top_k_and_min_p_keep_sampling_among_the_likeliest(engine: HFEngine) -> None:
    # Each sampled token is among the k likeliest / within min_p of the likeliest,
    # by a plain forward over the tokens sampled before it.
    ids = prompt_ids(engine.tokenizer, PROMPT)
    for fields in ({"top_k": 3}, {"min_p": 0.2}):
        tokens, _, _ = run(engine, temperature=1.0, seed=7, **fields)
        with torch.inference_mode():
            logits = engine.model(input_ids=torch.tensor([ids + tokens])).logits[0].float()
        for t, token in enumerate(tokens):
            probs = torch.softmax(logits[len(ids) - 1 + t], dim=-1)
            if "top_k" in fields:
                assert token in probs.topk(3).indices.tolist()
            else:
                assert probs[token] >= 0.2 * probs.max() - 1e-6


def test_presence_and_frequency_penalties_follow_openais_rule(engine: HFEngine) -> None:
    # logit -= presence * (count > 0) + frequency * count, over the output's tokens.
    class Penalties:
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            out = input_ids[0, prompt_len:]
            counts = torch.bincount(out, minlength=scores.shape[-1]).to(scores.dtype)
            return scores - 0.5 * (counts > 0).to(scores.dtype) - 1.5 * counts

    from transformers import LogitsProcessorList

    prompt_len = len(prompt_ids(engine.tokenizer, PROMPT))
    tokens, _, _ = run(engine, presence_penalty=0.5, frequency_penalty=1.5)
    assert tokens == generate(engine, logits_processor=LogitsProcessorList([Penalties()]))
    assert tokens != run(engine)[0]


def test_a_stop_string_is_kept_with_include_stop_str_in_output(engine: HFEngine) -> None:
    _, text, _ = run(engine)
    # Three plain characters from the middle (the random model's text has partial bytes).
    at = next(
        i for i in range(4, len(text)) if text[i : i + 3].isascii() and text[i : i + 3].isalnum()
    )
    stop = text[at : at + 3]
    cut, cut_finish = run(engine, stop=[stop])[1:]
    kept, kept_finish = run(engine, stop=[stop], include_stop_str_in_output=True)[1:]
    assert cut_finish == kept_finish == sart.FinishReason.STOP
    assert kept == cut + stop and kept.endswith(stop) and not cut.endswith(stop)


def test_special_tokens_are_in_the_text_unless_skipped(engine: HFEngine) -> None:
    # Sampling at temperature 2 past EOS (id 0) draws special tokens (ids 0-3) now and then.
    special = set(engine.tokenizer.all_special_ids)
    for seed in range(40):
        fields = {"temperature": 2.0, "seed": seed, "ignore_eos": True}
        tokens, skipped, _ = run(engine, **fields)
        if special & set(tokens):
            break
    else:
        pytest.fail("no special token sampled in 40 seeds")
    shown = run(engine, skip_special_tokens=False, **fields)[1]
    names = {engine.tokenizer.convert_ids_to_tokens(i) for i in special & set(tokens)}
    assert all(name in shown for name in names)
    assert not any(name in skipped for name in names)


def test_an_engine_that_does_not_list_a_field_refuses_the_request() -> None:
    class Plain(sart.testing.FakeEngine):
        sampling_fields = frozenset({"top_k"})

    request = sart.Request(
        "r", "q", sart.self_consistency(2), sampling=sart.SamplingSettings(min_p=0.1)
    )
    with pytest.raises(sart.ConfigError, match=r"min_p=0\.1 is not honoured by Plain"):
        sart.run([request], Plain(), batch_size=4)
    ok = sart.Request("s", "q", sart.self_consistency(2), sampling=sart.SamplingSettings(top_k=5))
    assert sart.run([ok], Plain(), batch_size=4)[0].ok


def test_streamed_text_is_the_decoded_text_without_repeats(engine: HFEngine) -> None:
    # The random model's byte tokens cut characters in two: the partial character is
    # held back until it resolves, so the pieces never repeat text already sent.
    for seed in range(8):
        tokens, text, _ = run(engine, seed=seed, temperature=1.0)
        assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    tokens, text, _ = run(engine, repetition_penalty=1.8)
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)


def ended_by(engine: HFEngine, eos: int | None = None, **fields: object) -> object:
    """``run``'s branch's ``stop_reason``, as its last delta reports it."""
    e = HFEngine(engine.model, engine.tokenizer)
    if eos is not None:
        e.eos_ids = frozenset({eos})
    e.prefill(
        "r", PROMPT, sart.SamplingSettings(**{"temperature": 0.0, "max_tokens": MAX, **fields})
    )
    e.start_branches("r", [sart.BranchSpec(0, seed=1)])
    reason: object = "never ended"
    while e.stats().live_branches:
        for delta in e.step(5).deltas.values():
            if delta.finish is not None:
                reason = delta.stop_reason
    return reason


def test_what_ended_a_branch_is_vllms_stop_reason(engine: HFEngine) -> None:
    plain, text, _ = run(engine)
    assert ended_by(engine, stop_token_ids=[plain[4]]) == plain[4]  # the stop token's id
    at = next(
        i for i in range(4, len(text)) if text[i : i + 3].isascii() and text[i : i + 3].isalnum()
    )
    assert ended_by(engine, stop=[text[at : at + 3]]) == text[at : at + 3]  # the string
    assert ended_by(engine, eos=plain[4]) is None  # EOS, as vLLM says it
    assert ended_by(engine, eos=plain[4], stop_token_ids=[plain[4]]) is None  # EOS first
    assert ended_by(engine) is None  # max_tokens
