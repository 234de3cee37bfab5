#!/usr/bin/env bash
# Single-node training under the DeepSpeed launcher:
#   launch/deepspeed.sh recipe=sft_7b backend=NAME      # NAME: a file in conf/backend/
# NPROC defaults to the GPUs nvidia-smi lists, or 2 without any. The launcher ignores CUDA_VISIBLE_DEVICES
# once --num_gpus is given: to pick GPUs, call `deepspeed --include localhost:0,1 --module llmtrain ...` directly.
# The --local_rank=N argument the launcher appends is dropped by llmtrain's entry point.
set -euo pipefail

gpu_count() {
  local n=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l) || n=0
  fi
  echo "$n"
}

if [[ -z "${NPROC:-}" ]]; then
  NPROC=$(gpu_count)
  if [[ "$NPROC" -eq 0 ]]; then NPROC=2; fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

exec deepspeed --num_gpus "$NPROC" --module llmtrain "$@"
