"""The transformers PRMs on the tiny demo models: formats, context limit, incremental caches.

The demo models are random, so rewards mean nothing; the tests check shapes,
ranges, the documented input formats (against straightforward reference
encodings), that incremental scoring equals full re-encoding, and that no
input exceeds the context.
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import sart  # noqa: E402
from sart import hf_compat  # noqa: E402
from sart.demo_models import build_tokenizer  # noqa: E402
from sart.errors import ConfigError, PRMError  # noqa: E402
from sart.prm.aggregate import NO_STEPS_REWARD, split_steps  # noqa: E402
from sart.prm.base import ScoreItem  # noqa: E402
from sart.prm.hf import QwenMathPRM, StepTagPRM  # noqa: E402
from sart.prm.options import QwenMathOptions, StepTagOptions  # noqa: E402
from sart.testing import BranchScript, FakeEngine  # noqa: E402
from sart.types import BranchId  # noqa: E402

QUESTION = "What is 7 + 8?"


def response(n_steps: int, start: int = 0) -> str:
    """``n_steps`` steps of demo-style arithmetic, separated by blank lines."""
    return "\n\n".join(
        f"Step {i + 1}: add {i} and {i + 3}. {i} + {i + 3} = {2 * i + 3}."
        for i in range(start, start + n_steps)
    )


def item(text: str, rid: str = "r", index: int = 0, final: bool = False, prompt: Any = QUESTION):
    return ScoreItem(BranchId(rid, index), prompt, text, len(text), final)


@pytest.fixture(scope="module")
def qwen_parts(demo_models: dict[str, Path]) -> tuple[Any, Any]:
    model = transformers.AutoModelForTokenClassification.from_pretrained(demo_models["qwen-prm"])
    return model, transformers.AutoTokenizer.from_pretrained(demo_models["qwen-prm"])


@pytest.fixture(scope="module")
def shepherd_parts(demo_models: dict[str, Path]) -> tuple[Any, Any]:
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_models["shepherd-prm"])
    return model, transformers.AutoTokenizer.from_pretrained(demo_models["shepherd-prm"])


def qwen(parts: tuple[Any, Any], **kwargs: Any) -> QwenMathPRM:
    return QwenMathPRM(*parts, **kwargs)


def shepherd(parts: tuple[Any, Any], **kwargs: Any) -> StepTagPRM:
    return StepTagPRM(*parts, **kwargs)


def close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


# ---------------------------------------------------------------- tokenizer and loading


def test_tokenizer_loaded_from_disk_is_the_saved_one(demo_models: dict[str, Path]) -> None:
    saved = build_tokenizer()
    for name in ("qwen-prm", "shepherd-prm"):
        loaded = transformers.AutoTokenizer.from_pretrained(demo_models[name])
        sample = f"<|im_start|>user\n{QUESTION}<|im_end|>\n{response(2)} ки +<extra_0>"
        assert loaded.encode(sample) == saved.encode(sample)
        assert len(loaded.encode("<extra_0>", add_special_tokens=False)) == 1
        assert len(loaded.encode("ки", add_special_tokens=False)) == 1


def test_without_torch_the_module_says_which_extra_to_install() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import sart.prm.hf\n"
        "except ImportError as e:\n    print(type(e).__name__, e)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("MissingDependencyError")
    assert "pip install -e '.[hf]'" in out.stdout


def test_from_pretrained_loads_the_token_classifier_on_a_device(
    demo_models: dict[str, Path],
) -> None:
    prm = QwenMathPRM.from_pretrained(demo_models["qwen-prm"], device="cpu", dtype=torch.float32)
    assert isinstance(prm.model, transformers.LlamaForTokenClassification)
    assert prm.device == torch.device("cpu")
    step = StepTagPRM.from_pretrained(demo_models["shepherd-prm"], device="cpu", max_length=1024)
    assert isinstance(step.model, transformers.LlamaForCausalLM)


def test_max_length_beyond_the_model_positions_is_refused(qwen_parts: tuple[Any, Any]) -> None:
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        qwen(qwen_parts, max_length=8192)
    with pytest.raises(ConfigError, match="overflow"):
        qwen(qwen_parts, overflow="truncate")


def test_the_options_are_declared_once_and_checked_before_loading(
    qwen_parts: tuple[Any, Any], tmp_path: Path
) -> None:
    assert QwenMathPRM.Options is QwenMathOptions and StepTagPRM.Options is StepTagOptions
    prm = qwen(qwen_parts, window=64, aggregate="mean")
    assert prm.options == QwenMathOptions(window=64, aggregate="mean")
    assert prm.limit == prm.options.limit and prm.aggregate == "mean"
    with pytest.raises(TypeError, match=r"QwenMathPRM\(\) got unexpected keyword.*'step_tag'"):
        qwen(qwen_parts, step_tag="ки")
    # a bad option fails before the (missing) checkpoint is even looked at
    with pytest.raises(ConfigError, match="window=0"):
        QwenMathPRM.from_pretrained(tmp_path / "missing", window=0)
    with pytest.raises(ConfigError, match="batch_size=0"):
        StepTagPRM.from_pretrained(tmp_path / "missing", batch_size=0)


def test_names_from_before_the_split_are_still_importable_here() -> None:
    import sart.prm.hf as hf
    from sart.prm import aggregate, formats, hf_cache, window

    homes = {
        window: ["OVERFLOW_MODES", "ContextLimit", "ContextOverflow", "Encoded", "fit_context"],
        formats: ["QWEN_SYSTEM_PROMPT", "Span", "encode_item"],
        aggregate: ["check_finite"],
        hf_cache: ["CacheAPI"],
    }
    for home, names in homes.items():
        for name in names:
            assert getattr(hf, name) is getattr(home, name), name
    assert {"QwenMathPRM", "StepTagPRM", "TransformersPRM"} <= set(hf.__all__)
    assert all(hasattr(hf, name) for name in hf.__all__)


def test_good_probability_is_the_softmax_good_column_in_float64() -> None:
    # One formula for every PRM, in-process or remote (sart.prm.last_step).
    from sart.prm.formats import good_probability

    two_way = torch.tensor([[0.0, 0.0], [-1.0, 1.0], [3.0, -2.0]], dtype=torch.bfloat16)
    got = good_probability(two_way)
    expected = torch.softmax(two_way.double(), dim=-1)[:, 1].tolist()
    assert got == pytest.approx(expected, rel=1e-15) and got[0] == 0.5 and got[1] > 0.5 > got[2]


# ---------------------------------------------------------------- QwenMathPRM


def test_qwen_rewards_are_floats_in_unit_interval_and_deterministic(
    qwen_parts: tuple[Any, Any],
) -> None:
    items = [item(response(k, k), "r", k) for k in range(1, 5)] + [item("", "s")]
    first = qwen(qwen_parts, incremental=False).score(items)
    again = qwen(qwen_parts, incremental=False).score(items)
    cached = qwen(qwen_parts).score(items)
    assert len(first) == len(items)
    assert all(isinstance(r, float) and 0.0 <= r <= 1.0 for r in first)
    assert first == again
    assert close(first, cached, 1e-5)
    assert first[-1] == NO_STEPS_REWARD  # a blank response has no step to rate


def test_one_reward_per_step(qwen_parts: tuple[Any, Any]) -> None:
    prm = qwen(qwen_parts, incremental=False)
    texts = [response(1), response(3), response(4) + "\n\n\n\nStep 5: so", "no break at all"]
    rewards = prm.step_rewards([item(t, "r", i) for i, t in enumerate(texts)])
    assert [len(r) for r in rewards] == [len(split_steps(t)) for t in texts] == [1, 3, 5, 1]
    for per_step, text in zip(rewards, texts):
        assert prm.score([item(text)])[0] == pytest.approx(min(per_step))


def test_manual_encoding_matches_the_chat_template(qwen_parts: tuple[Any, Any]) -> None:
    model, tokenizer = qwen_parts
    prm = qwen(qwen_parts, incremental=False)
    sep = tokenizer.convert_tokens_to_ids("<extra_0>")
    for text in (response(1), response(3), "Step 1: first\n\nStep 2: half a st"):
        steps = split_steps(text)
        ours = prm.encode(QUESTION, text).ids()
        # Qwen's documented usage: the whole chat as text, tokenised at once.
        messages = [
            {"role": "system", "content": prm.system_prompt},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"},
        ]
        full = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False))
        assert full[: len(ours)] == ours
        assert tokenizer.decode(full[len(ours) :]) == "<|im_end|>\n"  # only the suffix is left out
        with torch.inference_mode():
            logits = model(torch.tensor([full])).logits[0]
        at = [i for i, t in enumerate(full) if t == sep]
        reference = torch.softmax(logits[at], dim=-1)[:, 1].tolist()
        assert close(prm.step_rewards([item(text)])[0], reference, 1e-5)


def test_incremental_equals_full_and_costs_far_less(qwen_parts: tuple[Any, Any]) -> None:
    text = response(40)
    cached, full = qwen(qwen_parts), qwen(qwen_parts, incremental=False)
    for n in range(30, len(text) + 1, 53):  # a branch growing, cut anywhere
        a = cached.step_rewards([item(text[:n])])[0]
        b = full.step_rewards([item(text[:n])])[0]
        assert close(a, b, 1e-4)
    assert cached.forward_calls == full.forward_calls
    whole = len(cached.encode(QUESTION, text))
    # Each check feeds the new text and a short re-encoded tail; full
    # re-encoding grows with the square of the length.
    assert cached.tokens_processed < 1.5 * whole
    assert full.tokens_processed > 5 * cached.tokens_processed


def test_rescoring_the_same_text_runs_nothing(qwen_parts: tuple[Any, Any]) -> None:
    prm = qwen(qwen_parts)
    first = prm.score([item(response(3))])
    tokens = prm.tokens_processed
    assert prm.score([item(response(3))]) == first
    assert prm.tokens_processed == tokens


def test_incremental_survives_a_branch_whose_text_changes(qwen_parts: tuple[Any, Any]) -> None:
    cached, full = qwen(qwen_parts), qwen(qwen_parts, incremental=False)
    for text in (response(4), response(2, 7), response(5)):  # e.g. a branch id reused
        assert close(cached.score([item(text)]), full.score([item(text)]), 1e-4)


def test_release_and_final_drop_caches(qwen_parts: tuple[Any, Any]) -> None:
    prm = qwen(qwen_parts)
    prm.score([item(response(2), "a", 0), item(response(3), "a", 1), item(response(2), "b", 0)])
    assert set(prm.cached_branches) == {BranchId("a", 0), BranchId("a", 1), BranchId("b", 0)}
    prm.release("a")
    assert prm.cached_branches == [BranchId("b", 0)]
    prm.score([item(response(3), "b", 0, final=True)])
    assert prm.cached_branches == []
    assert prm._pool.in_use == 0  # every pool slot back
    prm.release("nobody")  # releasing an unknown request is fine


def test_cache_count_is_bounded(qwen_parts: tuple[Any, Any]) -> None:
    prm = qwen(qwen_parts, max_cached_branches=2)
    prm.score([item(response(2), "r", i) for i in range(4)])
    assert prm.cached_branches == [BranchId("r", 2), BranchId("r", 3)]
    assert prm._pool.in_use == 2  # the evicted branches' slots are free again


def test_token_id_prompts_are_refused_naming_the_request(qwen_parts: tuple[Any, Any]) -> None:
    prm = qwen(qwen_parts)
    with pytest.raises(PRMError, match="'q7'") as info:
        prm.score([item(response(2), "ok"), item(response(2), "q7", prompt=(1, 2, 3))])
    assert info.value.request_ids == {"q7"}
    assert prm.cached_branches == []  # refused before any work


def test_non_finite_rewards_name_the_branch(qwen_parts: tuple[Any, Any], demo_models: dict) -> None:
    model = transformers.AutoModelForTokenClassification.from_pretrained(demo_models["qwen-prm"])
    with torch.no_grad():
        model.score.weight.fill_(float("nan"))
    prm = QwenMathPRM(model, qwen_parts[1])
    with pytest.raises(PRMError, match="0_bad") as info:
        prm.score([item(response(2), "bad")])
    assert info.value.request_ids == {"bad"}
    assert prm.cached_branches == []


# ---------------------------------------------------------------- context limit


@pytest.fixture()
def context_lengths(qwen_parts: tuple[Any, Any]) -> Iterator[list[int]]:
    """Record the context of every forward of the Qwen demo model: cached + fed tokens."""
    model = qwen_parts[0]
    seen: list[int] = []
    original = model.forward

    @functools.wraps(original)  # keeps the signature the PRM inspects
    def forward(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen.append(kwargs["input_ids"].shape[1] + (cache.get_seq_length() if cache else 0))
        return original(*args, **kwargs)

    model.forward = forward
    try:
        yield seen
    finally:
        del model.forward


def test_a_response_far_beyond_the_context_is_windowed(
    qwen_parts: tuple[Any, Any], context_lengths: list[int]
) -> None:
    long = response(150) + "\n\nStep 151: " + "and so on " * 200  # ~3000 tokens, a huge last step
    steps = split_steps(long)
    for incremental in (False, True):
        prm = qwen(qwen_parts, max_length=256, incremental=incremental)
        for n in (500, 2000, 4000, len(long)):
            rewards = prm.step_rewards([item(long[:n])])[0]
            assert 1 <= len(rewards) < len(split_steps(long[:n]))
            assert all(0.0 <= r <= 1.0 for r in rewards)
        enc = prm.encode(QUESTION, long)
        assert len(enc) == 256 and len(enc.segments) == 1  # only the end of the last step
        assert enc.first_step == len(steps) - 1
    assert context_lengths and max(context_lengths) <= 256


def test_windowed_incremental_equals_full(
    qwen_parts: tuple[Any, Any], context_lengths: list[int]
) -> None:
    text = response(80)
    costs = {}
    for stride in (1, 96):
        cached = qwen(qwen_parts, max_length=192, window_stride=stride)
        full = qwen(qwen_parts, max_length=192, window_stride=stride, incremental=False)
        for n in range(40, len(text) + 1, 83):
            assert close(
                cached.step_rewards([item(text[:n])])[0],
                full.step_rewards([item(text[:n])])[0],
                1e-4,
            )
        costs[stride] = cached.tokens_processed
    # With a stride the window's start stays put between jumps, so the cache is reused.
    assert costs[96] < costs[1] / 2
    assert max(context_lengths) <= 192


def test_overflow_error_mode_fails_the_request(qwen_parts: tuple[Any, Any]) -> None:
    prm = qwen(qwen_parts, max_length=128, overflow="error")
    with pytest.raises(PRMError, match="over max_length=128") as info:
        prm.score([item(response(1), "short"), item(response(20), "long")])
    assert info.value.request_ids == {"long"}


# ---------------------------------------------------------------- StepTagPRM


def test_step_tag_prm_matches_the_model_card_usage(shepherd_parts: tuple[Any, Any]) -> None:
    model, tokenizer = shepherd_parts
    prm = shepherd(shepherd_parts, incremental=False)
    good, bad = tokenizer.convert_tokens_to_ids(["Ġ+", "Ġ-"])
    assert (prm.good_id, prm.bad_id) == (good, bad)
    tag = tokenizer.convert_tokens_to_ids("ки")
    for text in (response(1), response(4), "Step 1: ки is a syllable\n\nStep 2: so"):
        steps = split_steps(text)
        # Math-Shepherd's model card: f"{question} {output}", steps ending in " ки".
        full = tokenizer.encode(QUESTION + " " + "\n".join(f"{s} ки" for s in steps))
        assert prm.encode(QUESTION, text).ids() == full
        with torch.inference_mode():
            logits = model(torch.tensor([full])).logits[0][:, [good, bad]]
        scores = torch.softmax(logits, dim=-1)[:, 0]
        at = prm.encode(QUESTION, text).positions()
        assert all(full[p] == tag for p in at) and len(at) == len(steps)
        rewards = prm.step_rewards([item(text)])[0]
        assert close(rewards, scores[at].tolist(), 1e-5)
        assert all(0.0 <= r <= 1.0 for r in rewards)


def test_step_tag_incremental_equals_full(shepherd_parts: tuple[Any, Any]) -> None:
    text = response(20)
    cached, full = shepherd(shepherd_parts), shepherd(shepherd_parts, incremental=False)
    for n in range(20, len(text) + 1, 47):
        a, b = cached.step_rewards([item(text[:n])])[0], full.step_rewards([item(text[:n])])[0]
        assert close(a, b, 1e-4)
    assert cached.tokens_processed * 4 < full.tokens_processed


def test_step_tag_prm_refuses_bad_tokens(shepherd_parts: tuple[Any, Any]) -> None:
    with pytest.raises(ConfigError, match="good_token='\\+ -' must be a single token"):
        shepherd(shepherd_parts, good_token="+ -")
    with pytest.raises(ConfigError, match="same token"):
        shepherd(shepherd_parts, good_token=" +", bad_token=" +")
    with pytest.raises(ConfigError, match="step_tag='<tag>'"):
        shepherd(shepherd_parts, step_tag="<tag>")
    with pytest.raises(ConfigError, match="bad_token=99999"):
        shepherd(shepherd_parts, bad_token=99999)
    ids = shepherd(shepherd_parts, good_token=268, bad_token=" -")
    assert ids.good_id == 268


# ---------------------------------------------------------------- in a sart run


def test_a_sart_run_with_the_demo_qwen_prm(demo_models: dict[str, Path]) -> None:
    text = "\n\n".join(f"Step {i}: {i} + {i} = {2 * i}." for i in range(1, 7)) + " \\boxed{12}"
    script = {
        f"q{r}": [BranchScript(length=40 + 8 * j, text=text, answer="12") for j in range(4)]
        for r in range(2)
    }
    prm = QwenMathPRM.from_pretrained(demo_models["qwen-prm"])
    requests = [sart.Request(rid, QUESTION, sart.sart(4, interval=8)) for rid in script]
    results = sart.run(requests, FakeEngine(script), prm, batch_size=8)
    assert [r.ok for r in results] == [True, True]
    assert all(r.answer == "12" for r in results)
    assert prm.tokens_processed > 0
    assert prm.cached_branches == []  # every request released its branches
    assert all(math.isfinite(b.reward) for r in results for b in r.branches if b.reward is not None)


# ---------------------------------------------------------------- batched incremental scoring


def sart_checks(
    texts: list[list[str]], sep: str, checks: int, grow: int, prompt: str = QUESTION
) -> list[list[ScoreItem]]:
    """SART-like checks of one request whose branches grow by different amounts.

    ``texts[j]`` is branch ``j``'s response as units (characters or words)
    joined by ``sep``. Branch ``j`` joins at check ``j % 3`` (fresh rows among
    cached ones) and grows by ``grow + j`` units a check (mixed new-token
    counts); at check 3 branch 0's text changes in its middle (its cache is
    cut back there); branch 1 ends at check 2 (``final``).
    """
    out = []
    for k in range(checks):
        items = []
        for j, units in enumerate(texts):
            if k < j % 3 or (j == 1 and k > 2):
                continue
            n = min(len(units), (k - j % 3 + 1) * (grow + j))
            if j == 0 and k >= 3:  # a different unit in the middle, moving each check
                edit = "7" if units[n // 2] == "9" else "9"
                units = [*units[: n // 2], edit, *units[n // 2 + 1 :]]
            text = sep.join(units[:n])
            items.append(ScoreItem(BranchId("r", j), prompt, text, n, final=j == 1 and k == 2))
        out.append(items)
    return out


def batched_matches_one_by_one(
    make: Any, checks: list[list[ScoreItem]], batch_size: int, tol: float = 1e-4
) -> tuple[Any, Any]:
    """Score the checks with ``batch_size=1`` (one forward per row, the reference)
    and ``batch_size``; the step rewards, tokens fed and caches kept must agree."""
    one, batched = make(batch_size=1), make(batch_size=batch_size)
    for items in checks:
        want, got = one.step_rewards(items), batched.step_rewards(items)
        assert len(got) == len(want)
        for a, b in zip(want, got):
            assert close(a, b, tol), (a, b)
        assert batched.cached_branches == one.cached_branches
    assert batched.tokens_processed == one.tokens_processed  # real tokens, pads excluded
    assert batched.forward_calls < one.forward_calls
    return one, batched


def qwen_texts(n: int) -> list[list[str]]:
    return [list(response(12, 3 * j)) for j in range(n)]


def test_batched_incremental_equals_one_by_one_qwen(qwen_parts: tuple[Any, Any]) -> None:
    checks = sart_checks(qwen_texts(7), "", checks=8, grow=45)
    one, batched = batched_matches_one_by_one(
        lambda **kw: qwen(qwen_parts, **kw), checks, batch_size=4
    )
    # Each check: fresh and cached rows apart, at most 4 a forward.
    bound = sum(-(-len(c) // 4) + 1 for c in checks)
    assert batched.forward_calls <= bound < one.forward_calls
    # And both equal full re-encoding.
    full = qwen(qwen_parts, incremental=False)
    for items, rewards in zip(checks[-2:], [one.step_rewards(c) for c in checks[-2:]]):
        for a, b in zip(full.step_rewards(items), rewards):
            assert close(a, b, 1e-4)


@pytest.mark.parametrize("stride", [1, 24])
def test_batched_incremental_equals_one_by_one_with_a_moving_window(
    qwen_parts: tuple[Any, Any], stride: int
) -> None:
    checks = sart_checks(qwen_texts(5), "", checks=7, grow=70)
    make = functools.partial(qwen, qwen_parts, max_length=112, window_stride=stride)
    one, batched = batched_matches_one_by_one(make, checks, batch_size=8)
    last = checks[-1][-1]
    assert one.encode(QUESTION, last.text).first_step > 0  # the window did move
    full = make(incremental=False)
    for a, b in zip(full.step_rewards(checks[-1]), batched.step_rewards(checks[-1])):
        assert close(a, b, 1e-4)


def test_batched_incremental_equals_one_by_one_step_tag(shepherd_parts: tuple[Any, Any]) -> None:
    checks = sart_checks(qwen_texts(6), "", checks=6, grow=50)
    batched_matches_one_by_one(lambda **kw: shepherd(shepherd_parts, **kw), checks, batch_size=3)
    windowed = functools.partial(shepherd, shepherd_parts, max_length=96, window_stride=16)
    batched_matches_one_by_one(windowed, checks, batch_size=6)


def test_a_check_of_32_branches_is_one_forward(qwen_parts: tuple[Any, Any]) -> None:
    prm = qwen(qwen_parts, batch_size=32)
    texts = [response(6, j) for j in range(40)]
    for n in (60, 100, 140):  # the first check fills the caches, the others continue them
        calls = prm.forward_calls
        prm.score([item(t[: n + 3 * j], "r", j) for j, t in enumerate(texts[:32])])
        assert prm.forward_calls - calls == 1
    # 8 more branches join: cached and fresh rows run apart, 32 a forward at most.
    calls = prm.forward_calls
    prm.score([item(t[: 180 + j], "r", j) for j, t in enumerate(texts)])
    assert prm.forward_calls - calls == 2
    prm8 = qwen(qwen_parts, batch_size=8)
    prm8.score([item(t[:60], "r", j) for j, t in enumerate(texts[:32])])
    assert prm8.forward_calls == 4


def test_a_failed_batched_forward_keeps_no_half_updated_cache(qwen_parts: tuple[Any, Any]) -> None:
    model = qwen_parts[0]
    texts = [response(8, j) for j in range(6)]
    prm, reference = qwen(qwen_parts, batch_size=3), qwen(qwen_parts, batch_size=1)
    first = [item(t[:150], "r", j) for j, t in enumerate(texts)]
    prm.score(first)
    reference.score(first)
    original = model.forward
    calls = []

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # the second chunk fails, after its cache was merged
            raise RuntimeError("device lost")
        return original(*args, **kwargs)

    second = [item(t[:260], "r", j) for j, t in enumerate(texts)]
    model.forward = forward
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            prm.score(second)
    finally:
        del model.forward
    # The first chunk's branches kept their new caches, the others lost theirs.
    assert len(prm.cached_branches) == 3
    assert prm._pool.in_use == 3  # the failed rows' slots are free again
    third = [item(t[:330], "r", j) for j, t in enumerate(texts)]
    for a, b in zip(prm.step_rewards(third), reference.step_rewards(third)):
        assert close(a, b, 1e-4)


def test_caches_that_cannot_be_merged_are_scored_one_by_one(
    qwen_parts: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sart.prm.hf import CacheAPI

    checks = sart_checks(qwen_texts(4), "", checks=4, grow=60)
    reference = qwen(qwen_parts, batch_size=1)
    monkeypatch.setattr(CacheAPI, "tensors", staticmethod(lambda cache: None))
    prm = qwen(qwen_parts, batch_size=8)
    for items in checks:
        for a, b in zip(reference.step_rewards(items), prm.step_rewards(items)):
            assert close(a, b, 1e-4)
    # Only the first check's fresh rows shared forwards; the split found the
    # layout unreadable and the rest went one by one.
    assert prm.forward_calls == reference.forward_calls - len(checks[0]) + 1


def test_a_cache_unreadable_in_mid_call_scores_the_rest_from_scratch(
    qwen_parts: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sart.prm.hf import CacheAPI

    texts = qwen_texts(4)
    first, second = (
        [item("".join(t[: 60 * k]), "r", j) for j, t in enumerate(texts)] for k in (1, 2)
    )
    reference = qwen(qwen_parts, incremental=False)
    prm = qwen(qwen_parts, batch_size=2)
    prm.step_rewards(first)  # every branch in the pool
    monkeypatch.setattr(CacheAPI, "tensors", staticmethod(lambda cache: None))
    # The first chunk's forward returns a cache the pool cannot read: the pool stops,
    # and the second chunk's rows, whose past was in it, are scored from scratch.
    for a, b in zip(prm.step_rewards(second), reference.step_rewards(second)):
        assert close(a, b, 1e-4)
    assert prm._pool.in_use == 0


class _NoPositionIds(torch.nn.Module):
    """A model whose ``forward`` takes no ``position_ids``."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(
        self, input_ids: Any, attention_mask: Any = None, cache: Any = None, use_cache: Any = None
    ) -> Any:
        # Passed on under the name the inner model takes (``past_key_values`` before
        # transformers 5.2x): the wrapper itself takes ``cache``.
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=use_cache,
            **{hf_compat.cache_argument(self.inner): cache},
        )


