# Sourced by the launchers: NPROC (processes on this node) and OMP_NUM_THREADS defaults.
# NPROC defaults to the GPUs this job may use (CUDA_VISIBLE_DEVICES when set — nvidia-smi lists every
# GPU on the node — else nvidia-smi), or 2 on a machine without GPUs (CPU processes, gloo).
# deepspeed.sh passes nvidia_smi_only: its launcher ignores CUDA_VISIBLE_DEVICES once --num_gpus is given.
gpu_count() {
  local n=0
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" && "${1:-}" != nvidia_smi_only ]]; then
    n=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .) || n=0
  elif command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l) || n=0
  fi
  echo "$n"
}

if [[ -z "${NPROC:-}" ]]; then
  NPROC=$(gpu_count "${NPROC_SOURCE:-}")
  if [[ "$NPROC" -eq 0 ]]; then NPROC=2; fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
