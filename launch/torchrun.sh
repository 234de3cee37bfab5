#!/usr/bin/env bash
# Training under torchrun, one process per GPU, restarted from the newest checkpoint when a rank dies:
#   launch/torchrun.sh recipe=sft_tiny trainer.max_steps=100
#   NPROC=4 launch/torchrun.sh recipe=sft_7b backend=ddp trainer.save_every_n_steps=200
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 launch/torchrun.sh recipe=sft_7b   # on every node
# NPROC defaults to the visible GPUs (CUDA_VISIBLE_DEVICES, else nvidia-smi), or 2 without any (CPU, gloo).
# MAX_RESTARTS (default 3): how often torchrun restarts every rank after a failure; each restart resumes
# (resume=auto is added unless you pass resume=...). SHUTDOWN_TIMEOUT (default 120 s): how long a rank may take
# to save after SIGTERM/SIGUSR1 before torchrun kills it. See launch/README.md.
# Run from the repo root or with llmtrain installed, so that `-m llmtrain` imports.
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=launch/_nproc.sh
source "$here/_nproc.sh"
# shellcheck source=launch/_resume.sh
source "$here/_resume.sh"

NNODES="${NNODES:-1}"
args=(--nproc_per_node "$NPROC" --max-restarts "${MAX_RESTARTS:-3}"
      --signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" --shutdown-timeout "${SHUTDOWN_TIMEOUT:-120}")
if [[ "$NNODES" -gt 1 ]]; then
  : "${MASTER_ADDR:?NNODES=$NNODES needs MASTER_ADDR (the host of node 0) on every node}"
  # c10d rendezvous: node ranks come from the order of arrival (NODE_RANK is only echoed); every node runs this.
  # A fresh bootstrap store per restart round: torchrun's shared store keeps the previous round's keys.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
  args+=(--nnodes "$NNODES" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"
         --rdzv_id "${RDZV_ID:-llmtrain}")
  echo "llmtrain: node ${NODE_RANK:-?} of $NNODES x $NPROC processes, rendezvous $MASTER_ADDR:${MASTER_PORT:-29500}" >&2
else
  args+=(--standalone)
fi

exec torchrun "${args[@]}" -m llmtrain "$@" "${RESUME_ARGS[@]}"
