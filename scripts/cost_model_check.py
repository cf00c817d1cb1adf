"""Check the simulator's cost model against a real GPU: measured vs predicted decode steps.

    python scripts/cost_model_check.py                      # one H200, the h200-14b preset
    python scripts/cost_model_check.py --preset h100-14b --batch 1 8 32 64 --context 1024 4096 8192
    python scripts/cost_model_check.py --tiny --device cpu  # a smoke test (CI runs it)

Builds a random-weight model of the preset's shape with transformers (Qwen2.5-14B
for ``h200-14b`` and ``h100-14b``: 48 layers, hidden 5120, 40 heads, 8 KV heads
of dim 128, intermediate 13824, vocabulary 152064; no download), and times
decode steps at every batch size ``B`` and context length: through sart's
transformers engine (the default, ``--through engine``: ``B`` branches of one
request whose prompt is ``context`` token ids, one token per branch per step
in the engine's own batch, sampling included: what ``sart bench --engine hf``
runs, so measured and predicted compare like with like), or (``--through
static``) the bare model on a static KV cache, one token per sequence per
step at position ``context`` (the cache's earlier positions are zeros, not a
real prompt: a decode step costs the same whatever they hold), or (``--through
graphs``) the engine with its decode steps replayed as CUDA graphs
(``cuda_graphs=True``; on a CPU the same forward, not captured). It prints, per
(B, context), the median measured step time, the preset's predicted time
(``CostModel.decode_time([context] * B, [1] * B)``), their ratio, and the
bandwidth efficiency the measurement implies (bytes a step must read —
weights plus B x context KV — over the measured time and the accelerator's
peak bandwidth; the preset assumes 0.75). Combinations whose KV does not fit
in the GPU's memory next to the weights are skipped and said so. ``--out``
writes the rows as JSON.

Which way transformers biases the check: it is slower than vLLM per step
(a Python loop per layer, no paged attention or CUDA graphs; a static cache's
attention reads its whole buffer), so a measured time at or below the prediction
means vLLM would beat the preset (the model is conservative there), and a
measured time above it does not by itself show the preset too fast.

Budget: about 2 minutes on one H200 (weights are initialised on the GPU;
each combination runs ``--warmup`` + ``--steps`` steps).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path
from typing import Any

QWEN_14B_SHAPE = {
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 152064,
}
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}


def build_model(shape: dict[str, int], device: Any, dtype: Any, classify: bool = False) -> Any:
    """A random-weight Qwen2 model of ``shape``, built on ``device`` (no copy from the
    CPU); ``classify``: a two-label token-classification head, as a PRM's."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForTokenClassification,
        Qwen2Config,
    )

    config = Qwen2Config(
        **shape, max_position_embeddings=32768, tie_word_embeddings=False, num_labels=2
    )
    loader = AutoModelForTokenClassification if classify else AutoModelForCausalLM
    with torch.device(device):
        model = loader.from_config(config, dtype=dtype)
    return model.eval()


def time_steps(
    model: Any, batch: int, context: int, steps: int, warmup: int, device: str
) -> list[float]:
    """Seconds of each of ``steps`` decode steps (after ``warmup``) of ``batch``
    sequences at position ``context`` onwards, on a static cache."""
    import torch
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=context + warmup + steps + 1)
    ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
    # transformers renamed past_key_values to cache (5.2x deprecates the old name).
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    times = []
    with torch.inference_mode():
        for i in range(warmup + steps):
            position = torch.tensor([context + i], device=device)
            _sync(device)
            start = time.perf_counter()
            model(input_ids=ids, cache_position=position, use_cache=True, **{name: cache})
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return times


