#!/usr/bin/env bash
# Single-node training, one process per GPU:
#   launch/torchrun.sh recipe=sft_tiny trainer.max_steps=100
#   NPROC=4 launch/torchrun.sh recipe=sft_7b backend=ddp
# NPROC defaults to the visible GPUs (CUDA_VISIBLE_DEVICES, else nvidia-smi), or 2 without any (CPU, gloo).
# Run from the repo root or with llmtrain installed, so that `-m llmtrain` imports.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_nproc.sh"

exec torchrun --standalone --nproc_per_node "$NPROC" -m llmtrain "$@"