def test_without_position_ids_only_caches_of_equal_length_share_a_forward(
    qwen_parts: tuple[Any, Any],
) -> None:
    checks = sart_checks(qwen_texts(5), "", checks=5, grow=60)
    model = _NoPositionIds(qwen_parts[0])
    _, batched = batched_matches_one_by_one(
        lambda **kw: QwenMathPRM(model, qwen_parts[1], **kw), checks, batch_size=8
    )
    with_positions = qwen(qwen_parts, batch_size=8)
    for items in checks:
        with_positions.step_rewards(items)
    assert batched.forward_calls > with_positions.forward_calls


# ---------------------------------------------------------------- the testbed PRM, batched


@pytest.fixture(scope="module")
def testbed_parts() -> tuple[Any, Any]:
    from sart.testbed import PRM_PATH, prm_kwargs

    prm = QwenMathPRM.from_pretrained(PRM_PATH, **prm_kwargs())
    return prm.model, prm.tokenizer


def noisy_traces(n: int, words: int) -> tuple[str, list[list[str]]]:
    import random

    from sart.testbed import make_question, noisy_trace

    rng = random.Random(3)
    question = make_question(rng, 8)
    texts = []
    for _ in range(n):
        units: list[str] = []
        while len(units) < words:
            units += [*noisy_trace(question, rng).split(" "), "\n\n"]
        texts.append(units)
    return question.prompt, texts


