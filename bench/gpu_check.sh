#!/usr/bin/env bash
# The GPU check a lent machine runs first (docs/performance.md, "GPU"): from a fresh machine whose
# image has torch but not DeepSpeed, install the carried wheels, then measure in one go, each part
# writing its JSON as it goes so that a run cut short keeps what it measured.
#   bash bench/gpu_check.sh WHEELS_DIR OUT_DIR [PARTS]   (PARTS: 1b,125m_docmask,window; default all)
# WHEELS_DIR holds deepspeed and the packages the image lacks (docs/performance.md lists them).
set -uo pipefail
wheels=${1:?wheels dir}; out=${2:?out dir}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
bench() { local name=$1 limit=$2 script=$3; shift 3
  # its own process group, killed whole at the limit: a child left behind would hold the GPU
  setsid python3 "$script" --json "$out/$name.json" "$@" >"$out/$name.log" 2>&1 &
  local pid=$!; (sleep "$limit"; kill -9 -- "-$pid" 2>/dev/null) & local timer=$!
  wait "$pid"; kill "$timer" 2>/dev/null; cat "$out/$name.log"; }
# 1b, the trainer, compiled, activation checkpointing off and on, bf16 and fp8 (train.precision=fp8,
# tensorwise): speed, MFU, peak memory, and every step's loss of both over the same 50 steps
[[ ${3:-1b} == *1b* ]] && bench 1b 330 bench/bench_gpu.py --presets 1b --kinds trainer,trainer-fp8 --ac 0,1 --compile 1 --steps 50 --warmup 10
# 125m, document masking: FlexAttention (compiled) against the dense mask, and the trainer with it
[[ ${3:-125m_docmask} == *125m_docmask* ]] && bench 125m_docmask 130 bench/bench_gpu.py --presets 125m --kinds docmask-flex,docmask-dense,trainer-docmask --ac 0 --compile 1 --steps 20 --warmup 5
# sliding-window attention: one layer, FlexAttention's window block mask against full causal (SDPA's
# flash and FlexAttention's causal mask), forward + backward, bf16, at 4096 and 8192 tokens
[[ ${3:-window} == *window* ]] && bench window 90 bench/bench_window.py --seq-lens 4096,8192 --windows 1024
