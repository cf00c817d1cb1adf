"""A stand-in for ``sglang.Engine``, for the SGLang adapter's tests and the scenario suite.

``SGLangStandIn`` follows the signatures of ``sglang.Engine`` read from
SGLang's ``python/sglang/srt/entrypoints/engine.py`` (``async_generate(prompt=None,
sampling_params=None, input_ids=None, ..., stream=False, ..., rid=None, ...)``,
awaited, returning an async generator of chunks when ``stream=True``;
``server_args``; ``loop``; ``tokenizer_manager``) and
``python/sglang/srt/managers/tokenizer_manager.py`` (``abort_request(rid="",
abort_all=False)``, ``tokenizer``, ``context_len``, and the chunk format:
``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", ...}}``, cumulative by default, deltas with
``incremental_streaming_output``; with ``return_logprob``, ``meta_info`` also
holds ``output_token_logprobs`` and, for ``top_logprobs_num > 0``,
``output_top_logprobs``, sliced as ``output_ids`` are and, when cumulative,
the live lists themselves, as SGLang hands them out). It is not SGLang: its
tokens are a function of (input ids, seed, position), their log-probabilities
a function of the token (``logprobs``), it streams them in random bursts, and
it knows nothing of batching or KV.

SGLang is not installed in the main test venv (the real one runs in its own
venv: ``sglang_cpu``), so the adapter's module is imported with a stand-in
``sglang`` module in ``sys.modules`` (``adapter_module``; the module only
checks that ``sglang`` exists; wrapping an engine does not import it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import importlib.machinery
import random
import sys
import types
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Annotated, Any

EOS = 2


class _WordTokenizer:
    """A stand-in tokenizer: one id per word (3 + its length), special token 1 first."""

    def encode(self, text: str) -> list[int]:
        return [1] + [3 + len(w) for w in text.split()]

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True
    ) -> list[int]:
        assert add_generation_prompt and tokenize
        return [1, 90] + [3 + len(w) for w in messages[-1]["content"].split()] + [91]


@dataclasses.dataclass
class _Arg:
    """SGLang's ``Arg`` record in a field's ``Annotated`` metadata: its CLI facts."""

    choices: list[str] | None = None
    aliases: list[str] | None = None


@dataclasses.dataclass
class StandInServerArgs:
    """A few of SGLang 0.5.23's ``ServerArgs`` fields, typed as it types them (``Annotated``
    with an ``Arg`` holding choices and aliases), for ``sglang_launch``'s checks."""

    model_path: Annotated[str, _Arg(aliases=["--model"])]
    tp_size: Annotated[int, _Arg(aliases=["--tensor-parallel-size"])] = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    attention_backend: Annotated[str | None, _Arg(choices=["triton", "torch_native"])] = None
    json_model_override_args: Annotated[str, "A dictionary in JSON string format"] = "{}"
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    custom_sigquit_handler: Callable[..., Any] | None = None
    incremental_streaming_output: bool = False


class _TokenizerManagerStandIn:
    """``engine.tokenizer_manager``: ``abort_request`` records the rids it is given."""

    def __init__(self, owner: SGLangStandIn, context_len: int) -> None:
        self.owner = owner
        self.tokenizer = _WordTokenizer()
        self.context_len = context_len
        self.aborted: list[str] = []

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)
        self.owner.running.discard(rid)


