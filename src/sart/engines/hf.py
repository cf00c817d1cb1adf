"""``HFEngine``: the transformers reference engine (CPU or CUDA), with real prefix-KV sharing.

What is shared and what is copied: a request's prompt is prefilled once and
its KV cache (one tensor pair per layer) is held by the request, never written.
Decoding is batched across the live branches of *all* requests, whatever
their prompt and generated lengths: each step the branches' KV is left-padded
into one batch with an attention mask, and explicit position ids keep RoPE
positions right. The batch is kept between steps while the same branches go
on, and each step's new keys and values are written into it in place; it is
also where each branch's KV stays (a ``Span`` of it, ``sart.engines.hf_kv``), so
no branch keeps a copy of its own. When the live branches change, the next
batch is read from the last one (and from a new request's prompt, a fork's
parent's row, a resumed branch's recomputed cache) in one indexed read and
write per layer: neither a steady step nor a rebuild does tensor work per
branch (the next step's logits are the last step's rows as they are). A fork
(``BranchSpec(parent=j)``) starts from its parent's positions and gets a row of
its own at the next step. Padding costs attention over the
longest branch, so on a CPU branches of very different lengths are split into
batches by length when that saves more than a forward costs (``split_cost``).
This engine is the readable reference that CI runs on tiny models, not a fast
server (use vLLM or SGLang for that). Text is decoded
incrementally (``sart.engines.detok``), as vLLM's detokenizer does.

Sampling is one pass over the step's logits for every branch
(``sart.engines.hf_sampling``), each branch drawing from a counter-based stream of
its seed, so its tokens depend on its seed and history only (not on the batch it
shares) and results are reproducible; ``temperature == 0`` is greedy and gives
exactly ``model.generate(do_sample=False)``'s tokens. The EOS token (or a stop
string) ends a branch as ``FINISHED`` and counts as a generated token, as in
vLLM; reaching ``max_tokens`` ends it as ``TRUNCATED``. Stop strings are cut
from the text. Aborting a branch drops its tensors at once. vLLM's extra
sampling fields (``EXTRA_SAMPLING``) are honoured as vLLM applies them:
penalties and ``min_tokens`` on the logits, then temperature, ``min_p``,
``top_k``, ``top_p``. Streamed text holds back, as vLLM's detokenizer does, a
tail that may begin a stop string and a character cut between tokens.

Log-probabilities (``SamplingSettings.logprobs``, for confidence signals): as
vLLM's default, they are raw, the ``log_softmax`` of the model's next-token
logits before temperature and top-p, for the sampled token and the ``k`` most
likely ones (``k`` clamped to the vocabulary). Each step they are computed in
one batch on the device over the branches of the requests that asked, and
read back with the tokens in one transfer. A fork reports them only for the
tokens it generates itself.

Prompts (``sart.engines.prompts``): token ids are used as they are; text is
tokenized with special tokens added, or, with ``chat=True``, wrapped as one user
message with the tokenizer's chat template and a generation prompt (what
reasoning models expect).

Needs the ``[hf]`` extra: torch and transformers (4.46+ and 5.x).

Pausing (``pause``, for more urgent requests) drops a branch's KV and keeps
its tokens, text and sampler state; its resume (``BranchSpec(resume=True)``)
recomputes that KV in one forward from the prompt's, and the branch goes on
exactly as it would have.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import attrs

from sart.errors import needs_extra

with needs_extra("the transformers engine", "hf"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

from sart import hf_compat
from sart.engines import hf_graphs, hf_kv, hf_sampling
from sart.engines.base import (
    BranchSpec,
    EngineStats,
    StepDeltas,
    StepInterrupt,
    StepOutput,
    Watcher,
)
from sart.engines.hf_branch import Branch, PromptKV
from sart.engines.hf_kv import InPlaceCache, Span, StepBatch, StepBatches
from sart.engines.ledger import PrefixLedger, cap_max_tokens
from sart.engines.prompts import check_vocabulary, prompt_ids
from sart.types import EXTRA_SAMPLING, BranchId, FinishReason, Prompt, SamplingSettings

Going = list[tuple[BranchId, Branch, int]]
"""The branches a step forwards: each one's id, itself and the token it sampled."""


