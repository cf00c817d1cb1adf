"""PRM options, declared once: the keywords of every PRM backend's constructor.

Pure Python (attrs). Each backend class names its options class as
``Options``; its constructor, ``from_pretrained`` and ``from_engine_args``
take the fields as keywords, and ``prm.options`` is the validated, frozen
value. A bad value raises ``ConfigError`` naming the field and the value; an
unknown keyword raises ``TypeError`` listing the options.

::

    ContextLimit (sart.prm.window)  max_length, overflow, window_stride, window
    └── PRMOptions                  + aggregate
        ├── TransformersOptions     + batch_size, incremental, max_cached_branches
        │   ├── QwenMathOptions     + QwenFormatOptions: system_prompt, step_separator
        │   └── StepTagOptions      + StepTagFormatOptions: step_tag, good_token, bad_token
        └── VLLMQwenOptions         + QwenFormatOptions

``QwenMathOptions`` is ``sart.prm.hf.QwenMathPRM``'s, ``StepTagOptions``
``sart.prm.hf.StepTagPRM``'s and ``VLLMQwenOptions``
``sart.prm.vllm.VLLMQwenPRM``'s (whose ``max_length``, left out or
``None``, defaults to the smaller of 4096 and vLLM's ``max_model_len``).
What loads or places a model (``device``, ``dtype``, ``trust_remote_code``,
vLLM's engine arguments) is not a PRM option: those stay arguments of the
constructors and loaders that use them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from sart.errors import int_at_least
from sart.prm.aggregate import DEFAULT_AGGREGATION, check_aggregation
from sart.prm.formats import QwenFormatOptions, StepTagFormatOptions
from sart.prm.window import ContextLimit

__all__ = [
    "PRMOptions",
    "QwenFormatOptions",
    "QwenMathOptions",
    "StepTagFormatOptions",
    "StepTagOptions",
    "TransformersOptions",
    "VLLMQwenOptions",
    "build_options",
    "split_options",
]


@attrs.frozen(kw_only=True, slots=False)
class PRMOptions(ContextLimit):
    """The options of every PRM: its context limit (``ContextLimit``'s fields)
    and how step rewards become one reward."""

    aggregate: str = attrs.field(default=DEFAULT_AGGREGATION)
    """``last``, ``min``, ``prod`` or ``mean`` (``sart.prm.aggregate``)."""

    @aggregate.validator
    def _check_aggregate(self, _attr: attrs.Attribute, value: str) -> None:
        check_aggregation(value)

    @property
    def limit(self) -> ContextLimit:
        """The context limit alone."""
        return ContextLimit(**{f.name: getattr(self, f.name) for f in attrs.fields(ContextLimit)})


@attrs.frozen(kw_only=True, slots=False)
class TransformersOptions(PRMOptions):
    """The options of the transformers backend (``sart.prm.hf``)."""

    batch_size: int = attrs.field(default=8, validator=int_at_least(1))
    """Rows per forward."""
    incremental: bool = True
    """Keep each branch's KV cache between checks and feed only what changed."""
    max_cached_branches: int | None = attrs.field(
        default=None, validator=int_at_least(1, optional=True, rule="None or >= 1")
    )
    """Branches whose cache is kept, least recently used out first (``None``: all)."""


@attrs.frozen(kw_only=True, slots=False)
class QwenMathOptions(TransformersOptions, QwenFormatOptions):
    """``QwenMathPRM``'s options."""


@attrs.frozen(kw_only=True, slots=False)
class StepTagOptions(TransformersOptions, StepTagFormatOptions):
    """``StepTagPRM``'s options."""


@attrs.frozen(kw_only=True, slots=False)
class VLLMQwenOptions(PRMOptions, QwenFormatOptions):
    """``VLLMQwenPRM``'s options."""


OptionsT = TypeVar("OptionsT", bound=PRMOptions)


def build_options(kind: type[OptionsT], owner: str, given: Mapping[str, Any]) -> OptionsT:
    """``kind(**given)``, an unknown keyword refused with a ``TypeError`` that
    names ``owner`` (the PRM class) and lists its options."""
    names = attrs.fields_dict(kind)
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TypeError(
            f"{owner}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"its options are {', '.join(sorted(names))}"
        )
    return kind(**given)


def split_options(
    kind: type[PRMOptions], kwargs: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` split into ``kind``'s options and the rest (e.g. engine arguments)."""
    names = attrs.fields_dict(kind)
    options = {k: v for k, v in kwargs.items() if k in names}
    return options, {k: v for k, v in kwargs.items() if k not in names}
