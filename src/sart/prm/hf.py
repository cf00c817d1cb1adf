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
keeps the model's KV cache of its last input and the rewards read from it. A
new input reuses the longest common prefix of token ids with the cached one:
only the rest is fed, continuing from the cache's positions up to there
(the cache is cropped, or cut while batching, see below). Since
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
beyond ``max_cached_branches`` branches, least recently used first. Memory: a
cache holds up to ``max_length`` tokens of keys and values per branch (about
56 KiB per token for the 7B Qwen PRM in bfloat16, so 224 MiB at 4096 tokens).
``tokens_processed`` counts the tokens actually fed to the model, so that a
benchmark can report PRM tokens per generated token
(``benchmarks/prm_cost.py``).

Batching. Without ``incremental``, items are scored in groups of
``batch_size`` (sorted by length, right-padded, with an attention mask).
With ``incremental``, the new tokens of a call's items run in as few
forwards as ``batch_size`` allows, each row continuing from its own branch's
cache. Rows with a cache and fresh ones are batched apart, each group sorted
by new-token count (a right pad costs a whole forward per token, a left pad
only attention) and cut into chunks of ``batch_size`` rows. For a chunk, each
row's cached keys and values up to its common prefix are left-padded with
zeros to the longest and stacked into one cache (``sart.prm.hf_cache``);
the new tokens are
right-padded; the attention mask hides both pads, and ``position_ids`` give
every row its real positions (rotary embeddings must not count the pads;
with a model whose ``forward`` takes no ``position_ids``, only rows with
caches of equal length share a forward). Afterwards the merged cache is cut
back into one cache per branch holding its own positions only, copied (a
view would keep the whole batch alive while one branch is cached). The
merged cache may hold more slots than ``max_length`` (longest past plus
longest new part), never a position beyond it. A model that keeps
per-position state on its caches declares it, and that state is padded,
stacked and cut like keys and values: its class's ``cache_state_key`` names
the cache attribute holding a dict of tensors shaped ``[batch, positions,
...]`` aligned with the cache's positions (the testbed PRM's running
features, ``sart.testbed.modeling_testbed_prm``); the model may read a row's
state at its last cached position, which is the row's own, never at a pad.
Chunks of one row, and caches that cannot be merged (anything but a
``DynamicCache`` of plain layers: sliding windows, quantised, static), run
one by one, the cache cropped in place; ``batch_size=1`` is that path
throughout. Memory: merging and splitting copy a chunk's caches once each,
so a check needs up to about twice the chunk's cached keys and values for a
moment. ``benchmarks/prm_batching.py`` times checks of 1 to 32 branches on
the testbed PRM. These remain reference implementations, not a PRM server
(no paged memory, no batching across calls).

Devices. ``device="cuda:1"`` moves the model there, inputs follow; without a
device the model stays where it is (e.g. placed by ``device_map``).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from sart.errors import ConfigError, PRMError, needs_extra
from sart.prm.aggregate import aggregate as aggregate_rewards
from sart.prm.aggregate import check_finite
from sart.prm.base import ScoreItem
from sart.prm.formats import (
    QWEN_SYSTEM_PROMPT,
    InputFormat,
    QwenFormat,
    Span,
    StepTagFormat,
    encode_item,
    good_probability,
)
from sart.prm.options import QwenMathOptions, StepTagOptions, TransformersOptions, build_options
from sart.prm.window import OVERFLOW_MODES, ContextLimit, ContextOverflow, Encoded, fit_context
from sart.types import BranchId

with needs_extra("sart.prm.hf", "hf"):
    import torch
    import transformers

    from sart.prm.hf_cache import CacheAPI
    from sart.prm.hf_loading import (
        check_positions,
        forward_parameters,
        load_kwargs,
        model_device,
        output_logits,
        ships_only_sart_code,
    )
    from sart.prm.hf_rows import BranchCache, IncrementalRows, chunks

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
"""Defined here: the three PRM classes; the rest is re-exported from its home
(``sart.prm.window``, ``.formats``, ``.aggregate``, ``.hf_cache``); rows over
branch caches are in ``.hf_rows``, loading helpers in ``.hf_loading``."""


# --------------------------------------------------------------------------- the shared PRM

PRMT = TypeVar("PRMT", bound="TransformersPRM")