class SGLangStandIn:
    """A stand-in that follows the signatures of ``sglang.Engine`` read from
    ``python/sglang/srt/entrypoints/engine.py`` (see the module docstring), not SGLang.

    ``length``: tokens until EOS (the last one, id 2, text ""); ``max_new_tokens``
    ends a request sooner as ``"length"``. ``burst``: most tokens per chunk;
    ``delay``: seconds before each chunk.
    ``incremental``: ``server_args.incremental_streaming_output``. Keys of
    ``fail_after`` / ``abort_after`` end a rid (e.g. ``":1_a"``): that request's
    stream raises, or ends with ``finish_reason {"type": "abort"}``, after that
    many tokens; ``lengths`` gives such rids their own ``length``. ``scripted``:
    every request streams exactly these chunks instead.
    """

    server_args_class = StandInServerArgs

    def __init__(
        self,
        *,
        length: int = 16,
        burst: int = 4,
        incremental: bool = False,
        context_len: int = 4096,
        fail_after: Mapping[str, int] | None = None,
        abort_after: Mapping[str, int] | None = None,
        lengths: Mapping[str, int] | None = None,
        scripted: list[dict] | None = None,
        delay: float = 0.0,
        loop: asyncio.AbstractEventLoop | None = None,
        **server_args: Any,
    ) -> None:
        self.length = length
        self.delay = delay
        self.burst = burst
        self.fail_after = dict(fail_after or {})
        self.abort_after = dict(abort_after or {})
        self.lengths = dict(lengths or {})
        self.scripted = scripted
        server_args.setdefault("max_running_requests", None)
        self.server_args = types.SimpleNamespace(
            incremental_streaming_output=incremental, **server_args
        )
        self.tokenizer_manager = _TokenizerManagerStandIn(self, context_len)
        self.loop = loop
        self.calls: list[dict[str, Any]] = []
        self.running: set[str] = set()
        self.completed: set[str] = set()
        self.shut_down = False

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        image_data: Any = None,
        return_logprob: bool | list[bool] | None = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        **rest: Any,
    ) -> dict | AsyncIterator[dict]:
        self.calls.append(
            {
                "prompt": prompt,
                "sampling_params": dict(sampling_params or {}),
                "input_ids": list(input_ids or []),
                "stream": stream,
                "rid": rid,
                "return_logprob": return_logprob,
                "top_logprobs_num": top_logprobs_num,
            }
        )
        assert isinstance(rid, str) and stream is True, "the adapter streams single requests"
        assert logprob_start_len in (None, -1), "the adapter asks for the output's logprobs only"
        self.running.add(rid)
        if self.scripted is not None:
            return self._replay(self.scripted, rid)
        top = (top_logprobs_num or 0) if return_logprob else None
        return self._stream(list(input_ids or []), dict(sampling_params or {}), rid, top)

    async def _replay(self, chunks: list[dict], rid: str) -> AsyncIterator[dict]:
        for chunk in chunks:
            await asyncio.sleep(0)
            yield chunk
        self.running.discard(rid)

    def shutdown(self) -> None:
        self.shut_down = True

    def tokens(self, input_ids: list[int], seed: int, length: int | None = None) -> list[int]:
        """The request's tokens: a function of its input ids and seed."""
        rng = random.Random(repr((input_ids, seed)))
        return [rng.randint(3, 60) for _ in range((length or self.length) - 1)] + [EOS]

    @staticmethod
    def logprobs(token: int, top: int) -> tuple[float, list[float]]:
        """The stand-in's log-probabilities of ``token``: the sampled token's and the
        ``top`` most likely tokens' (highest first, the first >= the sampled one's)."""
        return -0.1 - 0.05 * (token % 9), [-0.1 * (j + 1) + 0.05 for j in range(top)]

    async def _stream(
        self, input_ids: list[int], params: dict, rid: str, top: int | None = None
    ) -> AsyncIterator[dict]:
        """``top``: the request's ``top_logprobs_num`` if it asked for logprobs."""
        length = next((n for key, n in self.lengths.items() if rid.endswith(key)), None)
        tokens = self.tokens(input_ids, params.get("sampling_seed", 0), length)
        budget = params.get("max_new_tokens", 128)
        end = min(len(tokens), budget)
        fail = next((n for key, n in self.fail_after.items() if rid.endswith(key)), None)
        abort = next((n for key, n in self.abort_after.items() if rid.endswith(key)), None)
        rng = random.Random(repr((input_ids, params)))
        incremental = self.server_args.incremental_streaming_output
        done: list[int] = []
        text = ""
        # Per token, as SGLang's tokenizer manager keeps them: (logprob, id, text) triples.
        sampled_lps: list[tuple[float, int, None]] = []
        top_lps: list[list[tuple[float, int, None]]] = []
        try:
            while len(done) < end:
                await asyncio.sleep(self.delay)
                if rid not in self.running:  # aborted: SGLang sends an abort finish
                    raise AssertionError(f"the adapter read the stream of aborted {rid}")
                new = tokens[len(done) : len(done) + rng.randint(1, self.burst)][: end - len(done)]
                if fail is not None and len(done) + len(new) >= fail:
                    raise RuntimeError(f"stand-in stream of {rid} broke")
                reason = None
                if abort is not None and len(done) + len(new) >= abort:
                    reason = {"type": "abort", "message": "out of memory", "status_code": 503}
                elif len(done) + len(new) == end:
                    if end == len(tokens):
                        reason = {"type": "stop", "matched": EOS}
                    else:
                        reason = {"type": "length", "length": end}
                piece = "".join("" if t == EOS else f"t{t} " for t in new)
                offset = len(done)
                done += new
                text += piece
                meta = {
                    "id": rid,
                    "finish_reason": reason,
                    "prompt_tokens": len(input_ids),
                    "completion_tokens": len(done),
                    "cached_tokens": 0,
                }
                if top is not None:
                    for t in new:
                        lp, tops = self.logprobs(t, top)
                        sampled_lps.append((lp, t, None))
                        top_lps.append([(v, 100 + j, None) for j, v in enumerate(tops)])
                    # Cumulative: SGLang's live lists; incremental: the chunk's slice.
                    meta["output_token_logprobs"] = (
                        sampled_lps[offset:] if incremental else sampled_lps
                    )
                    meta["output_token_logprobs_length"] = len(sampled_lps)
                    if top > 0:
                        meta["output_top_logprobs"] = top_lps[offset:] if incremental else top_lps
                if reason is not None:  # SGLang drops a request's state before its last chunk
                    self.completed.add(rid)
                    self.running.discard(rid)
                if incremental:
                    yield {"text": piece, "output_ids": list(new), "meta_info": meta}
                else:
                    yield {"text": text, "output_ids": list(done), "meta_info": meta}
                if reason is not None:
                    return
        finally:
            self.running.discard(rid)


# ----------------------------------------------------------- the module, on the stand-in


def standin_sglang_module() -> types.ModuleType:
    """A stand-in ``sglang`` module: ``sglang.Engine`` is ``SGLangStandIn``."""
    module = types.ModuleType("sglang")
    module.__spec__ = importlib.machinery.ModuleSpec("sglang", None)
    module.Engine = SGLangStandIn  # type: ignore[attr-defined]
    return module


def forget_adapter_module() -> None:
    sys.modules.pop("sart.engines.sglang", None)
    engines = sys.modules.get("sart.engines")
    if engines is not None and hasattr(engines, "sglang"):
        delattr(engines, "sglang")


@contextlib.contextmanager
def adapter_module() -> Iterator[Any]:
    """``sart.engines.sglang`` imported with the stand-in ``sglang`` module (both gone after)."""
    saved = sys.modules.get("sglang")
    sys.modules["sglang"] = standin_sglang_module()
    forget_adapter_module()
    try:
        yield importlib.import_module("sart.engines.sglang")
    finally:
        forget_adapter_module()
        if saved is None:
            sys.modules.pop("sglang", None)
        else:
            sys.modules["sglang"] = saved
