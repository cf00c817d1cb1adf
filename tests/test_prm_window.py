"""The PRMs' bounded mode, ``window=W``: the question plus the latest ``W`` response tokens.

On the tiny demo token classifier (random weights, causal: a Llama), built
here. The transformers tests run wherever torch and transformers are; the
vLLM ones (``VLLMQwenPRM`` on vLLM-CPU, one engine for the module) only where
vLLM is installed, and are skipped elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from sart.errors import ConfigError  # noqa: E402
from sart.prm.aggregate import split_steps  # noqa: E402
from sart.prm.base import ScoreItem  # noqa: E402
from sart.prm.hf import QwenMathPRM  # noqa: E402
from sart.prm.window import ContextLimit  # noqa: E402
from sart.types import BranchId  # noqa: E402

QUESTION = "What is 7 + 8?"
WINDOW = 96


def response(n_steps: int) -> str:
    return "\n\n".join(
        f"Step {i + 1}: add {i} and {i + 3}. {i} + {i + 3} = {2 * i + 3}." for i in range(n_steps)
    )


def item(text: str, index: int = 0, final: bool = False) -> ScoreItem:
    return ScoreItem(BranchId("r", index), QUESTION, text, len(text), final)


def checks(text: str, every: int = 120) -> list[str]:
    """The branch's text at each check as it grows by ``every`` characters."""
    return [text[:n] for n in [*range(every, len(text), every), len(text)]]


@pytest.fixture(scope="module")
def parts(demo_models: dict[str, Path]) -> tuple[Any, Any]:
    model = transformers.AutoModelForTokenClassification.from_pretrained(demo_models["qwen-prm"])
    return model.eval(), transformers.AutoTokenizer.from_pretrained(demo_models["qwen-prm"])


def qwen(parts: tuple[Any, Any], **kwargs: Any) -> QwenMathPRM:
    return QwenMathPRM(*parts, **kwargs)


# ---------------------------------------------------------------- the windowing


@pytest.mark.parametrize("bad", [0, -3, 2.5, "64"])
def test_bad_windows_are_refused_naming_field_and_value(parts: tuple[Any, Any], bad: Any) -> None:
    with pytest.raises(ConfigError, match=rf"window={bad!r} must be None or an int >= 1"):
        ContextLimit(window=bad)
    with pytest.raises(ConfigError, match=rf"window={bad!r}"):
        qwen(parts, window=bad)


def test_the_window_is_the_context_windowing_with_a_budget_in_response_tokens(
    parts: tuple[Any, Any],
) -> None:
    """Same mechanism as ``max_length``: for a question whose prefix is ``P``
    tokens, ``window=W`` sees what ``max_length=P + W`` sees."""
    windowed = qwen(parts, window=WINDOW)
    prefix = len(windowed.encode(QUESTION, "x").prefix)
    by_length = qwen(parts, max_length=prefix + WINDOW)
    for text in checks(response(30), 97):
        enc = windowed.encode(QUESTION, text)
        assert enc == by_length.encode(QUESTION, text)
        assert len(enc) - prefix <= WINDOW
        steps = split_steps(text)
        assert enc.first_step + len(enc.segments) == len(steps)  # the latest steps


# ---------------------------------------------------------------- cost and rewards


@pytest.mark.parametrize("incremental", [False, True])
def test_each_check_costs_at_most_prefix_plus_window(
    parts: tuple[Any, Any], incremental: bool
) -> None:
    prm = qwen(parts, window=WINDOW, incremental=incremental)
    full = qwen(parts, incremental=False)
    prefix = len(prm.encode(QUESTION, "x").prefix)
    costs = []
    for text in checks(response(60)):
        before = prm.tokens_processed
        prm.score([item(text)])
        costs.append(prm.tokens_processed - before)
    assert max(costs) <= prefix + WINDOW  # whatever the branch's length
    before = full.tokens_processed
    full.score([item(text)])
    assert full.tokens_processed - before > 4 * max(costs)  # ~1000 response tokens