class HFEngine:
    """A step-based engine over a transformers causal LM (see the module docstring)."""

    supports_fork = True
    supports_pause = True
    sampling_fields = frozenset(EXTRA_SAMPLING)
    sampler = hf_sampling.SAMPLER
    """How it draws tokens (a benchmark records it: runs of two samplers differ)."""

    def __init__(
        self, model: Any, tokenizer: Any, *, chat: bool = False, cuda_graphs: bool = False
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.chat = chat
        weight = next(model.parameters())
        self.device = weight.device
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos_ids: frozenset[int] = frozenset(eos if isinstance(eos, list) else [eos])
        self._cache_arg = hf_compat.cache_argument(model)
        self._ledger: PrefixLedger[PromptKV, Branch] = PrefixLedger()
        limit = getattr(model.config, "max_position_embeddings", None)
        self.context_len: int | None = limit if isinstance(limit, int) else None
        """Prompt + output tokens the model takes (its ``max_position_embeddings``): a
        longer prompt is refused before any forward, ``max_tokens`` capped to fit."""
        embeddings = model.get_input_embeddings()
        rows = getattr(embeddings, "num_embeddings", None)
        self.vocab_size: int | None = rows if isinstance(rows, int) else None
        """Token ids the model embeds: a prompt id at or past it is refused at prefill."""
        self._batches = StepBatches()  # cleared whenever the live branches change
        self._next: tuple[tuple[BranchId, ...], torch.Tensor] | None = None
        """The last step's branches and their next-token logits, when one batch."""
        self.in_place = True
        """Decode into a kept batch with room for the new token (``sart.engines.hf_kv``);
        False takes transformers' own ``DynamicCache`` each step, as a model whose cache
        layers are not plain dynamic ones does (same tokens, a few times slower on long
        branches: ``benchmarks/hf_decode.py`` compares the two)."""
        self.split_cost = hf_kv.split_cost(model.config, weight.device, weight.dtype)
        """Padded positions a batch split by length must save per extra forward (None:
        one batch; the default is estimated from the model, None on accelerators)."""
        self.forward_seconds = 0.0
        """Time spent inside the model's forward (for overhead measurements)."""
        self.static = hf_graphs.graphed(model) if cuda_graphs else None
        """Decode steps over buffers the engine owns (``sart.engines.hf_graphs``), as
        ``cuda_graphs=True`` sets up: each bucket's forward captured as a CUDA graph.
        Off by default until measured faster on a GPU (``scripts/gpu_check.py``)."""
        self.graphs_failed: str | None = None
        """Why ``static`` was turned off mid-run (a capture failed), if it was."""
        self.interrupt = StepInterrupt()
        """Ends the ``step`` in flight within the decode steps asked, from any thread
        (``StepInterrupt``; a server's arrivals and streams' ends)."""
        self.watchers: dict[str, Watcher] = {}
        """Requests whose tokens go to a callback as each decode step makes them
        (``sart.engines.base.watches_steps``; a server streaming them)."""

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device: str = "cpu",
        dtype: Any = "auto",
        chat: bool = False,
        trust_remote_code: bool = False,
        cuda_graphs: bool = False,
        **model_kwargs: Any,
    ) -> HFEngine:
        """Load a causal LM and its tokenizer from a local path or the hub
        (``trust_remote_code=True`` runs modelling code the checkpoint ships)."""
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, **model_kwargs
        )
        return cls(model.to(device), tokenizer, chat=chat, cuda_graphs=cuda_graphs)

    # ------------------------------------------------------------- contract

    def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        self._ledger.check_prefill(request_id)
        ids = prompt_ids(self.tokenizer, prompt, self.chat)
        if not isinstance(prompt, str):  # the embedding lookup would raise on one outside
            check_vocabulary(request_id, ids, self.vocab_size, "the model's vocabulary")
        limit = self.context_len
        context = f"the model's context of {limit} tokens (max_position_embeddings)"
        max_tokens = cap_max_tokens(request_id, len(ids), sampling.max_tokens, limit, context)
        if max_tokens < sampling.max_tokens:
            sampling = attrs.evolve(
                sampling, max_tokens=max_tokens, min_tokens=min(sampling.min_tokens, max_tokens)
            )
        with torch.inference_mode():
            out = self._forward(torch.tensor([ids], device=self.device))
        kv = PromptKV(
            hf_compat.pairs_of(hf_compat.out_cache(out)), out.logits[0, -1].float(), tuple(ids)
        )
        self._ledger.prefill(request_id, len(ids), sampling, kv)
        return len(ids)

    def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        prefix = self._ledger.check_start(request_id, branches)
        new: list[tuple[BranchSpec, Branch]] = []
        for spec in branches:
            if spec.resume:  # its tokens, text and sampler state; its KV recomputed below
                new.append((spec, self._ledger.paused[BranchId(request_id, spec.index)]))
                continue
            if spec.parent is None:  # its KV: the prompt's
                span = Span(prefix.data.kv, 0, 0, prefix.tokens)
                branch = Branch(prefix, span, prefix.data.logits, [], "", spec.seed)
            else:  # its KV: the parent's positions, copied into its own row at next step
                parent = self._ledger.branches[BranchId(request_id, spec.parent)]
                assert parent.span is not None  # a live branch's KV is somewhere
                span = parent.span.copy()
                branch = Branch(
                    prefix, span, parent.logits, list(parent.tokens), parent.text, spec.seed,
                    parent.detok,
                )  # fmt: skip
            new.append((spec, branch))
        resumed = [branch for spec, branch in new if spec.resume]
        self._ledger.start(request_id, new)
        self._changed()
        for branch in resumed:
            self._recompute(branch)

    def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        deltas = StepDeltas(self.watchers)
        steps = 0
        while steps < max_steps and self._ledger.branches:
            steps += 1
            ended = self._decode_one(steps, deltas)
            if (ended and until_first_end) or self.interrupt.taken():
                break
        return deltas.output(steps)

    def abort(self, branch_ids: Sequence[BranchId]) -> None:
        self._ledger.abort(branch_ids)  # dropping the branches drops their tensors
        self._changed()  # and the step batch's copy of them

    def pause(self, branch_ids: Sequence[BranchId]) -> None:
        """Drop these branches' KV, keeping their tokens, text and sampler state: resumed,
        a branch goes on exactly as it would have (its KV is recomputed in one forward)."""
        self._changed()
        self._ledger.pause(
            list(branch_ids),
            keep=lambda b: Branch(b.prefix, None, b.logits, b.tokens, b.text, b.seed, b.detok),
        )

    def release_prefix(self, request_id: str) -> None:
        self._ledger.release(request_id)  # with any branch of it still live
        self._changed()

    def stats(self) -> EngineStats:
        return EngineStats(
            live_branches=len(self._ledger.branches), kv_tokens=self._ledger.kv_tokens(_own)
        )

    @property
    def prefixes(self) -> frozenset[str]:
        """Requests whose prefix is held."""
        return frozenset(self._ledger.prefixes)

    def usage(self, request_id: str) -> tuple[int, int]:
        """``(live branches, KV tokens)`` held by one request (0, 0 if it holds nothing)."""
        return self._ledger.usage(request_id, _own)

    def _changed(self) -> None:
        """The live branches changed: the step batch and last step's logits are stale
        (a branch can change under the same id: a request id reused, a resume)."""
        self._stale()
        self._next = None

    # ------------------------------------------------------------ decoding

    def _decode_one(self, step: int, deltas: StepDeltas) -> bool:
        """Sample one token for every live branch, then forward the ones still live."""
        live = list(self._ledger.branches.items())
        rows = [
            hf_sampling.Row(b.prefix.sampling, b.seed, b.tokens, b.prefix.data.ids) for _, b in live
        ]
        # One pass over the step's logits, and one read back (hf_sampling). While the
        # same branches go on in one batch, last step's logits are this step's rows.
        ids = tuple(bid for bid, _ in live)
        if self._next is not None and self._next[0] == ids:
            logits = self._next[1]
        else:
            logits = torch.stack([b.logits for _, b in live])
        self._next = None
        chosen = hf_sampling.sample(logits, rows, self.eos_ids)
        asking, values = hf_sampling.logprobs(logits, rows, chosen)
        tokens, logprobs = hf_sampling.read_back(chosen, asking, values, rows)
        going: Going = []
        ended = False
        for (bid, branch), token, lp in zip(live, tokens, logprobs):
            branch.tokens.append(token)
            finish, delta, stop_reason = self._advance_text(branch, token)
            deltas.add(bid, (token,), delta, () if lp is None else (lp,))
            if finish is None and len(branch.tokens) >= branch.prefix.sampling.max_tokens:
                finish = FinishReason.LENGTH
            if finish is not None:
                deltas.end(bid, finish, step, stop_reason)
                self._ledger.end(bid)
                self._stale()
                ended = True
            else:
                going.append((bid, branch, token))
        if going:
            self._forward_batch(going)
        return ended

    def _advance_text(
        self, branch: Branch, token: int
    ) -> tuple[FinishReason | None, str, str | int | None]:
        """Whether ``token`` ends the branch, the text it adds, and what stopped it (the
        stop string or stop token id, as vLLM's ``stop_reason``; ``None`` for EOS).
        ``branch.text`` is the text reported so far: while the branch runs, as vLLM's
        detokenizer does, the tail that may be the start of a stop string, and a partial
        character (``\ufffd``, a multi-byte character cut between tokens), are held back
        until they resolve."""
        sampling = branch.prefix.sampling
        early = len(branch.tokens) < sampling.min_tokens  # nothing ends a branch before
        eos = token in self.eos_ids and not sampling.ignore_eos and not early
        skip = sampling.skip_special_tokens
        # The EOS token is not text: what was held back goes out now.
        count = len(branch.tokens) - 1 if eos else len(branch.tokens)
        text, branch.detok = branch.detok.text(
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip), branch.tokens, count
        )
        if not text.startswith(branch.text):
            # Decoding more tokens changed text already reported (rare once partial
            # characters are held back): what was reported stays; the rest follows it.
            branch.text = text[: len(branch.text)]
        stops = sampling.stop if not early else ()
        if stops:
            # Search only where a new stop string could start: reported text has none.
            start = max(0, len(branch.text) - max(len(s) for s in stops))
            hits = [(i, s) for s in stops if (i := text.find(s, start)) != -1]
            if hits:
                cut, hit = min(hits)
                if sampling.include_stop_str_in_output:
                    cut += len(hit)
                reported = self._report(branch, text[: max(cut, len(branch.text))])
                return FinishReason.STOP, reported, hit
        stop_token = not eos and token in sampling.stop_token_ids and not early
        ends = eos or stop_token
        if ends or len(branch.tokens) >= sampling.max_tokens:
            finish = FinishReason.STOP if ends else None
            return finish, self._report(branch, text), token if stop_token else None
        held = max((len(s) for s in sampling.stop), default=1) - 1
        if sampling.include_stop_str_in_output:
            held = 0
        upto = len(text) - held
        while upto > len(branch.text) and text[upto - 1] == "\ufffd":
            upto -= 1
        return None, self._report(branch, text[: max(upto, len(branch.text))]), None

    @staticmethod
    def _report(branch: Branch, text: str) -> str:
        """Report ``text`` (which extends what was reported): the new part."""
        delta = text[len(branch.text) :]
        branch.text = text
        return delta

    def _stale(self) -> None:
        """The kept batches no longer hold the live branches' rows."""
        self._batches.clear()
        if self.static is not None:
            self.static.clear()

    def _forward_batch(self, going: Going) -> None:
        keys = tuple(bid for bid, _, _ in going)
        if self.static is not None:  # one batch over the engine's own buffers
            try:
                self._next = (keys, self._forward_static(keys, going))
                self._batches.clear()  # the spans left any step batch: its memory back
                return
            except hf_graphs.OverBudget:  # this step by the default path, from the spans
                self.static.clear()  # as they are; the next one over the buffers rebuilds
            except hf_graphs.CaptureFailed as exc:
                warnings.warn(f"{exc}; decoding without CUDA graphs", RuntimeWarning, stacklevel=2)
                static, self.static, self.graphs_failed = self.static, None, str(exc)
                # The rows were laid out in the buffers before the capture (maybe over
                # where the spans pointed): the default path reads them from there.
                _hold(going, static.kv, max(b.length for _, b, _ in going), None)
        lengths = [b.length for _, b, _ in going]
        groups = self._batches.split(keys, lengths, self.split_cost)
        for kept, rows in groups:
            last = self._forward_rows(kept, [going[row] for row in rows])
        if len(groups) == 1:  # the rows in ``going``'s order: next step's logits as they are
            self._next = (keys, last)

    def _forward_rows(self, kept: StepBatch, going: Going) -> torch.Tensor:
        """Forward one batch of rows; the next-token logits, a row per branch."""
        lengths = [b.length for _, b, _ in going]
        width = max(lengths)
        spans = [b.span for _, b, _ in going]
        assert all(span is not None for span in spans)  # live branches have their KV
        full = kept.get(tuple(bid for bid, _, _ in going), spans, width)  # type: ignore[arg-type]
        config = self.model.config
        cache = InPlaceCache.build(full, config) if self.in_place else None
        if cache is None:  # the forward will not write the free column: no reuse
            kept.clear()
        # Mask and positions from one upload: row r attends to its last lengths[r] + 1.
        sizes = torch.tensor(lengths, device=self.device)
        columns = torch.arange(width + 1, device=self.device)
        mask = (columns[None, :] >= (width - sizes)[:, None]).long()
        ids = torch.tensor([[t] for _, _, t in going], device=self.device)
        positions = sizes[:, None]
        with torch.inference_mode():
            out = self._forward(
                ids,
                cache=cache
                or hf_compat.dynamic_cache([(k[:, :, :-1], v[:, :, :-1]) for k, v in full], config),
                attention_mask=mask,
                position_ids=positions,
            )
        # The step's keys and values: written into the batch's free position, or (with
        # transformers' own cache) the last of the cache the forward returns. Either
        # tensor now holds every row's KV: a branch's span is its row there.
        held = kept.pairs if cache is not None else hf_compat.pairs_of(hf_compat.out_cache(out))
        last = out.logits[:, -1].float()  # one op; each branch reads its row from it
        _hold(going, held, width, last)
        return last

    def _forward_static(self, keys: tuple[BranchId, ...], going: Going) -> torch.Tensor:
        """``_forward_rows`` over ``static``'s buffers (one batch, padded to its bucket)."""
        assert self.static is not None
        lengths = [b.length for _, b, _ in going]
        started = time.perf_counter()
        spans = [b.span for _, b, _ in going]
        last = self.static.step(keys, spans, lengths, [t for _, _, t in going])  # type: ignore[arg-type]
        self.forward_seconds += time.perf_counter() - started
        _hold(going, self.static.kv, max(lengths), last)
        return last

    def _recompute(self, branch: Branch) -> None:
        """A resumed branch's KV over its tokens, in one forward from the prompt's KV
        (copied: the prefix's tensors are never written)."""
        if not branch.tokens:  # paused before its first token: the prompt's KV is its own
            branch.span = Span(branch.prefix.data.kv, 0, 0, branch.prefix.tokens)
            branch.logits = branch.prefix.data.logits
            return
        prompt = branch.prefix.tokens
        count = len(branch.tokens)
        pairs = [(k.clone(), v.clone()) for k, v in branch.prefix.data.kv]
        ids = torch.tensor([branch.tokens], device=self.device)
        mask = torch.ones((1, prompt + count), dtype=torch.long, device=self.device)
        positions = torch.arange(prompt, prompt + count, device=self.device)[None]
        cache = hf_compat.dynamic_cache(pairs, self.model.config)
        with torch.inference_mode():
            out = self._forward(ids, cache=cache, attention_mask=mask, position_ids=positions)
        branch.span = Span(hf_compat.pairs_of(hf_compat.out_cache(out)), 0, 0, prompt + count)
        branch.logits = out.logits[0, -1].float()

    # ------------------------------------------------------------- helpers

    def _forward(self, ids: torch.Tensor, cache: Any = None, **kwargs: Any) -> Any:
        started = time.perf_counter()
        if cache is not None:
            kwargs[self._cache_arg] = cache
        out = self.model(input_ids=ids, use_cache=True, **kwargs)
        self.forward_seconds += time.perf_counter() - started
        return out


def _hold(going: Going, pairs: hf_kv.KV, width: int, last: torch.Tensor | None) -> None:
    """Each branch of ``going`` is now row ``r`` of ``pairs``, right-aligned before column
    ``width`` (the longest row's length); with ``last`` (the step's forward wrote its
    token at ``width``), one position longer, its next-token logits ``last``'s row ``r``."""
    for row, (_, branch, _) in enumerate(going):
        start = width - branch.length  # read before its span moves
        branch.span = Span(pairs, row, start, width + (last is not None))
        if last is not None:
            branch.logits_in(last, row)


def _own(branch: Branch) -> int:
    return branch.own
