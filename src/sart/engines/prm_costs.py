"""Cost model of a PRM scoring call: the prefill of the tokens the PRM reads, on an accelerator.

The simulator's PRM (``ScriptedPRM``) answers at once; wrapped in a
``CostedPRM`` with a ``PRMPricer`` as its cost function, each call takes the
time this model gives (``sart.PricedPRM``). A call is priced as one batched
prefill of the tokens the PRM actually processes:

- **Call time** = ``call_overhead`` + max(compute time, weight-read time), where
  compute time = (linear + attention FLOPs) / (peak FLOP/s x ``flops_efficiency``),
  linear FLOPs = 2 x params x tokens, attention FLOPs = 4 x layers x heads x
  head_dim per (token, token it attends to): ``n`` tokens fed after ``c``
  cached ones attend to ``n c + n (n + 1) / 2`` (causal), and weight-read time =
  weight bytes / (bandwidth x ``bandwidth_efficiency``): a small call cannot be
  faster than one read of the weights.
- **Tokens fed per item** (``P`` = prompt tokens, ``n`` = the branch's tokens so
  far, ``C`` = the PRM's context; an input is ``min(P + n, C)`` tokens, windowed
  as ``sart.prm.hf`` windows it: the prompt and the latest steps):

  - ``reencode`` (vLLM's pooling PRM, which cannot reuse a cache): the whole
    windowed input at every check, attending from scratch. Over a branch of
    ``L`` tokens checked every ``T`` that is about ``L / (2T)`` PRM tokens per
    generated token (plus the prompt at every check).
  - ``incremental`` (``sart.prm.hf``'s cached PRM): a branch's first check feeds
    its prompt and response; later ones feed the tokens not yet scored plus
    ``tail_tokens`` re-encoded ones (the separator after the unfinished last
    step, and tokens whose tokenisation changed), attending to the cached
    rest. Once the input is past the context, the window's start moves at
    every check, so the window is re-encoded (``sart.prm.hf`` with its default
    ``window_stride=1``). A branch's state is dropped after its final item and
    when its request is released.
  - ``cached`` (a ``LAST``-pooled PRM served from vLLM's prefix cache, asked for
    the prefix ending at the branch's latest step: ``sart.prm.vllm``): each check
    feeds what the cache does not hold. The cache holds the previous input's
    full ``block``-token blocks (16, vLLM's default block size), so a check
    feeds the new tokens plus the previous input's last partial block,
    attending to the cached blocks. Past the context, the window's start moves
    in strides of ``stride`` tokens (1,024): between moves the window's prefix
    is the same and stays cached; each move re-encodes the new window once.

The PRM is Qwen2.5-Math-PRM-7B, with the shape of its ``config.json``: the
Qwen2.5-Math-7B body (hidden size 3584, 28 layers, 28 attention heads of dim
128, 4 KV heads (GQA), intermediate size 18944, vocabulary 152064) with
``max_position_embeddings`` 4096, in bfloat16, and a two-layer reward head
(3584 x 3584, 3584 x 2) instead of the LM head. Parameters, from that shape:
embeddings 152064 x 3584 = 0.545 B; per layer 29.4 M of attention (q and o
3584 x 3584, k and v 3584 x 512, with biases) and 203.7 M of MLP (3 x 3584 x
18944), 233.1 M, 6.526 B for 28; the head 12.9 M: 7.08 B in all (the model
card's "7.1B"). The linear FLOPs count the embeddings too, as the policy's
prefill does (``sart.engines.costs``): 8% more than the matmuls, on the
costly side.

Assumptions (not measured here): 50% of peak FLOP/s (the policy's prefill
efficiency) and 75% of peak bandwidth, as in ``sart.engines.costs``; 10 ms of
fixed overhead per call (scheduling the batch, moving inputs and rewards;
tokenisation is not priced); ``tail_tokens`` = 8. On an H100 that makes a
token of linear work cost 28.6 us (35k tokens/s), and a full 4096-token
input 117 ms of linear and 7 ms of attention work.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import attrs

from sart.engines.costs import H100, Accelerator, ModelSpec, non_negative
from sart.errors import config_check, enum_converter
from sart.messages import ScoreItem

QWEN_MATH_PRM_7B = ModelSpec(
    "Qwen2.5-Math-PRM-7B",
    params=7.08e9,
    layers=28,
    kv_heads=4,
    head_dim=128,
    heads=28,
    context=4096,
)


class PRMInput(enum.Enum):
    """What a PRM reads at each check (see the module docstring)."""

    INCREMENTAL = "incremental"
    REENCODE = "reencode"
    CACHED = "cached"


@attrs.frozen
class Chunk:
    """The tokens one item feeds the PRM in a call."""

    tokens: int
    context: int = 0
    """Tokens already in the PRM's cache that these attend to."""


def _positive(_inst: object, attr: attrs.Attribute, value: float) -> None:
    config_check(value > 0, attr.name, value, "> 0")


