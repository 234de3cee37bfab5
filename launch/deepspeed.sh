#!/usr/bin/env bash
# Single-node training under the DeepSpeed launcher:
#   launch/deepspeed.sh recipe=sft_7b backend=NAME      # NAME: a file in conf/backend/
# NPROC defaults to the GPUs nvidia-smi lists, or 2 without any. The launcher ignores CUDA_VISIBLE_DEVICES
# once --num_gpus is given: to pick GPUs, call `deepspeed --include localhost:0,1 --module llmtrain ...` directly.
# The --local_rank=N argument the launcher appends is dropped by llmtrain's entry point. resume=auto is added
# unless you pass resume=... (see _resume.sh); the deepspeed launcher does not restart failed ranks.
set -euo pipefail

NPROC_SOURCE=nvidia_smi_only
# shellcheck source=launch/_nproc.sh
source "$(dirname "${BASH_SOURCE[0]}")/_nproc.sh"
# shellcheck source=launch/_resume.sh
source "$(dirname "${BASH_SOURCE[0]}")/_resume.sh"

exec deepspeed --num_gpus "$NPROC" --module llmtrain "$@" "${RESUME_ARGS[@]}"