class TransformersPRM(IncrementalRows):
    """The machinery shared by ``QwenMathPRM`` and ``StepTagPRM``: incremental
    caches, batching, rewards. Subclasses name their options (``Options``, from
    ``sart.prm.options``), build their input format (``_make_format``, from
    ``sart.prm.formats``: steps, tokens, windowing), say which transformers
    class loads their checkpoints (``_model_loader``) and how the two
    "bad"/"good" logits are read from the model's output (``_two_way``)."""

    Options: ClassVar[type[TransformersOptions]] = TransformersOptions
    """The keyword options of the constructor and ``from_pretrained``."""

    #: Ask a causal LM for the logits of the rating positions only (``logits_to_keep``).
    _subset_logits = False

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: str | torch.device | None = None,
        **options: Any,
    ) -> None:
        self.options = build_options(self.Options, type(self).__name__, options)
        """The validated options (fields of ``Options``)."""
        self.limit: ContextLimit = self.options.limit
        check_positions(model, self.limit.max_length)
        self.aggregate = self.options.aggregate
        self.batch_size = self.options.batch_size
        self.incremental = self.options.incremental
        self.max_cached_branches = self.options.max_cached_branches
        if device is not None:
            model = model.to(device)
        self.model = model.eval()
        self.device = model_device(model)
        self.tokenizer = tokenizer
        self._cache_api = CacheAPI.of(model)
        self._empty_cache = self._cache_api.new(model)
        self._keep_logits = self._subset_logits and "logits_to_keep" in forward_parameters(model)
        pad = tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self._caches: OrderedDict[BranchId, BranchCache] = OrderedDict()
        self.tokens_processed = 0
        """Tokens fed to the model so far (padding excluded)."""
        self.forward_calls = 0
        # Rows continuing from caches of different lengths share a forward only if
        # their real positions can be given (left pads must not shift RoPE).
        self._merge_pasts = "position_ids" in forward_parameters(model)
        # Per-position state a model keeps on its caches, merged like keys and values.
        self._state_key: str | None = getattr(model, "cache_state_key", None)
        self._merging = True  # off once a cache turns out not to split (then one by one)
        self.format = self._make_format(tokenizer)
        """The input format (``sart.prm.formats``)."""

    # ------------------------------------------------------------------ protocol

    def score(self, items: Sequence[ScoreItem]) -> list[float]:
        """One reward in [0, 1] per item: its step rewards reduced with ``aggregate``."""
        return [aggregate_rewards(r, self.aggregate) for r in self.step_rewards(items)]

    def step_rewards(self, items: Sequence[ScoreItem]) -> list[list[float]]:
        """The reward of each step the model sees, per item (the window's steps
        when the response is longer than the context; none for a blank response)."""
        encoded = [self._encode_item(item) for item in items]  # all errors before any work
        if self.incremental:
            results = self._score_incremental(items, encoded)
        else:
            results = self._score_batched(encoded)
        self._check_finite(items, results)
        for item in items:
            if item.final:
                self._caches.pop(item.branch, None)
        return results

    def release(self, request_id: str) -> None:
        """Drop the caches of the request's branches."""
        for branch in [b for b in self._caches if b.request_id == request_id]:
            del self._caches[branch]

    @property
    def cached_branches(self) -> list[BranchId]:
        """Branches holding a cache, least recently used first."""
        return list(self._caches)

    def encode(self, prompt: str, text: str) -> Encoded:
        """The input the model sees for ``text`` answering ``prompt`` (windowed)."""
        return self.format.encode(prompt, text)

    @classmethod
    def from_pretrained(
        cls: type[PRMT],
        path: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: Any = None,
        trust_remote_code: bool = False,
        model_kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> PRMT:
        """Load model and tokenizer from a local directory or the hub.

        ``options`` go to the constructor (the fields of ``Options``; checked
        before anything is loaded), ``model_kwargs`` to the model's
        ``from_pretrained``. The model class is the subclass's
        (``_model_loader``).

        Custom code runs only if you ask for it (``trust_remote_code=True``, as
        in transformers and vLLM): loading it executes whatever Python the
        checkpoint ships. A checkpoint that needs it and is not trusted raises
        ``ConfigError`` saying so (``QwenMathPRM``). The one exception is a
        local checkpoint whose only code is sart's own testbed PRM class, byte
        for byte (the shipped testbed PRM, or one ``sart testbed train``
        wrote): ``QwenMathPRM`` does not count that as remote code.
        """
        build_options(cls.Options, cls.__name__, options)
        trust_remote_code = cls._trusted(path, trust_remote_code)
        loader = cls._model_loader(path, trust_remote_code)
        model = loader.from_pretrained(path, **load_kwargs(dtype, trust_remote_code, model_kwargs))
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code
        )
        return cls(model, tokenizer, device=device, **options)

    # ------------------------------------------------------------------ hooks

    def _make_format(self, tokenizer: Any) -> InputFormat:
        """The input format, from ``self.options`` and ``self.limit``."""
        raise NotImplementedError

    @classmethod
    def _trusted(cls, path: str | Path, trust_remote_code: bool) -> bool:
        """Whether loading ``path`` may run the code it ships."""
        return trust_remote_code

    @classmethod
    def _model_loader(cls, path: str | Path, trust_remote_code: bool) -> Any:
        """The transformers class whose ``from_pretrained`` loads the model."""
        raise NotImplementedError

    def _two_way(self, logits: Any) -> Any:
        """``[n, 2]`` logits (bad, good) from the model's logits at ``n`` rating positions."""
        raise NotImplementedError

    # ------------------------------------------------------------------ scoring

    def _encode_item(self, item: ScoreItem) -> Encoded:
        return self.format.encode_item(item)

    def _score_batched(self, encoded: Sequence[Encoded]) -> list[list[float]]:
        results: list[list[float]] = [[] for _ in encoded]
        order = sorted(
            (i for i, e in enumerate(encoded) if e.segments), key=lambda i: len(encoded[i])
        )
        for chunk in chunks(order, self.batch_size):
            _, logits = self._forward(
                [encoded[i].ids() for i in chunk], [encoded[i].positions() for i in chunk]
            )
            for i, rows in zip(chunk, logits):
                results[i] = good_probability(rows)
        return results

    def _score_incremental(
        self, items: Sequence[ScoreItem], encoded: Sequence[Encoded]
    ) -> list[list[float]]:
        rows = [
            self._plan(item.branch, enc) if enc.segments else None
            for item, enc in zip(items, encoded)
        ]
        live = [row for row in rows if row is not None]
        try:
            self._run(live)
        finally:
            # Entries go back in the items' order (least recently used first), those
            # of rows that failed or did not run are dropped.
            for row in live:
                if row.done is not None:
                    self._remember(row.branch, row.done)
        return [[] if row is None else [row.rewards[p] for p in row.positions] for row in rows]

    def _forward(
        self,
        rows: list[list[int]],
        positions: list[list[int]],
        cache: Any = None,
        past: Sequence[int] | None = None,
    ) -> tuple[Any, list[Any]]:
        """Run the model on right-padded ``rows``; the (bad, good) logits at each
        row's ``positions`` (indices into the row).

        With ``cache``, row ``r`` continues from ``past[r]`` cached tokens
        (default: all the cache holds). The cache then holds ``max(past)``
        positions per row, a row's own ones last after masked left pads, and the
        row's tokens are given their real positions ``past[r], past[r] + 1, ...``
        (rotary embeddings must not count the pads).
        """
        width = max(map(len, rows))
        held = cache.get_seq_length() if cache is not None else 0
        past = list(past) if past is not None else [held] * len(rows)
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), held + width), dtype=torch.long)
        for r, row in enumerate(rows):
            input_ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[r, held - past[r] : held + len(row)] = 1
        kwargs: dict[str, Any] = {
            "input_ids": input_ids.to(self.device),
            "use_cache": cache is not None,
        }
        if any(p < held for p in past) or any(len(row) < width for row in rows):
            kwargs["attention_mask"] = mask.to(self.device)
        if any(p < held for p in past):
            first = torch.tensor(past, dtype=torch.long).unsqueeze(1)
            kwargs["position_ids"] = (first + torch.arange(width)).to(self.device)
        if cache is not None:
            kwargs[self._cache_api.argument] = cache
        index = [list(p) for p in positions]
        if self._keep_logits:
            keep = sorted(set(itertools.chain(*positions)))
            where = {p: k for k, p in enumerate(keep)}
            index = [[where[p] for p in row] for row in positions]
            kwargs["logits_to_keep"] = torch.tensor(keep, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            output = self.model(**kwargs)
        self.tokens_processed += sum(map(len, rows))
        self.forward_calls += 1
        logits = output_logits(output)
        return output, [self._two_way(logits[r, row]) for r, row in enumerate(index)]

    def _check_finite(self, items: Sequence[ScoreItem], results: Sequence[Sequence[float]]) -> None:
        try:
            check_finite(items, results)
        except PRMError:
            for item, r in zip(items, results):  # a cache that produced NaN is not worth keeping
                if not all(map(math.isfinite, r)):
                    self._caches.pop(item.branch, None)
            raise


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