@pytest.mark.parametrize("max_length", [512, 64])
def test_batched_incremental_equals_one_by_one_testbed(
    testbed_parts: tuple[Any, Any], max_length: int
) -> None:
    from sart.testbed import prm_kwargs

    prompt, texts = noisy_traces(9, 140)
    checks = sart_checks(texts, " ", checks=8, grow=14, prompt=prompt)

    def make(**kwargs: Any) -> QwenMathPRM:
        options = {**prm_kwargs(), "max_length": max_length, "window_stride": 8, **kwargs}
        return QwenMathPRM(*testbed_parts, **options)

    _, batched = batched_matches_one_by_one(make, checks, batch_size=4)
    # The model's per-position cache state was merged too: no row went one by one.
    assert batched.forward_calls <= sum(-(-len(c) // 4) + 1 for c in checks)
    full = make(incremental=False)
    for a, b in zip(full.step_rewards(checks[-1]), batched.step_rewards(checks[-1])):
        assert close(a, b, 1e-4)


def test_custom_modelling_code_runs_only_when_trusted(tmp_path: Path) -> None:
    # Before: from_pretrained defaulted to trust_remote_code=True, so any checkpoint's
    # Python ran without the user asking.
    import shutil

    from sart import testbed

    ours = tmp_path / "ours"
    shutil.copytree(testbed.PRM_PATH, ours)
    # Only sart's own testbed code: not remote code, loads as the shipped PRM does.
    assert QwenMathPRM.from_pretrained(ours, **testbed.prm_kwargs()).model is not None
    theirs = tmp_path / "theirs"
    shutil.copytree(testbed.PRM_PATH, theirs)
    code = theirs / "modeling_testbed_prm.py"
    code.write_text(code.read_text() + "\n# someone else's code now\n")
    with pytest.raises(sart.ConfigError, match="--trust-remote-code"):
        QwenMathPRM.from_pretrained(theirs, **testbed.prm_kwargs())
    trusted = QwenMathPRM.from_pretrained(theirs, trust_remote_code=True, **testbed.prm_kwargs())
    assert trusted.model is not None


def test_a_checks_tensor_operations_do_not_grow_with_its_rows(
    testbed_parts: tuple[Any, Any],
) -> None:
    # On a GPU each operation is a kernel launch: merging and splitting each row's
    # cache, and reading each row's rewards, made a 32-row check issue ~500
    # operations per row (issue 46). Over the pool, a check of 32 cached rows in one
    # forward issues at most 3 more operations per row than one of 8.
    from torch.profiler import ProfilerActivity, profile

    from sart.testbed import prm_kwargs

    def ops(rows: int) -> float:
        prm = QwenMathPRM(*testbed_parts, **prm_kwargs(), batch_size=64)
        prompt, texts = noisy_traces(rows, 120)

        def check(words: int) -> list[ScoreItem]:
            return [
                ScoreItem(BranchId("r", j), prompt, " ".join(t[:words]), words, final=False)
                for j, t in enumerate(texts)
            ]

        prm.score(check(40))  # every row fresh: no past yet
        prm.score(check(80))  # warm: every row from the pool
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            prm.score(check(120))
        assert prm.forward_calls == 3  # one forward a check
        return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))

    few, many = ops(8), ops(32)
    assert (many - few) / 24 <= 3, (few, many)
