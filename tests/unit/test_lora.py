"""peft=lora on one process: config errors, step-0 equality with the base, what one step changes, the
trainable-count formula, the seeded adapters, and the two exports (adapter/ and merged hf/)."""

from __future__ import annotations

import pytest
import torch

from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.models.load import build_model
from llmtrain.models.lora import (
    LoraSettings,
    adapter_dir_for,
    adapter_formula,
    count_trainable,
    save_adapter_and_merged,
    unwrap_peft,
)
from llmtrain.validation import validate

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
LORA = LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules="all-linear", modules_to_save=None)


def build(tokenizer, lora=LORA, head="lm", seed=0, activation_checkpointing=False):
    return build_model(name_or_path=None, from_config=TINY, config_path=None, tokenizer=tokenizer,
                       attn_implementation="sdpa", dropout=0.0, activation_checkpointing=activation_checkpointing,
                       trust_remote_code=False, head=head, seed=seed, lora=lora)


def ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


# ---- config ----------------------------------------------------------------------------------------

def test_lora_group_composes_and_reaches_the_settings():
    cfg = compose_config(["recipe=sft_tiny", "peft=lora", "peft.r=16", "peft.target_modules=[q_proj,v_proj]"])
    validate(cfg, world_size=1)
    settings = LoraSettings.from_config(cfg.peft)
    assert settings == LoraSettings(r=16, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj"),
                                    modules_to_save=None)
    assert LoraSettings.from_config(compose_config(["recipe=sft_tiny"]).peft) is None


@pytest.mark.parametrize("overrides, message", [
    (["peft.r=0"], "peft.r=0 must be >= 1"),
    (["peft.alpha=0"], "peft.alpha=0.0 must be > 0"),
    (["peft.dropout=1.0"], "peft.dropout=1.0 must be in [0, 1)"),
    (["peft.target_modules=[lm_head]"], "peft.target_modules: lm_head is the output layer"),
    (["peft.target_modules=some"], "peft.target_modules='some' must be all-linear or a list"),
    (["backend=fsdp2_tp"], "peft=lora with backend.tp=2"),
    (["stage=dpo", "peft.dropout=0.1"], "the first ratio would not be 1. Set peft.dropout=0"),
])
def test_bad_lora_configs_name_the_field(overrides, message):
    cfg = compose_config(["recipe=sft_tiny", "peft=lora", *overrides])
    with pytest.raises(ConfigError, match="invalid config") as error:
        validate(cfg, world_size=2)
    assert message in str(error.value)


def test_qlora_needs_a_cuda_gpu_and_ddp():
    """peft.load_in_4bit=true is refused before any model loads where there is no CUDA device (this CPU machine; the
    CUDA path, NF4 + prepare_model_for_kbit_training, is not run here), and on any backend but ddp."""
    settings = LoraSettings.from_config(compose_config(["recipe=sft_tiny", "peft=lora", "peft.load_in_4bit=true"]).peft)
    assert settings.load_in_4bit
    cfg = compose_config(["recipe=sft_tiny", "peft=lora", "peft.load_in_4bit=true", "backend=fsdp2"])
    with pytest.raises(ConfigError) as error:
        validate(cfg, world_size=2)
    message = str(error.value)
    if not torch.cuda.is_available():
        assert "peft.load_in_4bit=true (QLoRA) needs a CUDA GPU and bitsandbytes" in message
    assert "peft.load_in_4bit=true runs on backend=ddp only (backend.name=fsdp2" in message
    assert "set model.name_or_path" in message  # sft_tiny is a random init: nothing to quantize


def test_target_or_saved_module_that_matches_nothing_names_the_field(tokenizer):
    with pytest.raises(ConfigError, match="peft.target_modules: qkv_proj match no linear layer"):
        build(tokenizer, LoraSettings(4, 8.0, 0.0, ("q_proj", "qkv_proj"), None))
    with pytest.raises(ConfigError, match="peft.modules_to_save: head is no module"):
        build(tokenizer, LoraSettings(4, 8.0, 0.0, "all-linear", ("head",)))


# ---- the model ---------------------------------------------------------------------------------------

def test_trainable_count_equals_the_formula_and_lm_head_is_not_adapted(tokenizer):
    model = build(tokenizer)
    trainable, total = count_trainable(model)
    formula, matrices = adapter_formula(model, r=4)
    # 2 layers × (q, k, v, o, gate, up, down); h 32, kv 16 (1 kv head of 16), intermediate 64
    per_layer = 4 * ((32 + 32) * 2 + (32 + 16) * 2 + (32 + 64) * 3)
    assert matrices == 14 and formula == trainable == 2 * per_layer
    assert not any("lm_head" in n for n, p in model.named_parameters() if p.requires_grad)
    assert total == trainable + sum(p.numel() for p in unwrap_peft(model).parameters() if not p.requires_grad)


