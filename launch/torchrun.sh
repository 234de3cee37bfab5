#!/usr/bin/env bash
# Single-node training, one process per GPU:
#   launch/torchrun.sh recipe=sft_tiny trainer.max_steps=100
#   NPROC=4 launch/torchrun.sh recipe=sft_7b backend=ddp
# NPROC defaults to the visible GPUs (CUDA_VISIBLE_DEVICES, else nvidia-smi), or 2 without any (CPU, gloo).
# Run from the repo root or with llmtrain installed, so that `-m llmtrain` imports.
set -euo pipefail

gpu_count() {
  local n=0
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    # nvidia-smi lists every GPU on the node, not only the ones this job may use.
    n=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .) || n=0
  elif command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l) || n=0
  fi
  echo "$n"
}

if [[ -z "${NPROC:-}" ]]; then
  NPROC=$(gpu_count)
  if [[ "$NPROC" -eq 0 ]]; then NPROC=2; fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

exec torchrun --standalone --nproc_per_node "$NPROC" -m llmtrain "$@"
