"""Process reward models on transformers: Qwen2.5-Math-PRM and Math-Shepherd-style PRMs.
Needs the ``[hf]`` extra (torch, transformers); ``import sart`` never imports
this module. Two reference implementations of the PRM protocol
(``sart.prm.base``), the torch backend of the input formats of
``sart.prm.formats``:

- ``QwenMathPRM``: a token-classification PRM in the format of
  Qwen/Qwen2.5-Math-PRM-7B (``QwenFormat``): the reward of a step is the
  softmax of the two logits at the ``<extra_0>`` after it, column 1.
- ``StepTagPRM``: a causal LM in the format of Math-Shepherd
  (``StepTagFormat``): the reward of a step is the softmax over the "+" and
  "-" logits at its tag, the "+" part.

Both split the response into steps on ``"\\n\\n"`` (``sart.prm.aggregate``),
rate every step, and reduce the step rewards to one with ``aggregate``
(default ``min``, see that module for why). ``step_rewards(items)`` returns
the step rewards themselves. Their keyword options are declared once in
``sart.prm.options`` (``QwenMathPRM.Options``, ``StepTagPRM.Options``).

Context limit. A PRM has ``max_length`` tokens of context (4096 for
Qwen2.5-Math-PRM-7B); inputs are never longer: ``overflow``,
``window_stride`` and ``window`` say how they are cut, as described in
``sart.prm.window`` (``Encoded`` and ``fit_context`` are the windowing,
``encode(prompt, text)`` shows what the model will see). ``window=W`` is
also the bounded mode of the vLLM PRM, which cannot score incrementally.

Incremental scoring (``incremental=True``, the default). SART re-scores every
running branch each ``T`` generated tokens; re-encoding the whole response
each time costs about ``L / (2T)`` PRM tokens per generated token for a
branch of ``L`` tokens. Instead each branch (keyed by ``ScoreItem.branch``)
keeps the model's keys and values of its last input (in the PRM's KV pool, or
a cache of its own: see Batching) and the rewards read from it. A new input
reuses the longest common prefix of token ids with the cached one: only the
rest is fed, continuing from the cached positions up to there. Since
the model is causal, the logits at a position depend only on the tokens up
to it, so the rewards of the steps inside the common prefix are the ones
read before, and the result equals full re-encoding (up to float rounding).
A check thus costs the new tokens plus the re-encoded tail: the separator
(or tag) after the unfinished last step, and the few tokens whose
tokenisation changed as the text grew. When windowing moves the window's
start, the common prefix ends at the prefix (system prompt and question), so
the window is re-encoded: that is the rebuild, and with ``window_stride=1``
it happens at nearly every check once a branch is past the context. A
branch's cache is dropped when its request is released (``release``), when
an item with ``final=True`` has been scored, when a call fails before its
row was scored (rows scored before the failure keep their new caches), and,
beyond ``max_cached_branches`` branches, least recently used first (its pool
slot is then free for another). Memory: up to ``max_length`` tokens of keys and
values per cached branch (about 56 KiB per token for the 7B Qwen PRM in
bfloat16, so 224 MiB at 4096 tokens).
``tokens_processed`` counts the tokens actually fed to the model, so that a
benchmark can report PRM tokens per generated token
(``benchmarks/prm_cost.py``).

Batching. Without ``incremental``, items are scored in groups of
``batch_size`` (sorted by length, right-padded, with an attention mask).
With ``incremental``, the new tokens of a call's items run in as few
forwards as ``batch_size`` allows, each row continuing from its own branch's
past. Rows with a past and fresh ones are batched apart, each group sorted
by new-token count (a right pad costs a whole forward per token, a left pad
only attention) and cut into chunks of ``batch_size`` rows. The branches' keys
and values live in the PRM's KV pool (``sart.prm.hf_pool``: one tensor per
layer, a slot per branch): a chunk's past is read from it in one indexed read
per tensor, each row's positions right-aligned after left pads that the
attention mask hides; the new tokens are right-padded; ``position_ids`` give
every row its real positions (rotary embeddings must not count the pads;
with a model whose ``forward`` takes no ``position_ids``, only rows with pasts
of equal length share a forward); and each row's new positions go back into
its slot in one indexed write per tensor, the rewards out in one read. So a
check's tensor work does not grow with its rows (a GPU launches a kernel per
operation: merging and splitting each row's own cache cost ~500 operations a
row). A model that keeps per-position state on its caches declares it, and
the pool keeps that state beside keys and values: its class's
``cache_state_key`` names the cache attribute holding a dict of tensors shaped
``[batch, positions, ...]`` aligned with the cache's positions (the testbed
PRM's running features, ``sart.testbed.modeling_testbed_prm``); the model may
read a row's state at its last cached position, which is the row's own, never
at a pad. ``batch_size=1`` scores one row per forward on a cache of the
branch's own, cropped in place (the reference path), and so do caches that
cannot be read into the pool (anything but a ``DynamicCache`` of plain
layers: sliding windows, quantised, static). Memory: the pool holds as many
slots as branches are cached at once, each as long as the longest of them (it
grows by doubling). ``benchmarks/prm_batching.py`` times checks of 1 to 32
branches on the testbed PRM. These remain reference implementations, not a
PRM server (no paged memory, no batching across calls).

Devices. ``device="cuda:1"`` moves the model there, inputs follow; without a
device the model stays where it is (e.g. placed by ``device_map``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sart.errors import ConfigError, needs_extra
from sart.prm.aggregate import check_finite
from sart.prm.formats import (
    QWEN_SYSTEM_PROMPT,
    QwenFormat,
    Span,
    StepTagFormat,
    encode_item,
)
from sart.prm.options import QwenMathOptions, StepTagOptions
from sart.prm.window import OVERFLOW_MODES, ContextLimit, ContextOverflow, Encoded, fit_context

with needs_extra("sart.prm.hf", "hf"):
    from sart.prm.hf_base import TransformersPRM
    from sart.prm.hf_cache import CacheAPI
    from sart.prm.hf_loading import ships_only_sart_code

__all__ = [
    "OVERFLOW_MODES",
    "QWEN_SYSTEM_PROMPT",
    "CacheAPI",
    "ContextLimit",
    "ContextOverflow",
    "Encoded",
    "QwenMathPRM",
    "Span",
    "StepTagPRM",
    "TransformersPRM",
    "check_finite",
    "encode_item",
    "fit_context",
]
"""Defined here: the two PRM classes (their base is ``.hf_base``); the rest is
re-exported from its home (``sart.prm.window``, ``.formats``, ``.aggregate``,
``.hf_cache``); rows over
branch caches are in ``.hf_rows``, the KV pool in ``.hf_pool``, loading helpers in
``.hf_loading``."""


def _from_format(name: str, doc: str) -> Any:
    """A read-only attribute of the PRM that is its format's ``name``."""
    return property(lambda self: getattr(self.format, name), doc=doc)


