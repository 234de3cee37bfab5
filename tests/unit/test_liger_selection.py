"""model.fused_loss=liger|auto (models/liger.py), on the CPU: what `auto` picks on each device, layout and stage, and
an explicit `liger` that cannot run refused by validation (before any model loads) with lines naming the field and
the fix. Liger's numbers against the chunked path need a GPU: tests/gpu/test_liger.py."""

from __future__ import annotations

import pytest
import torch

from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.models.fused_head import HeadQuery, negative_log_likelihood
from llmtrain.models.fused_head import liger_computes as computes
from llmtrain.models.liger import head_kernel, liger_installed
from llmtrain.models.vocab_parallel import VocabShard
from llmtrain.validation import config_problems, validate


@pytest.mark.parametrize("fused_loss,device,tp,stage,lm_sum,installed,kernel,why", [
    ("auto", "cuda", 1, "sft", True, True, "liger", "Liger Kernel on CUDA"),
    ("auto", "cpu", 1, "sft", True, True, "chunked", "CUDA GPUs only, this run's device is cpu"),
    ("auto", "cuda", 1, "sft", True, False, "chunked", "liger_kernel is not installed"),
    ("auto", "cuda", 2, "sft", True, True, "chunked", "backend.tp=2 splits the LM head"),
    ("auto", "cuda", 1, "dpo", False, True, "chunked", "stage dpo trains on per-token log-probs"),
    ("chunked", "cuda", 1, "sft", True, True, "chunked", "model.fused_loss=chunked"),
    ("liger", "cuda", 1, "sft", True, True, "liger", "model.fused_loss=liger"),
    ("off", "cuda", 1, "sft", True, True, None, "full (tokens, V) logits"),
])
def test_auto_picks_liger_only_where_it_computes_the_loss(fused_loss, device, tp, stage, lm_sum, installed, kernel,
                                                          why):
    chosen, reason = head_kernel(fused_loss, device, tp, stage, lm_sum, installed)
    assert chosen == kernel and why in reason, (chosen, reason)


def test_the_head_sends_only_the_causal_lm_sum_to_liger():
    """Eval's per-token values, RL's token losses, a temperature, entropy and a vocab-sharded head stay chunked."""
    targets = torch.zeros(2, 3, dtype=torch.long)
    assert computes(HeadQuery(targets, token_loss=negative_log_likelihood), None)
    assert not computes(HeadQuery(targets, accuracy=True), None)  # eval
    assert not computes(HeadQuery(targets, token_loss=lambda rows, logp, entropy: logp.sum()), None)  # PPO's
    assert not computes(HeadQuery(targets, temperature=0.7, token_loss=negative_log_likelihood), None)
    assert not computes(HeadQuery(targets, entropy=True, token_loss=negative_log_likelihood), None)
    assert not computes(HeadQuery(targets, token_loss=negative_log_likelihood), VocabShard(0, 5, 10))


@pytest.mark.parametrize("overrides,world,needles", [
    (["recipe=sft_tiny"], 1, ["model.fused_loss=liger: Liger Kernel runs on CUDA GPUs only, this run's device is cpu",
                              "set model.fused_loss=chunked"]),
    (["recipe=dpo_tiny"], 1, ["stage dpo trains on per-token log-probs", "set model.fused_loss=chunked (or auto)"]),
    (["recipe=sft_tiny", "backend=fsdp2_tp", "trainer.global_batch_size=32"], 2,
     ["backend.tp=2 splits the LM head over the vocabulary", "set model.fused_loss=chunked", "or backend.tp=1"]),
])
def test_an_explicit_liger_that_cannot_run_is_refused_by_validation(overrides, world, needles):
    with pytest.raises(ConfigError) as refused:
        validate(compose_config([*overrides, "model.fused_loss=liger", "device=cpu"]), world)
    for needle in needles:
        assert needle in str(refused.value), (needle, str(refused.value))


def test_auto_and_chunked_pass_validation_on_the_cpu():
    """auto and chunked leave validation nothing to say on the CPU and both run the chunked head there, where the
    same config with an explicit liger is refused (the check ran on this config)."""
    for choice in ("auto", "chunked"):
        cfg = compose_config(["recipe=sft_tiny", f"model.fused_loss={choice}", "device=cpu"])
        assert cfg.model.fused_loss == choice and config_problems(cfg, 1) == []
        assert head_kernel(choice, "cpu", 1, cfg.stage.name, True, liger_installed())[0] == "chunked"
    liger = compose_config(["recipe=sft_tiny", "model.fused_loss=liger", "device=cpu"])
    assert any("model.fused_loss=liger" in problem for problem in config_problems(liger, 1))


@pytest.mark.parametrize("preset,fused", [("llama-2-7b", True), ("llama-3.1-8b", True), ("qwen3-8b", True),
                                          ("qwen3-30b-a3b", True), ("tiny", False)])
def test_auto_fuses_the_head_where_the_logits_outweigh_two_layers(preset, fused):
    """auto keeps full logits where 12·V bytes a token weigh less than two layers' 2 × 34·h (the tiny recipes' V 263
    at h 128: 3.2 KB against 8.7 KB) and fuses the shipped presets' heads (Llama 2's 32,000 at h 4,096: 384 KB
    against 279 KB); chunked and liger always fuse, off never does."""
    import json

    from llmtrain.models.fused_head import head_is_fused
    from tests.helpers import REPO

    if preset == "tiny":
        cfg = compose_config(["recipe=sft_tiny"])
        vocab, hidden = 263, cfg.model.from_config.hidden_size
    else:
        arch = json.loads((REPO / "llmtrain" / "assets" / "configs" / preset / "config.json").read_text())
        vocab, hidden = arch["vocab_size"], arch["hidden_size"]
    assert head_is_fused("auto", vocab, hidden) is fused
    assert head_is_fused("chunked", vocab, hidden) and head_is_fused("liger", vocab, hidden)
    assert not head_is_fused("off", vocab, hidden)
