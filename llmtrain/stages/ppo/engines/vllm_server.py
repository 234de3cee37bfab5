"""A vLLM server that llmtrain starts itself (`ppo.rollout.vllm.python`): its own environment's interpreter, on
127.0.0.1 with a free port, its log in the run directory, stopped at the end of the run and on every failure.

The settings are llmtrain's, never vLLM's defaults: `--dtype` from the run's precision (vLLM's `auto` would turn an
fp32 checkpoint into bf16), `--generation-config vllm` (its `auto` applies the checkpoint's generation_config.json),
`--logprobs-mode processed_logprobs` (the default returns log-probs before temperature), and
`--skip-tokenizer-init --enable-scale-out` (prompts arrive as token ids on /inference/v1/generate). Dev mode
(VLLM_SERVER_DEV_MODE=1) opens the pause / reload / weight-version endpoints the weight sync uses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmtrain.distributed import free_port
from llmtrain.stages.ppo.engines.http import EngineError, reachable

log = logging.getLogger(__name__)
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ServerSettings:
    python: str  # the engine environment's interpreter
    precision: str  # the run's resolved precision: fp32 | bf16 | fp16
    max_model_len: int  # prompt + response tokens (data.max_seq_len)
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE in whole GiB (CPU engines)
    gpu_memory_utilization: float = 0.9
    start_timeout_s: float = 600.0
    args: tuple[str, ...] = field(default_factory=tuple)  # passed through (--tensor-parallel-size 2, ...)


def server_command(settings: ServerSettings, model_dir: Path, port: int, gpu: bool) -> list[str]:
    command = [settings.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", VLLM_DTYPES[settings.precision],
               "--max-model-len", str(settings.max_model_len), "--generation-config", "vllm",
               "--logprobs-mode", "processed_logprobs", "--skip-tokenizer-init", "--enable-scale-out",
               "--seed", "0"]
    if gpu:
        command += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    else:
        command += ["--enforce-eager"]  # the CPU engine starts in ~25 s with it, ~80 s without
    return command + list(settings.args)


class VLLMServer:
    """One server process (its own process group, so stopping it stops its engine core too)."""

    def __init__(self, settings: ServerSettings, model_dir: Path, log_path: Path, gpu: bool):
        if not Path(settings.python).is_file():
            raise EngineError(f"ppo.rollout.vllm.python={settings.python}: no such interpreter; build the engine "
                              "environment with `bash launch/vllm_env.sh` (it prints the path to set)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        environment = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_SERVER_DEV_MODE": "1",
                       "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib), "PYTHONPATH": ""}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        command = server_command(settings, model_dir, self.port, gpu)
        log.info("starting the vLLM server: %s (log: %s)", " ".join(command), log_path)
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=environment,
                                        start_new_session=True)
        try:
            self._wait_healthy(settings.start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise EngineError(f"the vLLM server exited with code {self.process.returncode} before it was healthy; "
                                  f"its log: {self.log_path}\n{self.log_tail()}")
            if reachable(self.url):
                log.info("vLLM server healthy at %s after %.0f s", self.url, time.monotonic() - start)
                return
            time.sleep(1.0)
        raise EngineError(f"the vLLM server at {self.url} was not healthy after {timeout_s:.0f} s "
                          f"(ppo.rollout.vllm.start_timeout_s); its log: {self.log_path}\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self._log.close()

