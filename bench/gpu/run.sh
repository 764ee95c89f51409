#!/usr/bin/env bash
# The GPU benchmark run, on a machine with CUDA torch and no network (issue "GPU: carpool measured on an
# H100 or H200"). Build the bundle here first (`make gpu-bundle`: .gpu-bundle/piece-NNN, 60 MB each), carry
# the pieces to the GPU machine (at most 64 MiB a transfer: one or two pieces per call; pieces carried
# earlier stay while the machine is warm), then in the repository root there:
#
#     bash bench/gpu/run.sh [OUTPUT_DIR]
#
# It installs the bundle into /tmp/carpool-site (checked against its manifest; the machine's own torch is
# used), records the device, and runs the encoder and generation benchmarks, writing their reports to
# OUTPUT_DIR (default $OUT, else bench/out/gpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-bench/out/gpu}}
mkdir -p "$out"
site=/tmp/carpool-site
if [ ! -f "$site/.installed" ]; then
  python3 -m bench.gpu.install .gpu-bundle --target "$site"
  touch "$site/.installed"
fi
export PYTHONPATH="$site:$PWD"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$out/device.csv"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)' | tee "$out/versions.txt"
python3 -m bench.run --wait-quiet 0 --markdown "$out/encoder.md" --out "$out/encoder.json" \
  --server-flag=--model.dtype=float16 ${CARPOOL_BENCH_FLAGS:-} 2>&1 | tee "$out/encoder.log"
if [ -z "${CARPOOL_BENCH_SKIP_GENERATION:-}" ]; then
  python3 -m bench.generation --markdown "$out/generation.md" --json "$out/generation.json" 2>&1 | tee "$out/generation.log"
fi
