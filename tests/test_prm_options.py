"""PRM options (``sart.prm.options``): declared once, validated, pure Python."""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest

from sart.errors import ConfigError
from sart.prm import options as prm_options
from sart.prm.formats import QWEN_SYSTEM_PROMPT
from sart.prm.options import (
    PRMOptions,
    QwenFormatOptions,
    QwenMathOptions,
    StepTagFormatOptions,
    StepTagOptions,
    TransformersOptions,
    VLLMQwenOptions,
    build_options,
    split_options,
)
from sart.prm.window import ContextLimit

ALL = (
    ContextLimit,
    PRMOptions,
    TransformersOptions,
    QwenFormatOptions,
    StepTagFormatOptions,
    QwenMathOptions,
    StepTagOptions,
    VLLMQwenOptions,
)
CONTEXT = {"max_length", "overflow", "window_stride", "window"}
TRANSFORMERS = {"batch_size", "incremental", "max_cached_branches"}
QWEN = {"system_prompt", "step_separator"}
STEP_TAG = {"step_tag", "good_token", "bad_token"}


def names(kind: type) -> set[str]:
    return set(attrs.fields_dict(kind))


def test_each_backend_takes_the_options_of_its_parts() -> None:
    assert names(PRMOptions) == CONTEXT | {"aggregate"}
    assert names(QwenMathOptions) == CONTEXT | {"aggregate"} | TRANSFORMERS | QWEN
    assert names(StepTagOptions) == CONTEXT | {"aggregate"} | TRANSFORMERS | STEP_TAG
    assert names(VLLMQwenOptions) == CONTEXT | {"aggregate"} | QWEN


def test_every_option_is_declared_in_one_class_only() -> None:
    declared: dict[str, list[str]] = {}
    for kind in ALL:
        for field in attrs.fields(kind):
            if not field.inherited:
                declared.setdefault(field.name, []).append(kind.__name__)
    assert {name: owners for name, owners in declared.items() if len(owners) > 1} == {}


def test_the_defaults_are_the_documented_ones() -> None:
    qwen = QwenMathOptions()
    assert (qwen.max_length, qwen.overflow, qwen.window_stride, qwen.window) == (
        4096,
        "window",
        1,
        None,
    )
    assert (qwen.aggregate, qwen.batch_size, qwen.incremental, qwen.max_cached_branches) == (
        "min",
        8,
        True,
        None,
    )
    assert (qwen.system_prompt, qwen.step_separator) == (QWEN_SYSTEM_PROMPT, "<extra_0>")
    tag = StepTagOptions()
    assert (tag.step_tag, tag.good_token, tag.bad_token) == ("ки", " +", " -")


def test_options_are_a_context_limit_and_give_it_alone() -> None:
    options = VLLMQwenOptions(max_length=512, window=64, window_stride=8, aggregate="mean")
    assert options.limit == ContextLimit(512, "window", 8, 64)
    assert type(options.limit) is ContextLimit
    assert isinstance(options, ContextLimit) and isinstance(options, QwenFormatOptions)
    assert attrs.evolve(options, window=None).limit.window is None


@pytest.mark.parametrize(
    ("kind", "field", "value", "rule"),
    [
        (QwenMathOptions, "max_length", 8, ">= 16"),
        (StepTagOptions, "overflow", "truncate", "one of ('window', 'error')"),
        (VLLMQwenOptions, "window_stride", 0, ">= 1"),
        (QwenMathOptions, "window", 2.5, "None or an int >= 1 (response tokens)"),
        (PRMOptions, "aggregate", "median", "one of ['last', 'mean', 'min', 'prod']"),
        (TransformersOptions, "batch_size", 0, ">= 1"),
        (QwenMathOptions, "max_cached_branches", 0, "None or >= 1"),
        (VLLMQwenOptions, "system_prompt", 7, "None or a str"),
        (QwenMathOptions, "step_separator", None, "a non-empty str"),
        (StepTagOptions, "good_token", 1.0, "a token (str) or a token id (int)"),
    ],
)
def test_bad_values_name_the_field_and_the_value(
    kind: type, field: str, value: Any, rule: str
) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(f"{field}={value!r} must be {rule}")):
        kind(**{field: value})


def test_unknown_keywords_name_the_prm_and_list_its_options() -> None:
    assert build_options(QwenMathOptions, "QwenMathPRM", {"window": 64}).window == 64
    with pytest.raises(
        TypeError, match=r"QwenMathPRM\(\) got unexpected keyword argument\(s\)"
    ) as e:
        build_options(QwenMathOptions, "QwenMathPRM", {"windw": 64, "step_tag": "x"})
    assert "'step_tag', 'windw'" in str(e.value)
    assert "its options are aggregate, batch_size, incremental" in str(e.value)
    with pytest.raises(ConfigError, match="window=0"):  # known, but a bad value
        build_options(VLLMQwenOptions, "VLLMQwenPRM", {"window": 0})


def test_split_options_keeps_the_rest_for_the_engine() -> None:
    options, rest = split_options(
        VLLMQwenOptions, {"window": 64, "max_model_len": 1024, "dtype": "float32"}
    )
    assert options == {"window": 64}
    assert rest == {"max_model_len": 1024, "dtype": "float32"}


def test_the_module_exports_what_it_defines() -> None:
    assert len(set(prm_options.__all__)) == len(prm_options.__all__)
    assert all(hasattr(prm_options, name) for name in prm_options.__all__)
