"""sart's test stand-in for ``torchvision``.

What it replaces. SGLang imports ``torchvision.transforms`` at the top of
modules that every engine loads (``sglang.srt.configs`` imports
``multimodal/internvl_utils.py``), though only image models use it. The
``torchvision`` wheels are CUDA builds: 0.28.0, the release for torch 2.13,
fails at import on torch 2.13.0+cpu (``RuntimeError: operator torchvision::nms
does not exist``, registering a fake op); patching the installed package to
guard that would change a package under test. This package makes
every ``torchvision`` name and submodule importable as a placeholder that
raises ``NotImplementedError`` when called (``_sart_shim``).

Why tests on it still test SGLang. Text models never call torchvision: the
placeholders are only imported. A test that called one would fail, naming it.

What would break it. An image or video model (or a processor that transforms
images) calls torchvision and fails; so would a library that reads
``torchvision.__version__`` and compares it (transformers does not for text
models).
"""

from __future__ import annotations

from _sart_shim import stand_in

__version__ = "0.0.0+sart.standin"

__getattr__ = stand_in(__name__)