@attrs.frozen
class PRMCostModel:
    """Prices one PRM call from the chunks it feeds; see the module docstring."""

    name: str
    model: ModelSpec
    flops: float = attrs.field(validator=_positive)
    """Effective FLOP/s (datasheet x efficiency)."""
    bandwidth: float = attrs.field(validator=_positive)
    """Effective bytes/s (datasheet x efficiency)."""
    call_overhead: float = attrs.field(validator=non_negative)
    """Fixed seconds per call."""
    tail_tokens: int = attrs.field(default=8, validator=non_negative)
    """``incremental``: tokens re-encoded per item besides the new ones."""

    def __attrs_post_init__(self) -> None:
        config_check(
            self.model.heads is not None and self.model.context is not None,
            "model",
            self.model.name,
            "a ModelSpec with heads and context",
        )

    @property
    def window(self) -> int:
        """The most tokens one input may hold (the PRM's context)."""
        assert self.model.context is not None  # checked in __attrs_post_init__
        return self.model.context

    def linear_flops(self, tokens: int) -> float:
        return 2.0 * self.model.params * tokens

    def attention_flops(self, tokens: int, context: int = 0) -> float:
        """FLOPs of ``tokens`` new tokens attending, causally, after ``context`` cached ones."""
        assert self.model.heads is not None
        per_pair = 4.0 * self.model.layers * self.model.heads * self.model.head_dim
        return per_pair * (tokens * context + tokens * (tokens + 1) / 2.0)

    def call_time(self, chunks: Iterable[Chunk]) -> float:
        """Seconds for one call feeding ``chunks`` (one batched prefill); 0 for none."""
        chunks = list(chunks)
        if not chunks:
            return 0.0
        work = sum(
            self.linear_flops(c.tokens) + self.attention_flops(c.tokens, c.context) for c in chunks
        )
        read = self.model.weight_bytes / self.bandwidth
        return self.call_overhead + max(work / self.flops, read)


def prm_serving(
    accelerator: Accelerator = H100,
    model: ModelSpec = QWEN_MATH_PRM_7B,
    *,
    flops_efficiency: float = 0.5,
    bandwidth_efficiency: float = 0.75,
    call_overhead: float = 10e-3,
    tail_tokens: int = 8,
) -> PRMCostModel:
    """A cost model for the PRM ``model`` on one ``accelerator``."""
    return PRMCostModel(
        name=f"{model.name} on {accelerator.name}",
        model=model,
        flops=accelerator.peak_flops * flops_efficiency,
        bandwidth=accelerator.bandwidth * bandwidth_efficiency,
        call_overhead=call_overhead,
        tail_tokens=tail_tokens,
    )


class PRMPricer:
    """A ``CostedPRM`` cost function: the seconds of each call under ``model``, reading
    inputs the ``mode`` way; it keeps how much of each branch the PRM has cached.

    ``tokens`` counts the tokens fed over all calls.
    """

    def __init__(
        self,
        model: PRMCostModel,
        mode: PRMInput | str = PRMInput.REENCODE,
        *,
        block: int = 16,
        stride: int = 1024,
    ) -> None:
        config_check(block >= 1, "block", block, ">= 1")
        config_check(1 <= stride <= model.window, "stride", stride, f"in 1..{model.window}")
        self.model = model
        self.mode = enum_converter(PRMInput, "mode")(mode)
        self.block = block
        self.stride = stride
        self.tokens = 0
        # request id -> branch index -> (tokens in the PRM's cache, the window's start)
        self._cached: dict[str, dict[int, tuple[int, int]]] = {}

    def __call__(self, items: Sequence[ScoreItem]) -> float:
        chunks = [self._chunk(item) for item in items]
        self.tokens += sum(c.tokens for c in chunks)
        return self.model.call_time(chunks)

    def _chunk(self, item: ScoreItem) -> Chunk:
        full = len(item.prompt) + item.num_tokens
        size = min(full, self.model.window)
        if self.mode is PRMInput.REENCODE:
            return Chunk(size)
        start = 0
        if self.mode is PRMInput.CACHED and full > self.model.window:
            over = full - self.model.window
            start = -(-over // self.stride) * self.stride  # the window moves in strides
            size = full - start
        branches = self._cached.setdefault(item.branch.request_id, {})
        previous = branches.pop(item.branch.index, None)
        if not item.final:
            branches[item.branch.index] = (size, start)
        if self.mode is PRMInput.CACHED:
            if previous is None or previous[1] != start:
                return Chunk(size)  # first check, or the window moved: encode it all
            keep = min(size, previous[0] // self.block * self.block)
            return Chunk(size - keep, keep)
        if previous is None or full > self.model.window:
            return Chunk(size)  # first check, or the window moved: encode it all
        keep = min(size, max(0, previous[0] - self.model.tail_tokens))
        return Chunk(size - keep, keep)

    def release(self, request_id: str) -> None:
        self._cached.pop(request_id, None)
