"""Process reward models on transformers: Qwen2.5-Math-PRM and Math-Shepherd-style PRMs.

Needs the ``[hf]`` extra (torch, transformers); ``import sart`` never imports
this module. Two reference implementations of the PRM protocol
(``sart.prm.base``):

- ``QwenMathPRM``: a token-classification PRM in the format of
  Qwen/Qwen2.5-Math-PRM-7B: the chat template with the system prompt, the
  question as the user turn, and as the assistant turn the steps each followed
  by ``<extra_0>``; the reward of a step is the softmax of the two logits at
  its ``<extra_0>``, column 1.
- ``StepTagPRM``: a causal LM in the format of Math-Shepherd
  (peiyi9979/math-shepherd-mistral-7b-prm): ``"{question} {step1} ки\\n{step2} ки"``;
  the reward of a step is the softmax over the "+" and "-" logits at its tag,
  the "+" part.

Both split the response into steps on ``"\\n\\n"`` (``sart.prm.aggregate``),
rate every step, and reduce the step rewards to one with ``aggregate``
(default ``min``, see that module for why). ``step_rewards(items)`` returns
the step rewards themselves.

Context limit. A PRM has ``max_length`` tokens of context (4096 for
Qwen2.5-Math-PRM-7B); inputs are never longer. ``overflow="window"`` (the
default) keeps the prefix (system prompt and question) and the most recent
steps that fit, dropping the earliest steps: their rewards are then not part
of the aggregate, since the model did not see them in this call. If even the
last step does not fit, its most recent tokens are kept. If the prefix alone
would leave the steps less than ``min(their length, max_length // 2)``
tokens, the prefix is cut from the left. ``window_stride = S > 1`` makes the
window's start move in jumps of ``S`` tokens instead of step by step: the
window then holds between ``B - S`` and ``B`` tokens of steps (``B`` the
room left by the prefix), but incremental scoring keeps its cache between
jumps (see below). ``overflow="error"`` raises ``PRMError`` for the request
instead. ``window = W`` bounds every input whatever the context: the prefix
and the most recent steps within ``W`` response tokens, cut as above (same
helpers, same stride), so that re-scoring a long branch costs
``O(prefix + W)`` tokens per check instead of ``O(L)``: the bounded mode of
the vLLM PRM, which cannot score incrementally. Unlike a smaller
``max_length``, it does not depend on the question's length and never cuts
the question. Steps before the window are not rated, and the kept ones are
rated without the earlier ones in view: what that costs in reward quality
depends on the PRM (``benchmarks/prm_window.py`` measures it on the
testbed). ``Encoded`` and ``fit_context`` are the windowing, exposed for
tests and inspection (``encode(prompt, text)`` shows what the model will
see).

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
zeros to the longest and stacked into one cache; the new tokens are
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

import bisect
import copy
import inspect
import itertools
import math
import re
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from sart.errors import ConfigError, MissingDependencyError, PRMError, config_check
from sart.prm.aggregate import DEFAULT_AGGREGATION, check_aggregation, split_steps
from sart.prm.aggregate import aggregate as aggregate_rewards
from sart.prm.base import ScoreItem
from sart.types import BranchId

try:
    import torch
    import transformers
except ImportError as exc:  # pragma: no cover - only without the extra
    raise MissingDependencyError(
        f"sart.prm.hf needs torch and transformers ({exc.name} is missing); "
        "install them with: pip install 'sart[hf]'"
    ) from exc

QWEN_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
"""The system prompt of Qwen2.5-Math-PRM's documented usage."""

OVERFLOW_MODES = ("window", "error")


# --------------------------------------------------------------------------- inputs


@attrs.frozen
class Encoded:
    """One PRM input: ``prefix`` then one segment per step.

    ``rating[i]`` is the index, inside ``segments[i]``, of the token whose
    logits rate step ``i`` (the separator or tag after it). ``first_step`` is
    the index among the response's steps of ``segments[0]`` (not 0 when the
    window dropped early steps).
    """

    prefix: tuple[int, ...]
    segments: tuple[tuple[int, ...], ...]
    rating: tuple[int, ...]
    first_step: int = 0

    def __len__(self) -> int:
        return len(self.prefix) + sum(map(len, self.segments))

    def ids(self) -> list[int]:
        return list(itertools.chain(self.prefix, *self.segments))

    def positions(self) -> list[int]:
        """Positions in ``ids()`` of the rating tokens, one per step."""
        out, start = [], len(self.prefix)
        for segment, at in zip(self.segments, self.rating):
            out.append(start + at)
            start += len(segment)
        return out


@attrs.frozen
class ContextLimit:
    """How inputs longer than the PRM's context are handled (see the module docstring)."""

    max_length: int = attrs.field(default=4096)
    overflow: str = attrs.field(default="window")
    window_stride: int = attrs.field(default=1)
    window: int | None = attrs.field(default=None)
    """Response tokens kept in every input (``None``: as many as ``max_length`` allows)."""

    @max_length.validator
    def _check_max_length(self, _attr: attrs.Attribute, value: int) -> None:
        config_check(isinstance(value, int) and value >= 16, "max_length", value, ">= 16")

    @overflow.validator
    def _check_overflow(self, _attr: attrs.Attribute, value: str) -> None:
        config_check(value in OVERFLOW_MODES, "overflow", value, f"one of {OVERFLOW_MODES}")

    @window_stride.validator
    def _check_stride(self, _attr: attrs.Attribute, value: int) -> None:
        config_check(isinstance(value, int) and value >= 1, "window_stride", value, ">= 1")

    @window.validator
    def _check_window(self, _attr: attrs.Attribute, value: int | None) -> None:
        config_check(
            value is None or (isinstance(value, int) and value >= 1),
            "window",
            value,
            "None or an int >= 1 (response tokens)",
        )


