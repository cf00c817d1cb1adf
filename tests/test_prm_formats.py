"""PRM input formats (``sart.prm.formats``) on a real tokenizer, without torch.

The tokenizer is the demo models' byte-level BPE (``sart.demo_models.build_tokenizer``,
trained here with the ``tokenizers`` library and wrapped by transformers, whose
tokenizers need no torch). The reference encodings are the documented ones:
Qwen2.5-Math-PRM's chat text tokenised at once, and Math-Shepherd's model-card text.
Skipped only where transformers, tokenizers or jinja2 (chat templates) is not installed.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
pytest.importorskip("jinja2")  # transformers renders chat templates with it

from sart.demo_models import build_tokenizer
from sart.errors import ConfigError, PRMError
from sart.prm.aggregate import split_steps
from sart.prm.base import ScoreItem
from sart.prm.formats import (
    QWEN_SYSTEM_PROMPT,
    QwenFormat,
    QwenFormatOptions,
    StepTagFormat,
    StepTagFormatOptions,
    encode_item,
)
from sart.prm.window import ContextLimit, Encoded, fit_context
from sart.types import BranchId

QUESTION = "What is 7 + 8?"
TEXTS = (
    "Step 1: add 7 and 8. 7 + 8 = 15.",
    "Step 1: first\n\nStep 2: half a st",
    "Step 1: add 0 and 3.\n\n\n\nStep 2: 0 + 3 = 3.\n\nSo the answer is \\boxed{3}.",
)


def response(n_steps: int) -> str:
    return "\n\n".join(
        f"Step {i + 1}: add {i} and {i + 3}. {i} + {i + 3} = {2 * i + 3}." for i in range(n_steps)
    )


def item(text: str, rid: str = "r", prompt: Any = QUESTION) -> ScoreItem:
    return ScoreItem(BranchId(rid, 0), prompt, text, len(text), False)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


# ---------------------------------------------------------------- Qwen2.5-Math-PRM


@pytest.mark.parametrize("system_prompt", [QWEN_SYSTEM_PROMPT, None])
def test_the_qwen_input_is_the_documented_chat_text_without_its_suffix(
    tokenizer: Any, system_prompt: str | None
) -> None:
    fmt = QwenFormat(tokenizer, QwenFormatOptions(system_prompt=system_prompt))
    sep = tokenizer.convert_tokens_to_ids("<extra_0>")
    assert fmt.separator_id == sep
    for text in TEXTS:
        steps = split_steps(text)
        system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages = [
            *system,
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"},
        ]
        assert fmt.messages(QUESTION, messages[-1]["content"]) == messages
        full = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False))
        assert fmt.reference_ids(QUESTION, steps) == full
        enc = fmt.encode(QUESTION, text)
        ours = enc.ids()
        assert full[: len(ours)] == ours
        assert tokenizer.decode(full[len(ours) :]) == "<|im_end|>\n"  # only the suffix is left out
        assert [ours[p] for p in enc.positions()] == [sep] * len(steps)
        assert enc.first_step == 0 and len(enc.segments) == len(steps)


def test_a_blank_response_has_no_input(tokenizer: Any) -> None:
    for fmt in (QwenFormat(tokenizer), StepTagFormat(tokenizer)):
        assert fmt.encode(QUESTION, "") == Encoded((), (), ())
        assert fmt.encode(QUESTION, " \n\n\n\n ") == Encoded((), (), ())


def test_the_format_windows_its_inputs_with_its_limit(tokenizer: Any) -> None:
    limit = ContextLimit(96, window_stride=8)
    for fmt in (QwenFormat(tokenizer, limit=limit), StepTagFormat(tokenizer, limit=limit)):
        text = response(30)
        enc = fmt.encode(QUESTION, text)
        assert len(enc) <= 96 and enc.first_step > 0
        assert enc == fit_context(fmt.encode_steps(QUESTION, split_steps(text)), limit)
        full = fmt.encode_steps(QUESTION, split_steps(text))
        assert enc.segments == full.segments[enc.first_step :]  # the latest steps, whole


def test_qwen_format_refuses_what_it_cannot_use(tokenizer: Any) -> None:
    with pytest.raises(ConfigError, match="step_separator='<sep>' must be a single token"):
        QwenFormat(tokenizer, QwenFormatOptions(step_separator="<sep>"))
    plain = build_tokenizer()
    plain.chat_template = None
    with pytest.raises(ConfigError, match="MyPRM needs a tokenizer with a chat template"):
        QwenFormat(plain, owner="MyPRM")
    with pytest.raises(ConfigError, match="system_prompt=3 must be None or a str"):
        QwenFormatOptions(system_prompt=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="step_separator='' must be a non-empty str"):
        QwenFormatOptions(step_separator="")


# ---------------------------------------------------------------- Math-Shepherd


def test_the_step_tag_input_is_the_model_card_text(tokenizer: Any) -> None:
    fmt = StepTagFormat(tokenizer)
    good, bad = tokenizer.convert_tokens_to_ids(["Ġ+", "Ġ-"])
    assert (fmt.good_id, fmt.bad_id) == (good, bad)
    tag = tokenizer.convert_tokens_to_ids("ки")
    assert fmt.tag_id == tag and fmt.step_tag == "ки"
    for text in (*TEXTS, "Step 1: ки is a syllable\n\nStep 2: so"):
        steps = split_steps(text)
        # Math-Shepherd's model card: f"{question} {output}", steps ending in " ки".
        full = tokenizer.encode(QUESTION + " " + "\n".join(f"{s} ки" for s in steps))
        enc = fmt.encode(QUESTION, text)
        assert enc.ids() == full
        assert fmt.render(QUESTION, steps)[0] == QUESTION + " " + "\n".join(
            f"{s} ки" for s in steps
        )
        # one tag per step, found by offsets: the "ки" inside a step's text is not one
        assert [full[p] for p in enc.positions()] == [tag] * len(steps)


def test_step_tag_format_refuses_bad_tokens(tokenizer: Any) -> None:
    def fmt(**options: Any) -> StepTagFormat:
        return StepTagFormat(tokenizer, StepTagFormatOptions(**options))

    with pytest.raises(ConfigError, match="good_token='\\+ -' must be a single token"):
        fmt(good_token="+ -")
    with pytest.raises(ConfigError, match="same token"):
        fmt(good_token=" +", bad_token=" +")
    with pytest.raises(ConfigError, match="step_tag='<tag>'"):
        fmt(step_tag="<tag>")
    with pytest.raises(ConfigError, match="bad_token=99999"):
        fmt(bad_token=99999)
    with pytest.raises(ConfigError, match="step_tag=True must be a token"):
        fmt(step_tag=True)
    assert fmt(good_token=268, bad_token=" -").good_id == 268
    tag = tokenizer.convert_tokens_to_ids("ки")
    assert fmt(step_tag=tag).step_tag == "ки"  # an id is decoded to place the tag
    with pytest.raises(ConfigError, match="needs a fast tokenizer"):
        StepTagFormat(SimpleNamespace(is_fast=False))


# ---------------------------------------------------------------- items


def test_items_that_cannot_be_encoded_fail_their_request(tokenizer: Any) -> None:
    strict = QwenFormat(tokenizer, limit=ContextLimit(160, overflow="error"), owner="MyPRM")
    assert strict.encode_item(item(response(1))) == strict.encode(QUESTION, response(1))
    with pytest.raises(PRMError, match=r"MyPRM needs the question as text.*'ids'") as info:
        strict.encode_item(item(response(1), "ids", prompt=[1, 2, 3]))
    assert info.value.request_ids == {"ids"}
    with pytest.raises(PRMError, match="over max_length=160 \\(overflow='error'\\)") as info:
        strict.encode_item(item(response(20), "long"))
    assert info.value.request_ids == {"long"}
    # the function names the object's class when no owner is given
    with pytest.raises(PRMError, match="QwenFormat needs the question as text"):
        encode_item(QwenFormat(tokenizer), item("x", prompt=(1,)))


def test_a_tag_that_is_not_found_fails_the_request(tokenizer: Any) -> None:
    fmt = StepTagFormat(tokenizer)
    fmt.tag_id = tokenizer.convert_tokens_to_ids("Ġ+")  # the text's tags are not this token
    with pytest.raises(PRMError, match="the tag after step 0 is not tokenised") as info:
        fmt.encode_item(item(response(2), "tagless"))
    assert info.value.request_ids == {"tagless"}


def test_the_formats_run_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from sart.demo_models import build_tokenizer\n"
        "from sart.prm.formats import QwenFormat, StepTagFormat\n"
        "tok = build_tokenizer()\n"
        "for fmt in (QwenFormat(tok), StepTagFormat(tok)):\n"
        "    assert len(fmt.encode('What?', 'a\\n\\nb').positions()) == 2\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
