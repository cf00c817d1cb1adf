"""Tiny, randomly initialised models to try the real (transformers) path with no downloads.

``build_demo_models(dir)`` writes three model directories that load with the
standard ``from_pretrained`` code, exactly like a hub checkpoint would:

- ``policy/``: a Llama-architecture causal LM (2 layers, hidden 64, 2 heads of 32);
- ``qwen-prm/``: a token-classification model with 2 labels and the
  ``<extra_0>`` step separator: the output shape and input format of
  Qwen2.5-Math-PRM;
- ``shepherd-prm/``: a causal LM whose vocabulary has the Math-Shepherd step
  tag ``ки`` and the ``+``/``-`` rating tokens.

``build_qwen2_prm(dir)`` writes a checkpoint of the real architecture of
Qwen2.5-Math-PRM (``architectures=["Qwen2ForProcessRewardModel"]``: a Qwen2
body and the two-layer ``score`` head, the weights named as vLLM loads them),
for vLLM's PRM adapters (``sart.prm.vllm``, ``sart.prm.vllm_cached``), and
returns the same network in plain torch (``TinyQwen2PRM``) as a reference.

They share a byte-level BPE tokenizer trained here on synthetic arithmetic
reasoning text, with a Qwen-style chat template. The weights are random: the
models exercise every code path (shapes, formats, caches, masks) but their
text and rewards mean nothing. Model type ``llama`` is deliberate: with
``qwen2``, transformers substitutes its own Qwen2 tokenizer class for a custom
tokenizer directory.

Needs the ``[hf]`` extra (torch, transformers, tokenizers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STEP_SEPARATOR = "<extra_0>"
SHEPHERD_TAG = "ки"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", STEP_SEPARATOR]


def _corpus() -> list[str]:
    lines = []
    for a in range(40):
        for b in range(25):
            lines.append(
                f"Step 1: add {a} and {b}. {a} + {b} = {a + b}.\n\n"
                f"Step 2: check it: {a + b} - {b} = {a}. {SHEPHERD_TAG} +\n\n"
                f"So the answer is \\boxed{{{a + b}}}. {SHEPHERD_TAG} -"
            )
    return lines


def build_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer with the chat template and special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.add_tokens([SHEPHERD_TAG])  # one token, as in Math-Shepherd's own vocabulary
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(tokenizer: Any, **overrides: Any) -> Any:
    from transformers import LlamaConfig

    settings: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # head_dim 32: vLLM-CPU's attention needs at least 32.
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def write_demo_prompts(path: str | Path, count: int = 8) -> Path:
    """A JSONL prompt file (``prompt``, ``answer``) of arithmetic questions."""
    import json

    path = Path(path)
    lines = [
        json.dumps(
            {
                "id": f"q{i}",
                "prompt": f"Step 1: add {3 * i + 2} and {i + 5}.",
                "answer": str(4 * i + 7),
            }
        )
        for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def build_demo_models(directory: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write ``policy/``, ``qwen-prm/``, ``shepherd-prm/`` and ``prompts.jsonl`` under
    ``directory``; return their paths by name. Deterministic for a given ``seed``."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForTokenClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a few KB per file: the bars are only noise
    root = Path(directory)
    tokenizer = build_tokenizer()
    paths = {name: root / name for name in ("policy", "qwen-prm", "shepherd-prm")}
    torch.manual_seed(seed)
    builders = {
        "policy": lambda: LlamaForCausalLM(_config(tokenizer)),
        "qwen-prm": lambda: LlamaForTokenClassification(_config(tokenizer, num_labels=2)),
        "shepherd-prm": lambda: LlamaForCausalLM(_config(tokenizer)),
    }
    for name, build in builders.items():
        model = build()
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    paths["prompts"] = write_demo_prompts(root / "prompts.jsonl")
    return paths


def _tiny_qwen2_prm_class() -> type:
    import torch
    import transformers

    class TinyQwen2PRM(torch.nn.Module):
        """Qwen2.5-Math-PRM's network in plain transformers + torch: ``Qwen2Model`` and
        ``score = Sequential(Linear(h, h), ReLU, Linear(h, 2))``; ``forward`` returns
        ``.logits`` per token (the transformers PRM's contract)."""

        def __init__(self, config: Any) -> None:
            super().__init__()
            self.config = config
            self.model = transformers.Qwen2Model(config)
            self.score = torch.nn.Sequential(
                torch.nn.Linear(config.hidden_size, config.hidden_size),
                torch.nn.ReLU(),
                torch.nn.Linear(config.hidden_size, 2),
            )

        def forward(self, input_ids: Any, attention_mask: Any = None, **_: Any) -> Any:
            from types import SimpleNamespace

            hidden = self.model(
                input_ids=input_ids, attention_mask=attention_mask
            ).last_hidden_state
            return SimpleNamespace(logits=self.score(hidden))

    return TinyQwen2PRM


def build_qwen2_prm(
    directory: str | Path,
    tokenizer: Any = None,
    *,
    hidden: int = 64,
    positions: int = 4096,
    seed: int = 0,
) -> tuple[Path, Any]:
    """Write a random ``Qwen2ForProcessRewardModel`` checkpoint (2 layers, ``hidden``
    wide, heads of 32: vLLM-CPU's attention needs a multiple of 32) with ``tokenizer``
    (default ``build_tokenizer()``) under ``directory``; return its path and the same
    network as a torch module (``.logits`` per token)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    tokenizer = tokenizer or build_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=hidden // 32,
        num_key_value_heads=1,
        max_position_embeddings=positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        num_labels=2,
    )
    config.architectures = ["Qwen2ForProcessRewardModel"]
    torch.manual_seed(seed)
    net = _tiny_qwen2_prm_class()(config).eval()
    weights = {name: tensor.contiguous() for name, tensor in net.state_dict().items()}
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root, net