# --------------------------------------------------------------------------- Qwen2.5-Math-PRM


class QwenMathPRM(TransformersPRM):
    """Qwen2.5-Math-PRM: a token classifier rating each ``<extra_0>`` after a step.

    The input is ``sart.prm.formats.QwenFormat``'s (``messages``,
    ``reference_ids``: the documented usage), built from token ids; the
    options are ``QwenMathOptions`` (``sart.prm.options``). The model must
    give 2 labels per token.
    """

    Options = QwenMathOptions
    format: QwenFormat

    system_prompt = _from_format("system_prompt", "The chat's system turn (None: none).")
    step_separator = _from_format("step_separator", "The token after each step.")
    separator_id = _from_format("separator_id", "The id of ``step_separator``.")

    def messages(self, question: str, response: str) -> list[dict[str, str]]:
        """The chat of the documented usage, with ``response`` as the assistant turn."""
        return self.format.messages(question, response)

    def reference_ids(self, question: str, steps: Sequence[str]) -> list[int]:
        """The documented full-text encoding: steps joined by the separator, with
        a trailing one, as the assistant turn of the rendered chat."""
        return self.format.reference_ids(question, steps)

    def _make_format(self, tokenizer: Any) -> QwenFormat:
        return QwenFormat(tokenizer, self.options, self.limit, owner=type(self).__name__)

    @classmethod
    def _trusted(cls, path: str | Path, trust_remote_code: bool) -> bool:
        return trust_remote_code or ships_only_sart_code(path)

    @classmethod
    def _model_loader(cls, path: str | Path, trust_remote_code: bool) -> Any:
        """A checkpoint with custom code registered for ``AutoModel`` (the real
        Qwen2.5-Math-PRM: ``Qwen2ForProcessRewardModel``) loads with
        ``AutoModel``; any other with ``AutoModelForTokenClassification`` (with
        a standard architecture, ``AutoModel`` would give the bare model without
        the classification head)."""
        from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification

        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except ValueError as exc:
            if "trust_remote_code" not in str(exc):
                raise
            raise ConfigError(
                f"the PRM checkpoint {str(path)!r} ships its own modelling code, and loading "
                "it runs that code: pass trust_remote_code=True (sart bench: "
                "--trust-remote-code) if you trust its source"
            ) from None
        custom = "AutoModel" in (getattr(config, "auto_map", None) or {})
        return AutoModel if custom else AutoModelForTokenClassification

    def _two_way(self, logits: Any) -> Any:
        if logits.shape[-1] != 2:
            raise ConfigError(
                f"QwenMathPRM needs a model with 2 labels per token, not {logits.shape[-1]}"
            )
        return logits


# --------------------------------------------------------------------------- Math-Shepherd


class StepTagPRM(TransformersPRM):
    """A Math-Shepherd-style PRM: a causal LM rating each step at a tag token.

    The input is ``sart.prm.formats.StepTagFormat``'s (``render``: the text;
    tokens given as strings or ids, see there); the options are
    ``StepTagOptions`` (``sart.prm.options``). The reward of a step is the
    softmax over the ``good_token`` and ``bad_token`` logits at its tag, the
    good part. Incremental scoring and windowing work as for ``QwenMathPRM``.
    """

    Options = StepTagOptions
    format: StepTagFormat
    _subset_logits = True  # the vocabulary logits of every position would be large

    step_tag = _from_format("step_tag", "The tag after each step, as text.")
    tag_id = _from_format("tag_id", "The id of ``step_tag``.")
    good_id = _from_format("good_id", "The id of ``good_token``.")
    bad_id = _from_format("bad_id", "The id of ``bad_token``.")

    def render(self, question: str, steps: Sequence[str]) -> tuple[str, list[int], list[int]]:
        """The input text, where each step's segment starts, and where each tag is (in chars)."""
        return self.format.render(question, steps)

    def _make_format(self, tokenizer: Any) -> StepTagFormat:
        return StepTagFormat(tokenizer, self.options, self.limit, owner=type(self).__name__)

    @classmethod
    def _model_loader(cls, path: str | Path, trust_remote_code: bool) -> Any:
        """A causal LM."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def _two_way(self, logits: Any) -> Any:
        return logits[:, [self.bad_id, self.good_id]]
