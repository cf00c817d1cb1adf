"""``TransformersPRM``: what the transformers PRMs share (``sart.prm.hf`` says how they
score: a forward per check over each branch's kept KV, batched, windowed past the
context). ``QwenMathPRM`` and ``StepTagPRM`` (``sart.prm.hf``) differ only in their
input format, how they load and how they read the two-way logits.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from sart.errors import PRMError, needs_extra
from sart.prm.aggregate import aggregate as aggregate_rewards
from sart.prm.aggregate import check_finite
from sart.prm.base import ScoreItem
from sart.prm.formats import (
    InputFormat,
    good_probability,
)
from sart.prm.options import TransformersOptions, build_options
from sart.prm.window import ContextLimit, Encoded
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
    )
    from sart.prm.hf_pool import KVPool
    from sart.prm.hf_rows import BranchCache, IncrementalRows, chunks, split_runs

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
        self._pool = KVPool()  # the cached branches' keys and values (batch_size > 1)
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
                self._forget(item.branch)
        return results

    def release(self, request_id: str) -> None:
        """Drop the caches of the request's branches."""
        for branch in [b for b in self._caches if b.request_id == request_id]:
            self._forget(branch)

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
            _, two_way, counts = self._forward(
                [encoded[i].ids() for i in chunk], [encoded[i].positions() for i in chunk]
            )
            for i, rewards in zip(chunk, split_runs(good_probability(two_way), counts)):
                results[i] = rewards
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
                else:
                    self._drop(row)
        return [[] if row is None else [row.rewards[p] for p in row.positions] for row in rows]

    def _forward(
        self,
        rows: list[list[int]],
        positions: list[list[int]],
        cache: Any = None,
        past: Sequence[int] | None = None,
    ) -> tuple[Any, Any, list[int]]:
        """Run the model on right-padded ``rows``; its output, the ``[n, 2]`` (bad,
        good) logits at every row's ``positions`` (indices into the row), row after
        row, and how many each row has. Inputs are built in Python and uploaded once
        each, the logits taken in one read: the work does not grow with the rows.

        With ``cache``, row ``r`` continues from ``past[r]`` cached tokens
        (default: all the cache holds). The cache then holds ``max(past)``
        positions per row, a row's own ones last after masked left pads, and the
        row's tokens are given their real positions ``past[r], past[r] + 1, ...``
        (rotary embeddings must not count the pads).
        """
        width = max(map(len, rows))
        held = cache.get_seq_length() if cache is not None else 0
        past = list(past) if past is not None else [held] * len(rows)
        device = self.device
        ids = [row + [self._pad_id] * (width - len(row)) for row in rows]
        kwargs: dict[str, Any] = {
            "input_ids": torch.tensor(ids, dtype=torch.long, device=device),
            "use_cache": cache is not None,
        }
        if any(p < held for p in past) or any(len(row) < width for row in rows):
            mask = [
                [0] * (held - p) + [1] * (p + len(row)) + [0] * (width - len(row))
                for row, p in zip(rows, past)
            ]
            kwargs["attention_mask"] = torch.tensor(mask, dtype=torch.long, device=device)
        if any(p < held for p in past):
            real = [list(range(p, p + width)) for p in past]
            kwargs["position_ids"] = torch.tensor(real, dtype=torch.long, device=device)
        if cache is not None:
            kwargs[self._cache_api.argument] = cache
        index = [list(p) for p in positions]
        if self._keep_logits:
            keep = sorted(set(itertools.chain(*positions)))
            where = {p: k for k, p in enumerate(keep)}
            index = [[where[p] for p in row] for row in positions]
            kwargs["logits_to_keep"] = torch.tensor(keep, dtype=torch.long, device=device)
        with torch.inference_mode():
            output = self.model(**kwargs)
            logits = output_logits(output)
            which = (
                torch.tensor([r for r, row in enumerate(index) for _ in row], device=logits.device),
                torch.tensor(list(itertools.chain(*index)), dtype=torch.long, device=logits.device),
            )
            two_way = self._two_way(logits[which])
        self.tokens_processed += sum(map(len, rows))
        self.forward_calls += 1
        return output, two_way, [len(row) for row in index]

    def _check_finite(self, items: Sequence[ScoreItem], results: Sequence[Sequence[float]]) -> None:
        try:
            check_finite(items, results)
        except PRMError:
            for item, r in zip(items, results):  # a cache that produced NaN is not worth keeping
                if not all(map(math.isfinite, r)):
                    self._forget(item.branch)
            raise


__all__ = ["PRMT", "TransformersPRM"]