@pytest.mark.parametrize("incremental", [False, True])
def test_kept_steps_are_rated_as_the_model_rates_them_alone(
    parts: tuple[Any, Any], incremental: bool
) -> None:
    """The model is causal: a kept step's reward is the full-context reward of
    the response made of the kept steps only (the window cuts at steps)."""
    prm = qwen(parts, window=WINDOW, incremental=incremental)
    reference = qwen(parts, incremental=False)
    dropped = []
    for text in checks(response(25), 150):
        rewards = prm.step_rewards([item(text)])[0]
        dropped.append(prm.encode(QUESTION, text).first_step)
        kept = split_steps(text)[dropped[-1] :]
        expected = reference.step_rewards([item("\n\n".join(kept))])[0]
        assert rewards == pytest.approx(expected, abs=1e-5)
    assert max(dropped) > 10  # the window did cut
    short = response(2)  # within the window: the same as without one
    assert prm.step_rewards([item(short, 1)])[0] == pytest.approx(
        reference.step_rewards([item(short, 1)])[0], abs=1e-5
    )


def test_windowed_incremental_with_a_stride_reuses_its_cache(parts: tuple[Any, Any]) -> None:
    costs = {}
    for stride in (1, 48):
        cached = qwen(parts, window=WINDOW, window_stride=stride)
        full = qwen(parts, window=WINDOW, window_stride=stride, incremental=False)
        for text in checks(response(50), 40):
            assert cached.step_rewards([item(text)])[0] == pytest.approx(
                full.step_rewards([item(text)])[0], abs=1e-5
            )
        costs[stride] = cached.tokens_processed
    assert costs[48] < costs[1] / 2


# ---------------------------------------------------------------- vLLM

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def vllm_prm(demo_models: dict[str, Path], parts: tuple[Any, Any]) -> Iterator[Any]:
    """``VLLMQwenPRM`` on vLLM-CPU over the demo token classifier (``ALL`` pooling)."""
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in ENV.items():
            mp.setenv(name, value)
        from sart.prm.vllm import VLLMQwenPRM

        yield VLLMQwenPRM.from_engine_args(
            demo_models["qwen-prm"],
            tokenizer=parts[1],
            dtype="float32",
            block_size=32,  # vLLM-CPU needs a multiple of 32
            max_model_len=2048,
            max_num_batched_tokens=2048,
            enforce_eager=True,
            seed=0,
        )


def vllm_with(prm: Any, **kwargs: Any) -> Any:
    """Another adapter over the same engine."""
    return type(prm)(prm.llm, prm.tokenizer, **kwargs)


def test_vllm_window_bounds_what_each_check_sends(vllm_prm: Any) -> None:
    bounded, full = vllm_with(vllm_prm, window=WINDOW), vllm_with(vllm_prm, max_length=2048)
    prefix = len(bounded.encode(QUESTION, "x").prefix)
    costs, full_costs = [], []
    for text in checks(response(60)):
        before, full_before = bounded.tokens_processed, full.tokens_processed
        bounded.score([item(text)])
        full.score([item(text)])
        costs.append(bounded.tokens_processed - before)
        full_costs.append(full.tokens_processed - full_before)
        assert costs[-1] == len(bounded.encode(QUESTION, text))  # what vLLM was sent
    assert max(costs) <= prefix + WINDOW
    assert full_costs[-1] > 4 * max(costs)  # ~1000 response tokens re-encoded


def test_vllm_window_rewards_equal_the_transformers_prms(
    vllm_prm: Any, parts: tuple[Any, Any]
) -> None:
    bounded = vllm_with(vllm_prm, window=WINDOW)
    hf = qwen(parts, window=WINDOW, max_length=2048, incremental=False)
    items = [item(response(n), n) for n in (2, 12, 40)]
    for it in items:
        assert bounded.encode(it.prompt, it.text) == hf.encode(it.prompt, it.text)
    got = bounded.step_rewards(items)
    assert got == [pytest.approx(r, abs=1e-4) for r in hf.step_rewards(items)]
    assert len(got[2]) < 40  # early steps left the window


def test_vllm_refuses_a_bad_window(vllm_prm: Any) -> None:
    with pytest.raises(ConfigError, match="window=0"):
        vllm_with(vllm_prm, window=0)