class ContextOverflow(Exception):
    """An input is longer than ``max_length`` and ``overflow="error"``."""


def fit_context(enc: Encoded, limit: ContextLimit) -> Encoded:
    """``enc`` cut to at most ``limit.window`` response tokens, then to at most
    ``limit.max_length`` tokens (see the module docstring).

    Deterministic in ``enc``: full and incremental scoring see the same window.
    """
    if limit.window is not None and len(enc) - len(enc.prefix) > limit.window:
        enc = _recent_steps(enc, enc.prefix, limit.window, limit.window_stride)
    if len(enc) <= limit.max_length:
        return enc
    if limit.overflow == "error":
        raise ContextOverflow(f"{len(enc)} tokens, over max_length={limit.max_length}")
    steps_length = len(enc) - len(enc.prefix)
    # The steps get at least min(their length, half the context); a longer
    # prefix (a huge question) loses its beginning.
    room = limit.max_length - min(steps_length, limit.max_length // 2)
    prefix = enc.prefix[-room:] if len(enc.prefix) > room else enc.prefix
    return _recent_steps(enc, prefix, limit.max_length - len(prefix), limit.window_stride)


def _recent_steps(enc: Encoded, prefix: tuple[int, ...], budget: int, stride: int) -> Encoded:
    """``prefix`` and the most recent steps of ``enc`` within ``budget`` tokens."""
    first = _first_kept(enc.segments, budget, stride)
    segments, rating = enc.segments[first:], enc.rating[first:]
    if sum(map(len, segments)) > budget:  # only the last step is left, and it is too long
        segments, rating = _keep_end(segments[-1], rating[-1], budget)
    return Encoded(prefix, segments, rating, enc.first_step + first)


def _keep_end(
    segment: tuple[int, ...], at: int, budget: int
) -> tuple[tuple[tuple[int, ...]], tuple[int]]:
    """The most recent ``budget`` tokens of a segment that keep its rating token
    ``at``; tokens after that one do not change its logits and go first."""
    excess = len(segment) - budget
    if at >= excess:
        return (segment[excess:],), (at - excess,)
    start = max(0, at + 1 - budget)
    return (segment[start : at + 1],), (at - start,)


def _first_kept(segments: Sequence[Sequence[int]], budget: int, stride: int) -> int:
    """Index of the first segment of the window: the first one starting at or
    after the smallest multiple of ``stride`` that leaves at most ``budget``
    tokens; the last segment if none does."""
    starts = list(itertools.accumulate(map(len, segments), initial=0))
    excess = starts[-1] - budget
    if excess <= 0:
        return 0
    offset = -(-excess // stride) * stride  # ceil to a multiple of stride
    return min(bisect.bisect_left(starts, offset), len(segments) - 1)


# --------------------------------------------------------------------------- transformers glue


def _version() -> tuple[int, int]:
    major, minor = re.findall(r"\d+", transformers.__version__)[:2]
    return int(major), int(minor)


def _dtype_kwarg() -> str:
    # ``torch_dtype`` was renamed ``dtype`` in transformers 4.56.
    return "dtype" if _version() >= (4, 56) else "torch_dtype"


@attrs.frozen
class CacheAPI:
    """How a model's ``forward`` takes a KV cache: ``cache=`` in transformers 5.x,
    ``past_key_values=`` in 4.x (and in custom code written for it, such as
    Qwen2.5-Math-PRM's). Inspected once per model."""

    argument: str

    @classmethod
    def of(cls, model: Any) -> CacheAPI:
        try:
            parameters = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            parameters = {}
        return cls("cache" if "cache" in parameters else "past_key_values")

    @staticmethod
    def new(model: Any) -> Any:
        from transformers import DynamicCache

        try:
            return DynamicCache(config=model.config)
        except TypeError:  # transformers < 4.56 takes no config
            return DynamicCache()

    def returned(self, output: Any, passed: Any) -> Any:
        """The cache after a forward: the one the output carries, under the same
        name as the argument, if any (4.x causal LMs return it), else the one
        passed in, which the model filled in place (token-classification
        outputs and Qwen's custom code carry none)."""
        value = getattr(output, self.argument, None)
        if value is None or value is passed:
            return passed
        if isinstance(value, tuple):  # the legacy format, from old custom code
            return transformers.DynamicCache.from_legacy_cache(value)
        return value

    @staticmethod
    def crop(cache: Any, length: int) -> None:
        """Keep the first ``length`` tokens. A negative ``crop`` argument means
        "remove that many" in both 4.x and 5.x (5.x refuses positive ones)."""
        remove = cache.get_seq_length() - length
        if remove > 0:
            cache.crop(-remove)
        if cache.get_seq_length() != length:
            raise RuntimeError(f"cache crop to {length} left {cache.get_seq_length()} tokens")

    @staticmethod
    def tensors(cache: Any) -> list[tuple[Any, Any]] | None:
        """Each layer's (keys, values), ``[batch, heads, positions, head_dim]``, if
        the cache is laid out so that rows can be merged and split: a
        ``DynamicCache`` of plain ``DynamicLayer`` objects (transformers 5.x and
        late 4.x) or of ``key_cache``/``value_cache`` lists (earlier 4.x).
        ``None`` for any other (sliding windows, quantised, static, offloaded).
        """
        if type(cache) is not transformers.DynamicCache:
            return None
        layers = getattr(cache, "layers", None)
        if layers is not None:
            if not all(type(layer) is _DYNAMIC_LAYER and layer.is_initialized for layer in layers):
                return None
            out = [(layer.keys, layer.values) for layer in layers]
        else:
            keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
            if not isinstance(keys, list) or not isinstance(values, list):
                return None
            out = list(zip(keys, values))
        lengths = {t.shape[-2] if t.dim() == 4 else -1 for pair in out for t in pair}
        return out if out and len(lengths) == 1 and -1 not in lengths else None

    @staticmethod
    def fill(cache: Any, tensors: Sequence[tuple[Any, Any]]) -> Any:
        """``cache``, new and empty, holding ``tensors`` (as ``tensors`` returns
        them) as they are, not copied."""
        layers = getattr(cache, "layers", None)
        for i, (keys, values) in enumerate(tensors):
            if layers is not None and i < len(layers) and type(layers[i]) is _DYNAMIC_LAYER:
                _install(layers[i], keys, values)
            else:  # 4.x lists: ``update`` appends a layer's first tensors as they are
                cache.update(keys, values, i)
        return cache


_DYNAMIC_LAYER = getattr(transformers.cache_utils, "DynamicLayer", None)


def _install(layer: Any, keys: Any, values: Any) -> None:
    """Put tensors into an empty ``DynamicLayer`` as they are (its ``update``
    would concatenate them to an empty tensor: a copy of the whole cache)."""
    try:
        layer.lazy_initialization(keys, values)  # sets the device and dtype
    except TypeError:  # transformers 4.5x: lazy_initialization(key_states)
        layer.lazy_initialization(keys)
    layer.keys, layer.values = keys, values


def _output_logits(output: Any) -> Any:
    logits = getattr(output, "logits", None)
    return output[0] if logits is None else logits


def _model_device(model: Any) -> Any:
    device = getattr(model, "device", None)
    if device is not None:
        return torch.device(device)
    return next(model.parameters()).device


def _chunks(seq: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for start in range(0, len(seq), size):
        yield seq[start : start + size]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _stack_left_padded(parts: Sequence[Any], lengths: Sequence[int], dim: int) -> Any:
    """Row ``r`` of the result is the first ``lengths[r]`` entries along ``dim`` of
    ``parts[r]`` (a batch of one), right-aligned in ``max(lengths)``, zeros on the
    left. Zeros, not garbage: a masked key gets weight 0, and 0 * NaN is NaN
    (only the pads are zeroed: zeroing the whole tensor first costs a pass)."""
    width = max(lengths)
    shape = list(parts[0].shape)
    shape[0], shape[dim] = len(parts), width
    out = parts[0].new_empty(shape)
    for r, (part, n) in enumerate(zip(parts, lengths)):
        row = out[r]
        row.narrow(dim - 1, 0, width - n).zero_()
        row.narrow(dim - 1, width - n, n).copy_(part[0].narrow(dim - 1, 0, n))
    return out


def _cut_rows(merged: Any, held: int, spans: Sequence[tuple[int, int]], dim: int) -> list[Any]:
    """Row ``r`` of ``merged`` as a batch of one, its ``spans[r] = (past, new)``
    positions only: from ``held - past`` (after the left pads) to ``held + new``
    (before the right pads). Copied (``clone`` of a slice is compact): a view
    would keep the whole batch alive."""
    return [
        merged[r : r + 1].narrow(dim, held - past, past + new).clone()
        for r, (past, new) in enumerate(spans)
    ]


@attrs.define
class _BranchCache:
    """What a branch keeps between checks: the KV cache of its last input, that
    input's ids, and the rewards read at its rating positions."""

    cache: Any
    ids: list[int] = attrs.Factory(list)
    rewards: dict[int, float] = attrs.Factory(dict)


@attrs.define
class _Row:
    """One item of an incremental call: its input, what its branch's cache
    already holds of it, and, once scored, the branch's new entry."""

    branch: BranchId
    ids: list[int]
    positions: list[int]
    """Rating positions in ``ids``."""
    start: int = 0
    """Tokens of ``ids`` the cache holds (their common prefix with the cached input)."""
    cache: Any = None
    """The branch's cache, holding at least ``start`` tokens; ``None`` if ``start == 0``."""
    rewards: dict[int, float] = attrs.Factory(dict)
    """Rewards by rating position: those before ``start`` are known beforehand."""
    done: _BranchCache | None = None
    """The branch's entry to keep, once the row is scored."""

    @property
    def new(self) -> list[int]:
        return self.ids[self.start :]

    def new_positions(self) -> list[int]:
        """The rating positions not yet read, relative to ``new``."""
        return [p - self.start for p in self.positions if p >= self.start]

    def finish(self, cache: Any, rewards: Sequence[float] = ()) -> None:
        """Record the rewards read at ``new_positions`` and the cache to keep
        (``None``: keep none)."""
        fresh = [p for p in self.positions if p >= self.start]
        self.rewards.update(zip(fresh, rewards, strict=True))
        self.done = None if cache is None else _BranchCache(cache, self.ids, self.rewards)


# --------------------------------------------------------------------------- the shared PRM


class TransformersPRM:
    """The machinery shared by ``QwenMathPRM`` and ``StepTagPRM``: steps,
    windowing, incremental caches, batching, rewards. Subclasses say how a
    (question, steps) pair is tokenised (``_encode_steps``) and how the two
    "bad"/"good" logits are read from the model's output (``_two_way``)."""

    #: Ask a causal LM for the logits of the rating positions only (``logits_to_keep``).
    _subset_logits = False

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: str | torch.device | None = None,
        max_length: int = 4096,
        aggregate: str = DEFAULT_AGGREGATION,
        batch_size: int = 8,
        incremental: bool = True,
        overflow: str = "window",
        window_stride: int = 1,
        window: int | None = None,
        max_cached_branches: int | None = None,
    ) -> None:
        config_check(
            isinstance(batch_size, int) and batch_size >= 1, "batch_size", batch_size, ">= 1"
        )
        config_check(
            max_cached_branches is None or max_cached_branches >= 1,
            "max_cached_branches",
            max_cached_branches,
            "None or >= 1",
        )
        self.limit = ContextLimit(max_length, overflow, window_stride, window)
        _check_positions(model, max_length)
        self.aggregate = check_aggregation(aggregate)
        self.batch_size = batch_size
        self.incremental = incremental
        self.max_cached_branches = max_cached_branches
        if device is not None:
            model = model.to(device)
        self.model = model.eval()
        self.device = _model_device(model)
        self.tokenizer = tokenizer
        self._cache_api = CacheAPI.of(model)
        self._empty_cache = self._cache_api.new(model)
        self._keep_logits = self._subset_logits and "logits_to_keep" in _forward_parameters(model)
        pad = tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self._caches: OrderedDict[BranchId, _BranchCache] = OrderedDict()
        self.tokens_processed = 0
        """Tokens fed to the model so far (padding excluded)."""
        self.forward_calls = 0
        # Rows continuing from caches of different lengths share a forward only if
        # their real positions can be given (left pads must not shift RoPE).
        self._merge_pasts = "position_ids" in _forward_parameters(model)
        # Per-position state a model keeps on its caches, merged like keys and values.
        self._state_key: str | None = getattr(model, "cache_state_key", None)
        self._merging = True  # off once a cache turns out not to split (then one by one)

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
        steps = split_steps(text)
        if not steps:
            return Encoded((), (), ())
        return fit_context(self._encode_steps(prompt, steps), self.limit)

    # ------------------------------------------------------------------ hooks

    def _encode_steps(self, question: str, steps: list[str]) -> Encoded:
        raise NotImplementedError

    def _two_way(self, logits: Any) -> Any:
        """``[n, 2]`` logits (bad, good) from the model's logits at ``n`` rating positions."""
        raise NotImplementedError

    # ------------------------------------------------------------------ scoring

    def _encode_item(self, item: ScoreItem) -> Encoded:
        return encode_item(self, item)

    def _score_batched(self, encoded: Sequence[Encoded]) -> list[list[float]]:
        results: list[list[float]] = [[] for _ in encoded]
        order = sorted(
            (i for i, e in enumerate(encoded) if e.segments), key=lambda i: len(encoded[i])
        )
        for chunk in _chunks(order, self.batch_size):
            _, logits = self._forward(
                [encoded[i].ids() for i in chunk], [encoded[i].positions() for i in chunk]
            )
            for i, rows in zip(chunk, logits):
                results[i] = _good_probability(rows)
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

    def _plan(self, branch: BranchId, enc: Encoded) -> _Row:
        """The branch's row: its cached entry taken out (put back only once
        scored: a failed forward may leave a cache half-updated) and the longest
        prefix of the input it holds."""
        ids, positions = enc.ids(), enc.positions()
        entry = self._caches.pop(branch, None)
        if entry is None:
            return _Row(branch, ids, positions)
        start = _common_prefix(entry.ids, ids)
        # A rating position inside the common prefix must have its reward already.
        start = min([start, *(p for p in positions if p < start and p not in entry.rewards)])
        if start == 0:
            return _Row(branch, ids, positions)
        known = {p: r for p, r in entry.rewards.items() if p < start}
        return _Row(branch, ids, positions, start, entry.cache, known)

    def _run(self, rows: Sequence[_Row]) -> None:
        """Score the rows: the new tokens of up to ``batch_size`` of them per forward."""
        pending = []
        for row in rows:
            if row.start < len(row.ids):
                pending.append(row)
            else:  # nothing new (the same text, or a prefix of it): no forward
                with torch.inference_mode():  # the cache holds inference tensors
                    self._cache_api.crop(row.cache, row.start)
                row.finish(row.cache)
        # Rows with and without a cache are batched apart: a model's per-position
        # cache state need not have a neutral value for an all-padding past.
        for cached in (False, True):
            group = [row for row in pending if (row.cache is not None) == cached]
            # A right pad costs a whole forward per token, a left pad only attention:
            # rows with similar numbers of new tokens go together first.
            group.sort(key=lambda row: (len(row.ids) - row.start, row.start))
            for chunk in _chunks(group, self.batch_size):
                self._run_chunk(chunk)

    def _run_chunk(self, chunk: Sequence[_Row]) -> None:
        merged = self._merge(chunk) if len(chunk) > 1 else None
        if merged is None:
            for row in chunk:
                self._run_one(row)
            return
        for row in chunk:  # the merged cache holds their data: let theirs go (memory)
            row.cache = None
        output, logits = self._forward(
            [row.new for row in chunk],
            [row.new_positions() for row in chunk],
            cache=merged,
            past=[row.start for row in chunk],
        )
        caches = self._split(self._cache_api.returned(output, merged), chunk)
        for row, cache, two_way in zip(chunk, caches, logits):
            row.finish(cache, _good_probability(two_way))

    def _run_one(self, row: _Row) -> None:
        """The row on its own cache, cropped in place (the one-by-one path)."""
        if row.cache is None:
            cache = self._new_cache()
        else:
            cache = row.cache
            with torch.inference_mode():
                self._cache_api.crop(cache, row.start)
        output, logits = self._forward([row.new], [row.new_positions()], cache=cache)
        row.finish(self._cache_api.returned(output, cache), _good_probability(logits[0]))

    def _merge(self, chunk: Sequence[_Row]) -> Any | None:
        """One cache for the chunk's rows: each row's first ``start`` positions,
        left-padded to the longest (the pads are masked in ``_forward``); ``None``
        if their caches cannot be merged (then they run one by one)."""
        if not self._merging:
            return None
        if all(row.cache is None for row in chunk):
            return self._new_cache()
        if not self._merge_pasts and len({row.start for row in chunk}) > 1:
            return None
        parts = []
        for row in chunk:
            part = self._cache_parts(row.cache)
            if part is None:
                return None
            parts.append(part)
        if len({len(layers) for layers, _ in parts}) != 1:
            return None
        past = [row.start for row in chunk]
        with torch.inference_mode():
            layers = [
                (
                    _stack_left_padded([k for k, _ in layer], past, dim=2),
                    _stack_left_padded([v for _, v in layer], past, dim=2),
                )
                for layer in zip(*(layers for layers, _ in parts))
            ]
            state = {
                name: _stack_left_padded([s[name] for _, s in parts], past, dim=1)
                for name in parts[0][1]
            }
            return self._filled(layers, state)

    def _split(self, cache: Any, chunk: Sequence[_Row]) -> list[Any]:
        """One cache per row from the merged one, its real positions only (past
        and new, without the pads); ``None`` each if the cache cannot be split."""
        parts = self._cache_parts(cache)
        if parts is None:
            self._merging = False  # the forward returned a cache of another layout
            return [None] * len(chunk)
        layers, state = parts
        held = cache.get_seq_length() - max(len(row.new) for row in chunk)
        spans = [(row.start, len(row.new)) for row in chunk]
        with torch.inference_mode():
            cut_layers = [
                (_cut_rows(keys, held, spans, dim=2), _cut_rows(values, held, spans, dim=2))
                for keys, values in layers
            ]
            cut_state = {name: _cut_rows(v, held, spans, dim=1) for name, v in state.items()}
            return [
                self._filled(
                    [(keys[r], values[r]) for keys, values in cut_layers],
                    {name: rows[r] for name, rows in cut_state.items()},
                )
                for r in range(len(chunk))
            ]

    def _cache_parts(self, cache: Any) -> tuple[list[tuple[Any, Any]], dict[str, Any]] | None:
        """The cache's layers (``CacheAPI.tensors``) and the model's per-position
        state on it (``cache_state_key``; empty if the model keeps none), or
        ``None`` if the cache cannot be merged or split."""
        layers = self._cache_api.tensors(cache)
        if layers is None:
            return None
        if self._state_key is None:
            return layers, {}
        state = getattr(cache, self._state_key, None)
        return (layers, state) if isinstance(state, dict) and state else None

    def _new_cache(self) -> Any:
        # Building a DynamicCache from the config costs ~50 us (its layer types),
        # copying an empty one a third of that; a batched check makes one per row.
        return copy.deepcopy(self._empty_cache)

    def _filled(self, layers: Sequence[tuple[Any, Any]], state: dict[str, Any]) -> Any:
        cache = self._cache_api.fill(self._new_cache(), layers)
        if self._state_key is not None:
            setattr(cache, self._state_key, state)
        return cache

    def _remember(self, branch: BranchId, entry: _BranchCache) -> None:
        self._caches[branch] = entry
        if self.max_cached_branches is not None:
            while len(self._caches) > self.max_cached_branches:
                self._caches.popitem(last=False)

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
        logits = _output_logits(output)
        return output, [self._two_way(logits[r, row]) for r, row in enumerate(index)]

    def _check_finite(self, items: Sequence[ScoreItem], results: Sequence[Sequence[float]]) -> None:
        try:
            check_finite(items, results)
        except PRMError:
            for item, r in zip(items, results):  # a cache that produced NaN is not worth keeping
                if not all(map(math.isfinite, r)):
                    self._caches.pop(item.branch, None)
            raise


def encode_item(prm: Any, item: ScoreItem) -> Encoded:
    """``prm.encode(question, text)`` for one item, failures as ``PRMError`` naming its
    request (shared by the PRM adapters that use this encoding)."""
    request = item.branch.request_id
    if not isinstance(item.prompt, str):
        raise PRMError(
            f"{type(prm).__name__} needs the question as text, but request {request!r} "
            f"has a token-id prompt (branch {item.branch}); give the request a str prompt",
            [request],
        )
    try:
        return prm.encode(item.prompt, item.text)
    except ContextOverflow as exc:
        raise PRMError(
            f"PRM input for branch {item.branch} is {exc} (overflow='error')", [request]
        ) from None


def check_finite(items: Sequence[ScoreItem], results: Sequence[Sequence[float]]) -> None:
    """Raise ``PRMError`` naming the requests whose step rewards are not all finite."""
    bad = [item.branch for item, r in zip(items, results) if not all(map(math.isfinite, r))]
    if bad:
        raise PRMError(
            f"PRM gave non-finite step rewards for branch {', '.join(map(str, bad))}",
            {b.request_id for b in bad},
        )


def _good_probability(two_way: Any) -> list[float]:
    return torch.softmax(two_way.float(), dim=-1)[:, 1].tolist()


def _forward_parameters(model: Any) -> Mapping[str, Any]:
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def _check_positions(model: Any, max_length: int) -> None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and max_length > limit:
        raise ConfigError(
            f"max_length={max_length} must be <= the model's max_position_embeddings ({limit})"
        )


def _ships_only_sart_code(path: str | Path) -> bool:
    """Whether ``path`` is a local checkpoint whose only Python files are copies of
    sart's own testbed PRM modelling code (so trusting them runs no foreign code)."""
    folder = Path(path)
    if not folder.is_dir():
        return False
    shipped = sorted(folder.glob("*.py"))
    if not shipped:
        return False
    own = (
        Path(__file__).resolve().parent.parent / "testbed" / "modeling_testbed_prm.py"
    ).read_bytes()
    return all(file.read_bytes() == own for file in shipped)


def _load_kwargs(dtype: Any, trust_remote_code: bool, extra: Mapping[str, Any] | None) -> dict:
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, **(extra or {})}
    if dtype is not None:
        kwargs[_dtype_kwarg()] = dtype
    return kwargs


# --------------------------------------------------------------------------- Qwen2.5-Math-PRM


_STEP_MEMO = 1 << 14
"""Tokenised steps ``QwenMathPRM`` remembers (least recently used out first)."""


class QwenMathPRM(TransformersPRM):
    """Qwen2.5-Math-PRM: a token classifier rating each ``<extra_0>`` after a step.

    The input is built from token ids, not text: the chat template rendered
    with a placeholder as the assistant turn is split around it into a prefix
    (tokenised once per question), each step is tokenised on its own and
    followed by the separator id, and the template's suffix is left out (the
    model is causal: the logits at the separators do not depend on it). The
    separator is a special token, so no BPE merge crosses it and these ids are
    those of the documented full-text encoding with byte-level tokenizers such
    as Qwen's (a step starting with whitespace may tokenise differently after
    the template's ``"\\n"``); ``reference_ids`` is that encoding, and the
    constructor warns if the two disagree on a sample.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: str | torch.device | None = None,
        max_length: int = 4096,
        aggregate: str = DEFAULT_AGGREGATION,
        system_prompt: str | None = QWEN_SYSTEM_PROMPT,
        batch_size: int = 8,
        incremental: bool = True,
        overflow: str = "window",
        window_stride: int = 1,
        window: int | None = None,
        max_cached_branches: int | None = None,
        step_separator: str = "<extra_0>",
    ) -> None:
        super().__init__(
            model,
            tokenizer,
            device=device,
            max_length=max_length,
            aggregate=aggregate,
            batch_size=batch_size,
            incremental=incremental,
            overflow=overflow,
            window_stride=window_stride,
            window=window,
            max_cached_branches=max_cached_branches,
        )
        self._init_format(system_prompt, step_separator, "QwenMathPRM")

    def _init_format(self, system_prompt: str | None, step_separator: str, who: str) -> None:
        """The input format's state, from ``self.tokenizer`` (also used by the vLLM
        adapter, which has the format but no transformers model)."""
        self.system_prompt = system_prompt
        self.step_separator = step_separator
        self.separator_id = _single_token(self.tokenizer, step_separator, "step_separator")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"{who} needs a tokenizer with a chat template")
        self._prefixes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._steps: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._check_encoding()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: Any = None,
        trust_remote_code: bool = False,
        model_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> QwenMathPRM:
        """Load model and tokenizer from a local directory or the hub.

        A checkpoint with custom code registered for ``AutoModel`` (the real
        Qwen2.5-Math-PRM: ``Qwen2ForProcessRewardModel``) loads with
        ``AutoModel``; any other with ``AutoModelForTokenClassification`` (with
        a standard architecture, ``AutoModel`` would give the bare model without
        the classification head). ``kwargs`` go to the constructor,
        ``model_kwargs`` to the model's ``from_pretrained``.

        Custom code runs only if you ask for it (``trust_remote_code=True``, as
        in transformers and vLLM): loading it executes whatever Python the
        checkpoint ships. A checkpoint that needs it and is not trusted raises
        ``ConfigError`` saying so. The one exception is a local checkpoint whose
        only code is sart's own testbed PRM class, byte for byte (the shipped
        testbed PRM, or one ``sart testbed train`` wrote): that is not remote
        code.
        """
        from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification

        trust_remote_code = trust_remote_code or _ships_only_sart_code(path)
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
        loader = AutoModel if custom else AutoModelForTokenClassification
        model = loader.from_pretrained(path, **_load_kwargs(dtype, trust_remote_code, model_kwargs))
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code
        )
        return cls(model, tokenizer, device=device, **kwargs)

    _PLACEHOLDER = "SARTSTEPSPLACEHOLDER"

    def messages(self, question: str, response: str) -> list[dict[str, str]]:
        """The chat of the documented usage, with ``response`` as the assistant turn."""
        system = (
            []
            if self.system_prompt is None
            else [{"role": "system", "content": self.system_prompt}]
        )
        return [
            *system,
            {"role": "user", "content": question},
            {"role": "assistant", "content": response},
        ]

    def reference_ids(self, question: str, steps: Sequence[str]) -> list[int]:
        """The documented full-text encoding: steps joined by the separator, with
        a trailing one, as the assistant turn of the rendered chat."""
        sep = self.step_separator
        text = self.tokenizer.apply_chat_template(
            self.messages(question, sep.join(steps) + sep), tokenize=False
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _prefix_ids(self, question: str) -> tuple[int, ...]:
        ids = self._prefixes.get(question)
        if ids is None:
            text = self.tokenizer.apply_chat_template(
                self.messages(question, self._PLACEHOLDER), tokenize=False
            )
            # The assistant turn comes last: its placeholder is the last occurrence.
            where = text.rfind(self._PLACEHOLDER)
            if where < 0:
                raise ConfigError("the chat template drops the assistant turn's content")
            ids = tuple(self.tokenizer(text[:where], add_special_tokens=False)["input_ids"])
            self._prefixes[question] = ids
            if len(self._prefixes) > 1024:
                self._prefixes.popitem(last=False)
        return ids

    def _encode_steps(self, question: str, steps: list[str]) -> Encoded:
        segments = tuple((*ids, self.separator_id) for ids in self._step_ids(steps))
        return Encoded(self._prefix_ids(question), segments, tuple(len(s) - 1 for s in segments))

    def _step_ids(self, steps: list[str]) -> list[tuple[int, ...]]:
        """Each step tokenised on its own, memoised: from one check of a branch to
        the next only its last step changes, and tokenising all of them again
        cost a fifth of a batched check of the testbed PRM
        (``benchmarks/prm_batching.py``)."""
        memo = self._steps
        missing = list(dict.fromkeys(step for step in steps if step not in memo))
        if missing:
            encoded = self.tokenizer(missing, add_special_tokens=False)["input_ids"]
            memo.update(zip(missing, map(tuple, encoded)))
        out = []
        for step in steps:
            out.append(memo[step])
            memo.move_to_end(step)
        while len(memo) > _STEP_MEMO:
            memo.popitem(last=False)
        return out

    def _two_way(self, logits: Any) -> Any:
        if logits.shape[-1] != 2:
            raise ConfigError(
                f"QwenMathPRM needs a model with 2 labels per token, not {logits.shape[-1]}"
            )
        return logits

    def _check_encoding(self) -> None:
        question, steps = "What is 12 + 30?", ["Step 1: 12 + 30 = 42.", "So the answer is 42."]
        ours = self._encode_steps(question, steps).ids()
        if self.reference_ids(question, steps)[: len(ours)] != ours:
            warnings.warn(
                "QwenMathPRM: this tokenizer encodes steps differently on their own than in "
                "the full chat text; rewards may differ slightly from the documented usage",
                stacklevel=3,
            )


# --------------------------------------------------------------------------- Math-Shepherd


class StepTagPRM(TransformersPRM):
    """A Math-Shepherd-style PRM: a causal LM rating each step at a tag token.

    Input: ``"{question} {step1} {tag}\\n{step2} {tag}"`` tokenised as one text
    (as in the model card; special tokens such as BOS added). The reward of a
    step is the softmax over the ``good_token`` and ``bad_token`` logits at
    its tag, the good part. Tokens may be given as strings, which must encode
    (``tokenizer.encode(s, add_special_tokens=False)``) to exactly one id, or
    as ids. Defaults fit byte-level tokenizers (the demo model: ``"Ġ+"``,
    ``"Ġ-"``); for peiyi9979/math-shepherd-mistral-7b-prm, whose model card
    reads the ids from ``tokenizer.encode("+ -")[1:]``, pass those ids
    (648 and 387 there). Tags are located with the tokenizer's offsets, so a
    ``"ки"`` inside a step's own text is not mistaken for one; a tokenizer
    that merges the tag with its neighbours is refused at construction.
    Incremental scoring and windowing work as for ``QwenMathPRM``.
    """

    _subset_logits = True  # the vocabulary logits of every position would be large

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        step_tag: str | int = "ки",
        good_token: str | int = " +",
        bad_token: str | int = " -",
        device: str | torch.device | None = None,
        max_length: int = 4096,
        aggregate: str = DEFAULT_AGGREGATION,
        batch_size: int = 8,
        incremental: bool = True,
        overflow: str = "window",
        window_stride: int = 1,
        window: int | None = None,
        max_cached_branches: int | None = None,
    ) -> None:
        super().__init__(
            model,
            tokenizer,
            device=device,
            max_length=max_length,
            aggregate=aggregate,
            batch_size=batch_size,
            incremental=incremental,
            overflow=overflow,
            window_stride=window_stride,
            window=window,
            max_cached_branches=max_cached_branches,
        )
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("StepTagPRM needs a fast tokenizer (it locates tags by offsets)")
        self.tag_id = _single_token(tokenizer, step_tag, "step_tag")
        self.step_tag = (
            step_tag if isinstance(step_tag, str) else tokenizer.decode([step_tag]).strip()
        )
        self.good_id = _single_token(tokenizer, good_token, "good_token")
        self.bad_id = _single_token(tokenizer, bad_token, "bad_token")
        if self.good_id == self.bad_id:
            raise ConfigError(
                f"good_token={good_token!r} and bad_token={bad_token!r} are the same token"
            )
        try:
            self._encode_steps("What is 1 + 1?", ["1 + 1 = 2.", "The answer is 2."])
        except _TagNotFound as exc:
            raise ConfigError(f"step_tag={step_tag!r}: {exc}") from None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: Any = None,
        trust_remote_code: bool = False,
        model_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> StepTagPRM:
        """Load a causal LM and its tokenizer; ``kwargs`` go to the constructor."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(
            path, **_load_kwargs(dtype, trust_remote_code, model_kwargs)
        )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        return cls(model, tokenizer, device=device, **kwargs)

    def render(self, question: str, steps: Sequence[str]) -> tuple[str, list[int], list[int]]:
        """The input text, where each step's segment starts, and where each tag is (in chars)."""
        text, starts, tags = question, [], []
        for i, step in enumerate(steps):
            starts.append(len(text))
            text += f"{'' if i else ' '}{step} "
            tags.append(len(text))
            text += self.step_tag + ("\n" if i < len(steps) - 1 else "")
        return text, starts, tags

    def _encode_steps(self, question: str, steps: list[str]) -> Encoded:
        text, starts, tags = self.render(question, steps)
        enc = self.tokenizer(text, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        # A segment starts at the first token that starts at or after its first
        # character. Special tokens (empty spans) are skipped in the search.
        spans = [(s, e, k) for k, (s, e) in enumerate(offsets) if e > s]
        span_starts = [s for s, _, _ in spans]
        bounds = [_first_at_or_after(spans, span_starts, c, len(ids)) for c in starts]
        bounds.append(len(ids))
        tag_tokens = [_token_at(spans, span_starts, c) for c in tags]
        for i, k in enumerate(tag_tokens):
            if k is None or ids[k] != self.tag_id or not bounds[i] <= k < bounds[i + 1]:
                raise _TagNotFound(
                    f"the tag after step {i} is not tokenised as the single token "
                    f"{self.tag_id} (it merges with the text around it)"
                )
        segments = tuple(tuple(ids[a:b]) for a, b in itertools.pairwise(bounds))
        rating = tuple(k - a for k, a in zip(tag_tokens, bounds))
        return Encoded(tuple(ids[: bounds[0]]), segments, rating)

    def _encode_item(self, item: ScoreItem) -> Encoded:
        try:
            return super()._encode_item(item)
        except _TagNotFound as exc:
            raise PRMError(f"branch {item.branch}: {exc}", [item.branch.request_id]) from None

    def _two_way(self, logits: Any) -> Any:
        return logits[:, [self.bad_id, self.good_id]]


class _TagNotFound(Exception):
    pass


Span = tuple[int, int, int]  # (first char, end char, token index), by first char


def _first_at_or_after(spans: Sequence[Span], starts: Sequence[int], char: int, end: int) -> int:
    """Index of the first token starting at or after ``char`` (``end`` if none)."""
    i = bisect.bisect_left(starts, char)
    return spans[i][2] if i < len(spans) else end


def _token_at(spans: Sequence[Span], starts: Sequence[int], char: int) -> int | None:
    """Index of the token covering ``char``, if one does."""
    i = bisect.bisect_right(starts, char) - 1
    return spans[i][2] if i >= 0 and char < spans[i][1] else None


def _single_token(tokenizer: Any, token: str | int, field: str) -> int:
    """The id of ``token``: an id as is (checked), a string if it encodes to one id."""
    if isinstance(token, int):
        config_check(0 <= token < len(tokenizer), field, token, f"a token id < {len(tokenizer)}")
        return token
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise ConfigError(
            f"{field}={token!r} must be a single token of this tokenizer, but it encodes to "
            f"{len(ids)} tokens {pieces} (ids {ids}); give another spelling (with or without "
            "a leading space) or the token id itself"
        )
    return ids[0]