def test_reward_head_is_trained_in_full_by_default(tokenizer):
    model = build(tokenizer, head="scalar")
    trainable, _ = count_trainable(model)
    formula, _ = adapter_formula(model, r=4)
    assert trainable == formula + 32  # score: 32 -> 1, no bias
    assert any(".modules_to_save." in n and p.requires_grad for n, p in model.named_parameters())


def test_step0_logits_equal_the_base_and_one_step_changes_only_adapters(tokenizer):
    base, model = build(tokenizer, lora=None), build(tokenizer)
    x = ids(len(tokenizer))
    with torch.no_grad():
        assert torch.equal(base(input_ids=x).logits, model(input_ids=x).logits)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model(input_ids=x, labels=x).loss
    assert torch.allclose(loss, base(input_ids=x, labels=x).loss, rtol=0, atol=0)  # step-0 loss: the base's
    loss.backward()
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert {n for n in changed if "lora_B" in n} == {n for n, p in model.named_parameters() if "lora_B" in n}


def test_adapters_are_a_function_of_the_seed_and_the_module_name(tokenizer):
    torch.manual_seed(1)
    a = build(tokenizer, seed=3)
    torch.manual_seed(2)  # another global RNG state: same adapters
    b = build(tokenizer, seed=3)
    c = build(tokenizer, seed=4)

    def lora_a(m):
        return {n: p for n, p in m.named_parameters() if "lora_A" in n}

    assert all(torch.equal(p, lora_a(b)[n]) for n, p in lora_a(a).items())
    assert not any(torch.equal(p, lora_a(c)[n]) for n, p in lora_a(a).items())
    assert all(torch.all(p == 0) for n, p in a.named_parameters() if "lora_B" in n)


