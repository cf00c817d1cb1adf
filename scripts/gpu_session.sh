#!/usr/bin/env bash
# Every GPU measurement the transformers engine still owes (issue 46), as one command
# on a GPU machine with its own torch and transformers, nothing downloaded, in under
# 9 minutes (one device call; each step bounded by its own timeout):
#
#   bash scripts/gpu_session.sh OUT_DIR            # on the GPU machine
#   bash scripts/gpu_session.sh OUT_DIR --quick    # the same steps, tiny, on a CPU (CI)
#
# 1. scripts/gpu_check.py --engine hf   (every check: parity, graphs, step cost, bench, 7B)
# 2. benchmarks/hf_decode.py --device cuda   (the decode modes side by side, own buffers too)
# 3. scripts/cost_model_check.py, the GPU's 14B preset (h100-14b on an H100, else
#    h200-14b), through the engine and over CUDA graphs
#
# Each step's output is in OUT_DIR (a .log each, JSON where the tool writes it) and
# OUT_DIR/summary.txt has one line per step with its exit status; the script exits 1
# if any step failed (a gpu_check check failing included). The project runs from this checkout (PYTHONPATH),
# not installed: a GPU machine without a package index cannot build it. sart bench's
# run log needs cattrs: wheels in .whl/ (`pip download --no-deps -d .whl cattrs`)
# are installed into a temporary folder first; docs/how-to/gpu.md has the whole recipe.
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR [--quick]}
quick=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:$site"
fi

if [ "$quick" = "--quick" ]; then
    check=(--allow-cpu --quick)
    decode=(--device cpu --requests 1 --n 2 --steps 8)
    costs=(--tiny --device cpu --batch 1 4 --context 64 --steps 2 --warmup 1)
else
    check=()
    decode=(--device cuda --steps 300)
    # The preset of the GPU at hand (an H100's is h100-14b), else h200-14b. 8k context
    # skipped: 64 branches of it do not fit an H100 beside 14B's weights, and batch 1
    # (the done-when's target) is in every row anyway.
    preset=$("$python" -c "import torch; print('h100-14b' if 'H100' in torch.cuda.get_device_name() else 'h200-14b')" 2>/dev/null || echo h200-14b)
    costs=(--preset "$preset" --batch 1 8 32 64 --context 1024 4096)
fi
: >"$out/summary.txt"

step() {  # step NAME SECONDS COMMAND...: run, log, and note its exit status
    local name=$1 seconds=$2
    shift 2
    echo "== $name: $*"
    timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "$name rc=$rc$([ "$rc" -eq 124 ] && echo ' (timed out)')" >>"$out/summary.txt"
    [ "$rc" -eq 0 ] || failed=1
}
failed=0

command -v nvidia-smi >/dev/null && nvidia-smi >"$out/nvidia-smi.txt" 2>&1
step gpu-check 300 "$python" scripts/gpu_check.py --engine hf "${check[@]}" \
    --json "$out/gpu-check.json"
step hf-decode 60 "$python" benchmarks/hf_decode.py "${decode[@]}"
step cost-engine 75 "$python" scripts/cost_model_check.py "${costs[@]}" \
    --out "$out/cost-engine.json"
step cost-graphs 75 "$python" scripts/cost_model_check.py "${costs[@]}" --through graphs \
    --out "$out/cost-graphs.json"
cat "$out/summary.txt"
exit "$failed"
