#!/usr/bin/env bash
# The GPU benchmark in one short lease (issue 28): a machine with CUDA torch, transformers,
# sentence-transformers and peft already installed, no network, a 64 MiB transfer, about 15 minutes.
# Unlike run.sh (the full offline bundle, 60 MB pieces), this carries only what such a machine lacks:
#
#   here:   make gpu-lean                      # .whl/ (bench/gpu/lean-wheels.txt, 16 MB), .gpu/models (4 MB)
#   there:  bash bench/gpu/lean.sh [STEP ...]  # carry .whl and .gpu
#
# The models are built there with random weights (bench.gpu.models): the timings are those of the real
# shapes. Steps run in the order given (default: all, most important first), each under its own time cap,
# and every result is appended to $OUT as it comes: log.txt (the console), report.md (each step's
# markdown), results.tar (each step's JSON), so a lease that ends early still returns what finished.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-bench/out/gpu}
mkdir -p "$out" /tmp/gpu-results
exec > >(tee -a "$out/log.txt") 2>&1
export site=${CARPOOL_GPU_SITE:-/tmp/carpool-site} models=/tmp/carpool-models
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py() { PYTHONPATH="$1:$site:$PWD/runtime/src:$PWD/operator/src:$PWD" python3 "${@:2}"; }

setup() {
  # (again whenever the carried wheels differ from those installed: a warm machine keeps /tmp)
  if [ -z "${CARPOOL_GPU_SITE:-}" ] && ! ls .whl | cmp -s - "$site/.installed"; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl &&
      ls .whl >"$site/.installed" || return 1
  fi
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
  py "" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, torch.cuda.get_device_name())'
  # fail here, in seconds, if the runtime or a benchmark cannot import (not in every step after)
  py "" -c 'import carpool.runtime.server, carpool.runtime.api.app, carpool.runtime.api.grpc.server, bench.run, bench.generation, bench.lora, bench.peer' || return 1
  for v in minilm bert-base smollm2; do
    [ -d "$models/$v" ] || py "" -m bench.gpu.models build .gpu/models "$v" "$models/$v" || return 1
  done
  [ -d "$models/llama-1b" ] || py "" -m bench.gpu.models build .gpu/models llama-1b "$models/llama-1b" --device cuda
}
encoder() {  # $1: model variant, $2: the results' name (the step's), then extra bench.run flags
  local name=$2
  py "$models/$1" -m bench.run --wait-quiet 0 --phase-seconds 12 --markdown "/tmp/gpu-results/$name.md" \
    --out "/tmp/gpu-results/$name.json" "${@:3}"
}
peer() {
  py "$models/minilm" -m bench.peer --dtype bfloat16 --seconds 12 --single-seconds 5 --json /tmp/gpu-results/peer-minilm.json
}
generation() {  # $1: model variant, $2: clients, $3: requests
  py "$models/$1" -m bench.generation --wait-quiet 0 --clients "$2" --requests "$3" --serial-requests 4 \
    --single-samples 4 --skip-transformers-cb --markdown "/tmp/gpu-results/generation-$1-$2.md" \
    --json "/tmp/gpu-results/generation-$1-$2.json"
}
lora() {
  py "$models/smollm2" -m bench.lora --dtype auto --requests 64 --clients 16 --adapters 8 --json /tmp/gpu-results/lora.json
}
profile() {  # where a saturated server's CPU goes, per thread, with py-spy's samples of the engine
  py "$models/minilm" -m bench.profile --seconds 10 --py-spy "$site/bin/py-spy" --markdown /tmp/gpu-results/profile-minilm.md
}
smoke() {  # the lease's first minute: every GPU server serves a few requests (pass/fail, the error if any)
  py "$models/minilm:$models/smollm2" -m bench.gpu.smoke --timeout 100
}
attention() {  # attention per sequence against batched (issue 37, item 2): alone (no model, seconds), then
  # SmolLM2's whole decode step at 64 sequences with each
  py "" -m bench.attention --device cuda --dtype bfloat16 --markdown /tmp/gpu-results/attention.md
  py "$models/smollm2" -m bench.step --device cuda --precisions bfloat16 --decoders auto \
    --attention per-sequence batched --sequences 64 --steps 10 --markdown /tmp/gpu-results/attention-smollm2.md
}
graphs() {
  py "$models/minilm" -m bench.offline --compare-graphs --latency-samples 100 | tee /tmp/gpu-results/graphs-minilm.txt
}

run_step() {  # name, cap in seconds, command...
  local name=$1 cap=$2
  shift 2
  echo "=== $name (cap ${cap}s) $(date -u +%T)"
  local started=$SECONDS
  timeout --kill-after=10 "$cap" bash -c "$*"
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - started))s"
  for f in /tmp/gpu-results/*.md /tmp/gpu-results/*.txt; do
    [ -f "$f" ] && [ ! -f "$f.sent" ] && { printf '\n## %s\n\n' "$(basename "$f")"; cat "$f"; } >>"$out/report.md" && touch "$f.sent"
  done
  tar -C /tmp/gpu-results -cf "$out/results.tar" --exclude='*.sent' .
  return 0
}

export -f py setup smoke encoder peer generation lora profile attention graphs
steps=("$@")
# Default order: what no lease has measured yet first (2026-11-26: the encoder and the peer were measured).
# smoke comes right after setup, before any benchmark: a crash is found in the first minute of the lease.
[ ${#steps[@]} -gt 0 ] || steps=(setup smoke gen-smollm2-64 attention encoder-minilm profile lora gen-smollm2-16 encoder-bert-base gen-llama-1b-16 peer graphs)
for step in "${steps[@]}"; do
  case $step in
    setup) run_step setup 120 setup ;;
    smoke) run_step smoke 120 smoke ;;
    # several engine processes share the GPU, each doing its host work under its own interpreter lock
    encoder-*-p[0-9]*)
      variant=${step#encoder-}
      run_step "$step" 170 encoder "${variant%-p*}" "$step" "--server-flag=--model.processes=${step##*-p}" ;;
    encoder-*) run_step "$step" 170 encoder "${step#encoder-}" "$step" ;;
    peer) run_step peer 90 peer ;;
    gen-smollm2-16) run_step "$step" 150 generation smollm2 16 48 ;;
    gen-smollm2-64) run_step "$step" 150 generation smollm2 64 128 ;;
    gen-llama-1b-16) run_step "$step" 150 generation llama-1b 16 48 ;;
    lora) run_step lora 100 lora ;;
    profile) run_step profile 90 profile ;;
    attention) run_step attention 90 attention ;;
    graphs) run_step graphs 150 graphs ;;
    *) echo "unknown step $step" ;;
  esac
done