def test_adapter_and_merged_exports_reproduce_the_adapted_logits(tokenizer, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = build(tokenizer)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # as after training: the merge must matter
    model.eval()
    save_adapter_and_merged(model, model.state_dict(), tmp_path / "hf", adapter_dir_for(tmp_path / "hf"))
    x = ids(len(tokenizer))
    with torch.no_grad():
        expected = model(input_ids=x).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
        torch.testing.assert_close(merged(input_ids=x).logits, expected, rtol=0, atol=1e-4)
        base = build(tokenizer, lora=None).eval()
        reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        torch.testing.assert_close(reloaded(input_ids=x).logits, expected, rtol=0, atol=1e-5)
    assert adapter_dir_for(tmp_path / "reward_hf").name == "reward_adapter"
    sharded = {**model.state_dict()}
    name = next(n for n in sharded if "lora_A" in n)
    sharded[name] = torch.empty(0)  # a ZeRO-3 partition saved without gathering
    with pytest.raises(RuntimeError, match=f"not whole matrices.*{name}"):
        save_adapter_and_merged(model, sharded, tmp_path / "hf2", tmp_path / "adapter2")


# ---- DPO's reference by adapter switch ---------------------------------------------------------------

def dpo_engines(tokenizer, lora):
    """A DPO stage's engines on one process (DDP backend, world 1), policy with `lora`."""
    from llmtrain.backends.base import OptimizerSpec
    from llmtrain.backends.ddp import DDPBackend
    from llmtrain.distributed import DistContext
    from llmtrain.roles import ModelOptions, build_engines
    from llmtrain.stages.base import ModelSource
    from llmtrain.stages.dpo import DPOStage

    stage = DPOStage(ModelSource(None, TINY), tokenizer.pad_token_id, beta=0.5, loss="sigmoid", label_smoothing=0.0)
    backend = DDPBackend(DistContext(0, 0, 1, torch.device("cpu")), "fp32")
    optim = OptimizerSpec(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0,
                          schedule="constant", min_lr_ratio=1.0, max_grad_norm=0.0, max_steps=2)
    engines = build_engines(stage.roles, backend, tokenizer, ModelOptions("sdpa", 0.0, False), 0, optim, lora=lora)
    return stage, engines


def pairs(tokenizer, stage, n=4):
    from llmtrain.losses.lm import IGNORE_INDEX

    g = torch.Generator().manual_seed(1)
    examples = []
    for _ in range(n):
        prompt, chosen, rejected = (torch.randint(3, 200, (k,), generator=g).tolist() for k in (5, 4, 6))
        for side, response in (("chosen", chosen), ("rejected", rejected)):
            examples.append({f"{side}_input_ids": prompt + response,
                             f"{side}_labels": [IGNORE_INDEX] * len(prompt) + response})
    merged = [{**examples[2 * i], **examples[2 * i + 1]} for i in range(n)]
    return stage.collate(merged)


def test_dpo_reference_is_the_policy_with_adapters_off(tokenizer):
    """peft=lora: the reference is the policy's own model (one copy of the base) run with adapters disabled; step 1's
    loss is exactly ln 2 (B = 0) with rewards 0, and after a step the reference's log-probs are still the base's
    while the policy's moved."""
    import math

    from llmtrain.backends.adapter_off import AdapterOffEngine
    from llmtrain.stages.base import Updater

    stage, engines = dpo_engines(tokenizer, LORA)
    policy, reference = engines["policy"], engines["reference"]
    assert isinstance(reference, AdapterOffEngine) and not reference.trainable
    assert reference.model is policy.model and reference.model_state_bytes() is None
    unique = {id(p): p.numel() for e in engines.values() for p in e.model.parameters()}
    assert sum(unique.values()) == count_trainable(policy.model)[1]  # every parameter once: no second base
    batch = pairs(tokenizer, stage)
    base = build(tokenizer, lora=None).eval()  # the same seed: the base the policy was built on
    with torch.no_grad():
        base_logps = stage.logps(base, batch)
    updater = Updater(torch.device("cpu"), skip_nonfinite=False)
    first = stage.train_step([batch], engines, updater)
    # ln 2 in fp32 and first["reward_chosen"] == 0
    assert first["loss"] == torch.tensor(math.log(2)).item() and first["reward_margin"] == 0
    assert all(p.requires_grad == ("lora_" in n) for n, p in policy.model.named_parameters())  # put back
    second = stage.train_step([batch], engines, updater)
    assert abs(second["loss"] - math.log(2)) > 1e-6 and second["reward_margin"] != 0
    with torch.no_grad():
        ref_logps, policy_logps = stage.reference_logps(reference, batch), stage.logps(policy.module, batch)
    for ours, expected in zip(ref_logps, base_logps):
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(policy_logps[0], base_logps[0])
    assert policy.model.training  # the view's forward put the policy's mode back


def test_without_lora_the_reference_is_a_frozen_copy(tokenizer):
    _, engines = dpo_engines(tokenizer, None)
    assert engines["reference"].model is not engines["policy"].model and not engines["reference"].trainable


def test_plan_counts_the_frozen_base_as_weights_only():
    """The dry-run plan under peft=lora: the adapters' count (the formula, from the architecture alone) with grads
    and Adam, the base as fp32 weights; DPO's reference holds nothing of its own."""
    from llmtrain.metrics.flops import human
    from llmtrain.plan.report import plan_run

    cfg = compose_config(["recipe=lora_sft_tiny"])
    plan = plan_run(cfg, 1, torch.device("cpu"), "fp32").text
    base = 539_008 - 77_824  # the run logs 77,824 trainable of 539,008 (the adapters come on top of the base)
    assert "LoRA: 77,824 trainable, the base as weights only" in plan
    assert f"≈ {human(16 * 77_824 + 4 * base, 'B', 1024)} per rank" in plan
    dpo = plan_run(compose_config(["recipe=lora_sft_tiny", "stage=dpo"]), 1, torch.device("cpu"), "fp32").text
    assert "reference (the policy with adapters disabled: no weights of its own)" in dpo


def test_activation_checkpointing_with_lora_gives_the_same_loss_and_adapter_gradients(tokenizer):
    """model.activation_checkpointing=true (transformers' non-reentrant checkpointing, set before peft wraps the
    model): the frozen embeddings' output needs no grad, the adapters still get theirs, equal to without it."""
    x = ids(len(tokenizer))
    results = []
    for checkpointing in (False, True):
        model = build(tokenizer, activation_checkpointing=checkpointing).train()
        assert unwrap_peft(model).is_gradient_checkpointing == checkpointing
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:  # B = 0 would leave A's gradient 0
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
        results.append((loss.detach(), grads))
    (loss, grads), (loss_ac, grads_ac) = results
    assert torch.equal(loss, loss_ac)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ac[name], grad, rtol=1e-5, atol=1e-7)
