#!/usr/bin/env bash
# Build the venv in which SGLang runs for real on this CPU machine, for sart's SGLang tests.
#
#   scripts/sglang_cpu_env.sh [VENV]            # default VENV: .ci-sglang-venv (rebuilt from scratch)
#   scripts/sglang_cpu_env.sh --relock [VENV]   # re-resolve and rewrite scripts/sglang-cpu/constraints.txt
#
# What goes in (see docs/how-to/sglang.md, "SGLang on a CPU, for tests"):
#   1. torch 2.13.0+cpu, held there by scripts/sglang-cpu/constraints.txt (SGLang 0.5.23 pins
#      torch 2.14.1, whose only build here is a multi-GB CUDA one: never let pip pick torch),
#      installed by pip, which finds the CPU wheel where this machine's pip configuration
#      says (uv reads no pip configuration);
#   2. sglang==0.5.23 with --no-deps;
#   3. SGLang's requirements minus the CUDA-only ones (scripts/sglang-cpu/requirements.txt says
#      which and why), every version pinned by constraints.txt;
#   4. sart itself, editable, with its hf and dev extras.
# Steps 2-4 go through uv (from PyPI, into the venv): the same versions pip installed (pip
# freeze of both venvs agrees), the whole script in about a third of the time; torch, already
# there, satisfies every later step's pin.
# Not installed: sgl_kernel and torchvision. The tests stand in for them with the packages in
# tests/shims (each one's docstring says what it replaces, why SGLang's own code still runs and
# what would break it); tests/sglang_cpu.py puts them on the import path and sets
# SGLANG_USE_CPU_ENGINE=1, so `VENV/bin/python -m pytest tests/test_engines_sglang.py` just works.
# By hand: SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=tests/shims VENV/bin/python -m sglang.launch_server ...
set -euo pipefail
cd "$(dirname "$0")/.."

relock=0
if [ "${1:-}" = "--relock" ]; then
    relock=1
    shift
fi
venv=${1:-.ci-sglang-venv}
here=scripts/sglang-cpu
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0

start=$(date +%s)
rm -rf "$venv"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip)
# Byte code is compiled on first import instead (only what the tests import).
"${pip[@]}" install --quiet --no-compile "uv==${UV_VERSION:-0.13.9}"
uv_install=("$venv/bin/uv" pip install --quiet --no-cache --python "$venv/bin/python")
if [ "$relock" -eq 1 ]; then
    constraints=$(mktemp)
    echo "torch==$TORCH_VERSION" >"$constraints"
else
    constraints=$here/constraints.txt
fi
# torch first, from its pin alone: nothing else may choose it.
"${pip[@]}" install --quiet --no-compile -c "$constraints" "torch==$TORCH_VERSION"
"${uv_install[@]}" --no-deps "sglang==$SGLANG_VERSION"
"${uv_install[@]}" -c "$constraints" -r "$here/requirements.txt" -e '.[hf,dev]'

if [ "$relock" -eq 1 ]; then
    {
        echo "# Every version in the SGLang-CPU venv (scripts/sglang_cpu_env.sh --relock wrote it)."
        echo "# torch stays 2.13.0+cpu; sglang itself is installed with --no-deps."
        "${pip[@]}" freeze --exclude-editable | grep -v -E '^(sart|pip|setuptools|uv)(==| @)'
    } >"$here/constraints.txt"
    rm -f "$constraints"
fi

# The venv must hold a CPU torch and neither of the packages the shims stand in for.
"$venv/bin/python" - "$TORCH_VERSION" <<'EOF'
import importlib.util
import sys

import torch

want = sys.argv[1] + "+cpu"
assert torch.__version__ == want, f"torch {torch.__version__} installed, not {want}"
for name in ("sgl_kernel", "torchvision"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed: tests/shims stands in for it"
EOF
# SGLang's engine imports on its CPU path with the shims.
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=tests/shims "$venv/bin/python" -c \
    "import sglang, sglang.srt.entrypoints.engine; print('sglang', sglang.__version__, 'imports')"
echo "SGLang-CPU venv $venv built in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)"
