"""The testbed PRM's model class: its features are the policy's likelihood, cached or not."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from sart.testbed import modeling_testbed_prm as prm_model
from sart.testbed.model import ModelConfig
from sart.testbed.tokenizer import build_tokenizer

# Token ids of the testbed vocabulary used below.
TOK = build_tokenizer()
IDS = {w: TOK.convert_tokens_to_ids(w) for w in ("Q", "S", "<step>", "\n\n", "p1", "3", "+")}


def _model(seed: int = 0) -> prm_model.TestbedPRM:
    torch.manual_seed(seed)
    policy = ModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=1, max_positions=128
    ).llama(TOK)
    config = prm_model.TestbedPRMConfig(
        text_config=policy.to_dict(),
        separator_id=IDS["<step>"],
        step_word_id=IDS["\n\n"],
        question_end_id=IDS["S"],
    )
    model = prm_model.TestbedPRM(config)
    with torch.no_grad():
        for p in model.policy.parameters():
            p.normal_(0, 0.5)  # a peaked, random policy: varied log-probs
        model.feature_mean.copy_(torch.randn(len(prm_model.FEATURES)))
        model.feature_scale.uniform_(0.5, 2.0)
        model.score.weight.normal_()
    return model.eval()


def _ids(words: str) -> torch.Tensor:
    return torch.tensor([TOK.convert_tokens_to_ids(words.split(" "))])


QUESTION = "Q 3 p1 4 p2 S"
RESPONSE = "p1 3 + 0 = 3 <step> p2 4 + 3 = 7 <step>"


def test_features_are_running_statistics_of_the_policys_token_logprobs() -> None:
    model = _model()
    ids = _ids(f"{QUESTION} {RESPONSE}")
    features = model.features(ids)[0]
    # The policy sees each <step> as the step word it writes.
    policy_ids = ids.masked_fill(ids == IDS["<step>"], IDS["\n\n"])
    with torch.no_grad():
        logprobs = torch.log_softmax(model.policy(input_ids=policy_ids).logits[0], -1)
    n_question = len(QUESTION.split())
    words = RESPONSE.split(" ")
    expected_lp = []
    for k, word in enumerate(words):
        position = n_question + k
        lp = logprobs[position - 1, policy_ids[0, position]].item()
        if word != "<step>":  # the separator's own likelihood is not evidence
            expected_lp.append(lp)
        row = dict(zip(prm_model.FEATURES, features[position].tolist()))
        assert row["min_logprob"] == pytest.approx(min(expected_lp), abs=1e-5)
        assert row["sum_logprob"] == pytest.approx(sum(expected_lp), abs=1e-4)
        assert row["below_10pct"] == sum(x < math.log(0.1) for x in expected_lp)
        assert row["below_1pct"] == sum(x < math.log(0.01) for x in expected_lp)
        assert row["response_tokens"] == len(expected_lp)
        assert row["question_tokens"] == n_question
        assert row["steps"] == words[: k + 1].count("<step>")
    # Inside the question nothing is counted yet.
    first = dict(zip(prm_model.FEATURES, features[n_question - 1].tolist()))
    assert first["response_tokens"] == first["sum_logprob"] == first["min_logprob"] == 0
    assert first["question_tokens"] == n_question


def test_logits_are_the_standardised_features_through_the_head() -> None:
    model = _model()
    ids = _ids(f"{QUESTION} {RESPONSE}")
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 2)
    x = (model.features(ids) - model.feature_mean) / model.feature_scale
    assert torch.allclose(logits, model.score(x), atol=1e-6)


def test_runs_in_half_precision() -> None:
    # Loaded with dtype=torch.bfloat16 (as a GPU user would), the head reads
    # float32 features in its own precision.
    model = _model()
    ids = _ids(f"{QUESTION} {RESPONSE}")
    want = model(input_ids=ids).logits
    got = model.to(torch.bfloat16)(input_ids=ids).logits
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, atol=0.2)


def test_cached_scoring_matches_uncached_after_growing_and_cropping() -> None:
    from sart.prm.hf import CacheAPI

    model = _model(1)
    full = _ids(f"{QUESTION} {RESPONSE}")
    want = model(input_ids=full).logits
    api = CacheAPI.of(model)
    cache = api.new(model)
    pieces, start = [6, 13, full.shape[1]], 0
    got = []
    for end in pieces:
        kwargs = {api.argument: cache}
        got.append(model(input_ids=full[:, start:end], use_cache=True, **kwargs).logits)
        start = end
    assert torch.allclose(torch.cat(got, dim=1), want, atol=1e-5)
    # Cut back (a branch's text changed after position 10), continue differently.
    other = _ids(f"{QUESTION} p1 3 + 0 = 4 <step> p2 4 + 4 = 8 <step>")
    api.crop(cache, 10)
    tail = model(input_ids=other[:, 10:], use_cache=True, **{api.argument: cache}).logits
    assert torch.allclose(tail, model(input_ids=other).logits[:, 10:], atol=1e-5)


def test_position_ids_reach_the_policy() -> None:
    # Batched incremental scoring (sart.prm.hf) left-pads the rows' caches and
    # gives the new tokens their real positions: the policy must use them.
    model = _model()
    ids = _ids(f"{QUESTION} {RESPONSE}")
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    plain = model(input_ids=ids).logits
    assert torch.allclose(model(input_ids=ids, position_ids=positions).logits, plain, atol=1e-6)
    # Rotary embeddings are relative: only a gap between positions shows.
    gap = positions + 7 * (positions >= 5)
    assert not torch.allclose(model(input_ids=ids, position_ids=gap).logits, plain, atol=1e-3)


def test_cache_state_is_position_aligned_under_the_declared_key() -> None:
    # The protocol sart.prm.hf follows to merge and split caches: a dict of
    # [batch, positions, ...] tensors under ``cache_state_key``.
    from sart.prm.hf import CacheAPI

    model = _model()
    api = CacheAPI.of(model)
    cache = api.new(model)
    ids = _ids(f"{QUESTION} {RESPONSE}")
    model(input_ids=ids[:, :9], use_cache=True, **{api.argument: cache})
    model(input_ids=ids[:, 9:], use_cache=True, **{api.argument: cache})
    state = getattr(cache, prm_model.TestbedPRM.cache_state_key)
    assert state and all(v.shape[:2] == (1, cache.get_seq_length()) for v in state.values())


def test_a_cache_filled_elsewhere_is_refused() -> None:
    from sart.prm.hf import CacheAPI

    model = _model()
    api, inner = CacheAPI.of(model), CacheAPI.of(model.policy)
    cache = api.new(model)
    ids = _ids(QUESTION)
    model.policy(input_ids=ids, use_cache=True, **{inner.argument: cache})  # policy only
    assert cache.get_seq_length() == ids.shape[1]
    with pytest.raises(ValueError, match="not filled by a TestbedPRM"):
        model(input_ids=_ids("p1"), use_cache=True, **{api.argument: cache})


def test_saved_model_loads_through_auto_map_with_the_qwen_adapter(tmp_path: Path) -> None:
    from sart.prm.base import ScoreItem
    from sart.prm.hf import QwenMathPRM
    from sart.types import BranchId

    model = _model(2)
    model.save_pretrained(tmp_path)
    TOK.save_pretrained(tmp_path)
    # Self-contained like a hub checkpoint: the modelling code travels with it.
    assert (tmp_path / "modeling_testbed_prm.py").exists()
    prm = QwenMathPRM.from_pretrained(tmp_path, system_prompt=None, step_separator="<step>")
    assert type(prm.model).__name__ == "TestbedPRM"
    text = "p1 3 + 0 = 3 \n\n p2 4 + 3 = 7"
    item = ScoreItem(BranchId("r", 0), QUESTION, text, 12, True)
    (rewards,) = prm.step_rewards([item])
    ids = torch.tensor([prm.encode(QUESTION, text).ids()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    positions = prm.encode(QUESTION, text).positions()
    want = torch.softmax(logits[positions], -1)[:, 1].tolist()
    assert rewards == pytest.approx(want, abs=1e-5)