def time_engine_steps(
    model: Any, batch: int, context: int, steps: int, warmup: int, device: str,
    graphs: bool = False,
) -> tuple[list[float], int]:  # fmt: skip
    """Seconds of each of ``steps`` decode steps (after ``warmup``) of sart's
    transformers engine: ``batch`` branches of one request whose prompt is
    ``context`` tokens, in the engine's own batch (the step's keys and values
    written in place: ``sart.engines.hf_kv``), sampling included; and how many
    steps ran without graphs (``graphs``: their bucket over the buffers' budget)."""
    from sart.demo_models import build_tokenizer
    from sart.engines.hf import HFEngine
    from sart.messages import BranchSpec
    from sart.types import SamplingSettings

    engine = HFEngine(model, build_tokenizer())  # ids beyond its vocabulary decode to ""
    engine.split_cost = None  # one batch: every row is as long
    engine.context_len = None  # the check picks contexts past the shape's positions
    if graphs:  # the first step of each bucket captures it: in the warm-up
        from sart.engines.hf_graphs import StaticDecode

        engine.static = StaticDecode(model)  # captured on a GPU only
    vocab = model.config.vocab_size
    prompt = [5 + i % (vocab - 5) for i in range(context)]
    settings = SamplingSettings(temperature=1.0, max_tokens=warmup + steps + 2, ignore_eos=True)
    engine.prefill("check", prompt, settings)
    engine.start_branches("check", [BranchSpec(j, seed=j) for j in range(batch)])
    times = []
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        engine.step(1)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    engine.release_prefix("check")
    return times, engine.static.over_budget if engine.static is not None else 0


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


THROUGH = {"engine": "sart", "graphs": "sart over CUDA graphs", "static": "a static cache"}


def fits(preset: Any, batch: int, context: int, free_bytes: float | None) -> bool:
    if free_bytes is None:
        return True
    return batch * (context + 64) * preset.kv_bytes_per_token < 0.9 * free_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="h200-14b", help="the cost model to check")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument(
        "--through",
        choices=["engine", "graphs", "static"],
        default="engine",
        help="time sart's transformers engine (default), the engine over CUDA graphs, or the "
        "bare model on a static cache",
    )
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)

    import torch

    from sart.engines.costs import cost_model

    preset = cost_model(args.preset)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    shape = TINY_SHAPE if args.tiny else QWEN_14B_SHAPE
    print(
        f"torch {torch.__version__}, device {args.device}, preset {preset.name}, "
        f"through {THROUGH[args.through]}",
        flush=True,
    )
    if args.device.startswith("cuda"):
        print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
    built = time.perf_counter()
    model = build_model(shape, args.device, dtype)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e9:.2f} B parameters, built in {time.perf_counter() - built:.1f} s")
    free = None
    if args.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
    peak_bandwidth = preset.accelerator.bandwidth if preset.accelerator else None
    rows = []
    print(f"{'B':>4} {'context':>8} {'measured ms':>12} {'predicted ms':>13} {'ratio':>6} "
          f"{'implied bw eff':>15}")  # fmt: skip
    for context in args.context:
        for batch in args.batch:
            if not fits(preset, batch, context, free):
                print(f"{batch:>4} {context:>8}  skipped: its KV does not fit next to the weights")
                continue
            over = 0
            if args.through == "static":
                times = time_steps(model, batch, context, args.steps, args.warmup, args.device)
            else:
                times, over = time_engine_steps(
                    model, batch, context, args.steps, args.warmup, args.device,
                    graphs=args.through == "graphs",
                )  # fmt: skip
            measured = statistics.median(times)
            predicted = preset.decode_time([context] * batch, [1] * batch)
            step_bytes = preset.weight_bytes + batch * context * preset.kv_bytes_per_token
            spent = max(measured - preset.step_overhead, 1e-9)
            efficiency = step_bytes / spent / peak_bandwidth if peak_bandwidth else None
            rows.append(
                {"batch": batch, "context": context, "measured_s": measured,
                 "predicted_s": predicted, "implied_bandwidth_efficiency": efficiency,
                 "steps_without_graphs": over}
            )  # fmt: skip
            eff = "-" if efficiency is None else f"{efficiency:.2f}"
            # Over the buffers' memory budget, graphs' steps run by the default path.
            note = f"  ({over} steps without graphs: over budget)" if over else ""
            print(f"{batch:>4} {context:>8} {1e3 * measured:>12.2f} {1e3 * predicted:>13.2f} "
                  f"{measured / predicted:>6.2f} {eff:>15}{note}", flush=True)  # fmt: skip
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"preset": preset.name, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
