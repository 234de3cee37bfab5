"""trainer.async_save (llmtrain/checkpoint_async.py) on one process with a real DDP engine (world 1) and a tiny Llama:
the step returns with the write in flight, the checkpoint appears only at finalisation, keep_last_k never removes
the newest complete checkpoint while another is in flight, what is written is the state at the save (not the
weights the next step makes), a failed background write leaves the previous checkpoint `latest`, and DeepSpeed is
refused by validation with the reason."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import llmtrain.checkpoint_async as checkpoint_async
from llmtrain.backends.base import OptimizerSpec
from llmtrain.backends.ddp import DDPBackend
from llmtrain.checkpoint import Checkpointer, find_resume_dir, is_complete
from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.distributed import DistContext
from llmtrain.validation import validate

CTX = DistContext(0, 0, 1, torch.device("cpu"))
OPTIM = OptimizerSpec(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0, schedule="constant",
                      min_lr_ratio=1.0, max_grad_norm=0.0, max_steps=10)


def engine():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return DDPBackend(CTX, "fp32").wrap(LlamaForCausalLM(config), OPTIM)


def train_step(policy) -> None:
    ids = torch.randint(0, 64, (2, 8))  # (B, T)
    policy.backward(policy.module(input_ids=ids, labels=ids).loss)
    policy.clip_or_fused_step()
    policy.step()


def save(checkpointer: Checkpointer, step: int, policy) -> None:
    state = {"step": step, "global_batch_size": 2, "skipped_steps": 0}
    checkpointer.save(step, {"policy": policy}, state, {}, "x: 1\n")


def names(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture
def held_writes(monkeypatch):
    """Background writes wait until the test sets the returned event: a write deterministically in flight."""
    release, real = threading.Event(), checkpoint_async.write_files

    def held(directory, staged):
        assert release.wait(60)
        real(directory, staged)

    monkeypatch.setattr(checkpoint_async, "write_files", held)
    return release


def test_a_save_in_flight_is_invisible_and_never_prunes_the_newest_complete_one(tmp_path, held_writes):
    policy = engine()
    checkpointer = Checkpointer(tmp_path, keep_last_k=1, ctx=CTX, async_save=True)
    train_step(policy)
    save(checkpointer, 1, policy)
    assert names(tmp_path) == [".tmp_step_1"] and checkpointer.pending.done.running()  # returned, write held
    held_writes.set()
    train_step(policy)
    expected = {k: v.clone() for k, v in policy.model.state_dict().items()}
    held_writes.clear()
    save(checkpointer, 2, policy)  # finalises step_1 first, then step 2 is in flight
    assert names(tmp_path) == [".tmp_step_2", "latest", "step_1"]
    assert find_resume_dir("auto", tmp_path).name == "step_1"
    train_step(policy)  # the weights move on while step 2's write waits: it must write the saved copy
    assert not torch.equal(policy.model.model.embed_tokens.weight, expected["model.embed_tokens.weight"])
    held_writes.set()
    assert checkpointer.finalize_pending().name == "step_2"
    assert names(tmp_path) == ["latest", "step_2"]  # keep_last_k=1: step_1 went only once step_2 was complete
    assert checkpointer.finalize_pending() is None  # nothing in flight: a no-op

    restored = engine()
    Checkpointer(tmp_path, keep_last_k=1, ctx=CTX).load(tmp_path / "checkpoints" / "step_2", {"policy": restored})
    for name, tensor in restored.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_a_failed_background_write_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    policy = engine()
    checkpointer = Checkpointer(tmp_path, keep_last_k=1, ctx=CTX, async_save=True)
    save(checkpointer, 1, policy)
    checkpointer.finalize_pending()

    def disk_full(directory, staged):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_async, "write_files", disk_full)
    save(checkpointer, 2, policy)
    with pytest.raises(RuntimeError, match="checkpoint step_2: its background write failed on rank 0") as error:
        checkpointer.finalize_pending()
    assert "No space left on device" in str(error.value)
    assert names(tmp_path) == [".tmp_step_2", "latest", "step_1"] and not is_complete(tmp_path / "checkpoints"
                                                                                             / ".tmp_step_2")
    assert find_resume_dir("auto", tmp_path).name == "step_1"


def test_the_synchronous_save_writes_the_same_files(tmp_path):
    policy = engine()
    Checkpointer(tmp_path / "sync", keep_last_k=1, ctx=CTX).save(1, {"policy": policy}, {"step": 1}, {}, "")
    background = Checkpointer(tmp_path / "async", keep_last_k=1, ctx=CTX, async_save=True)
    background.save(1, {"policy": policy}, {"step": 1}, {}, "")
    background.finalize_pending()
    files = {run: sorted(str(p.relative_to(tmp_path / run)) for p in (tmp_path / run).rglob("*") if p.is_file())
             for run in ("sync", "async")}
    assert files["sync"] == files["async"] and "checkpoints/step_1/engines/policy/optimizer.pt" in files["sync"]


def test_deepspeed_refuses_async_save_naming_why():
    cfg = compose_config(["recipe=sft_tiny", "backend=zero2", "trainer.async_save=true"])
    with pytest.raises(ConfigError) as error:
        validate(cfg, world_size=1)
    message = str(error.value)
    assert "trainer.async_save=true with backend=deepspeed: DeepSpeed 0.19.8 has no background writer" in message
    assert "trainer.async_save=false" in message and "ddp" in message and "fsdp2" in message
    validate(compose_config(["recipe=sft_tiny", "backend=fsdp2", "trainer.async_save=true"]), world_size=2)
