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
