"""The planner (llmtrain/plan.py, llmtrain/metrics/cost.py) against hand computations: the ZeRO paper's seed
figures, what each backend holds, activations, communication, FLOPs and MFU, the fit verdict and micro-batch
search, the device table, and the command on the shipped sft_7b recipe (meta device, no weights)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from llmtrain.backends import BACKENDS, compared_presets
from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.metrics.cost import (
    GB,
    GIB,
    Layout,
    RoleParams,
    activation_bytes,
    activation_bytes_per_layer,
    communication,
    logits_bytes,
    state_bytes,
)
from llmtrain.metrics.devices import GPUS, resolve_gpu
from llmtrain.models.facts import ModelFacts, model_facts
from llmtrain.plan.core import layout_of, longest_sequence, plan_row, step_flops
from llmtrain.plan.report import plan_text
from llmtrain.plan.setting import Setting
from llmtrain.plan.setting import setting as plan_setting
from tests.helpers import REPO, cli_env

COMPARED = compared_presets()
SFT_7B_8XH100 = ["recipe=sft_7b", "plan.world_size=8", "plan.gpu=h100-80gb"]


def facts(params: int, *, layers: int = 24, hidden: int = 1024, heads: int = 16, vocab: int = 50_000) -> ModelFacts:
    """Hand-made counts (no model): one block = 12h², the rest embedding and head."""
    block = 12 * hidden * hidden
    return ModelFacts(label="hand", params=params, numels=(params,), layers=layers, hidden=hidden, heads=heads,
                      kv_heads=heads, vocab=vocab, intermediate=4 * hidden, block=block, embed=vocab * hidden,
                      head=0, tp_params=0, model_type="llama")


def setting(f: ModelFacts, *, world: int, micro: int = 1, accum: int = 1, seq: int = 1024, precision: str = "bf16",
            gpu: str = "h100-80gb", roles: dict | None = None, checkpointing: bool = False) -> Setting:
    return Setting(facts=f, roles=roles or {"policy": True}, lora=0, views=frozenset(), precision=precision,
                   gpu=GPUS[gpu], world=world,
                   micro=micro, accum=accum, seq=seq, rows_per_sample=1, checkpointing=checkpointing, scores=False,
                   mfu=0.4, logits_vocab=f.vocab)


def zero(stage: int, dp: int, **kw) -> Layout:
    return Layout(name=f"zero{stage}", backend=BACKENDS["deepspeed"], stage=stage, dp=dp, **kw)


DDP = {"name": "ddp", "backend": BACKENDS["ddp"], "stage": 0}


# ---- model states -------------------------------------------------------------------------------

def test_the_zero_papers_seed_figures():
    """7.5B parameters, N = 64, mixed-precision Adam: 120 / 31.4 / 16.6 / 1.9 GB per GPU (GB = 1e9 bytes)."""
    f = facts(7_500_000_000)
    layouts = [Layout(dp=64, **DDP), zero(1, 64), zero(2, 64), zero(3, 64)]
    rows = [plan_row(setting(f, world=64), layout) for layout in layouts]
    assert [round(r.textbook / GB, 1) for r in rows] == [120.0, 31.4, 16.6, 1.9]


def test_what_deepspeed_holds_in_fp32_hand_computed():
    """M = 1000, N = 4, fp32: DeepSpeed keeps an fp32 master partition (4M/N) even though the weights are fp32;
    ZeRO-3 keeps P = 100 persistent parameters whole; accumulation makes ZeRO-1's gradients whole."""
    r = RoleParams(trainable=1000, persistent=100, working=300)
    z1 = state_bytes(r, zero(1, 4), "fp32", grad_accum_steps=2)
    assert (z1.weights, z1.master, z1.grads, z1.optim, z1.gathered) == (4000, 1000, 4000, 2000, 0)
    assert state_bytes(r, zero(1, 4), "fp32", grad_accum_steps=1).grads == 1000
    z2 = state_bytes(r, zero(2, 4), "fp32", grad_accum_steps=2)
    assert (z2.weights, z2.master, z2.grads, z2.optim) == (4000, 1000, 1000, 2000)
    z3 = state_bytes(r, zero(3, 4), "fp32")
    assert (z3.weights, z3.master, z3.grads, z3.optim, z3.gathered) == (4 * (250 + 100), 1000, 1000, 2000, 1200)
    z0 = state_bytes(r, zero(0, 4), "fp32")
    assert (z0.weights, z0.master, z0.grads, z0.optim) == (4000, 0, 4000, 8000)  # our AdamW unwrapped: no master


def test_what_each_backend_holds_under_bf16_hand_computed():
    r = RoleParams(trainable=1000, working=300)
    ddp = state_bytes(r, Layout(dp=4, **DDP), "bf16")  # fp32 weights + autocast's cached bf16 copy
    assert (ddp.weights, ddp.grads, ddp.optim, ddp.gathered) == (4000, 4000, 8000, 2000)
    z0 = state_bytes(r, zero(0, 4), "bf16")  # bf16 weights and grads, whole fp32 master
    assert (z0.weights, z0.master, z0.grads, z0.optim) == (2000, 4000, 2000, 8000)
    z1 = state_bytes(r, zero(1, 4), "bf16")  # BF16_Optimizer: one whole fp32 gradient buffer
    assert (z1.weights, z1.master, z1.grads, z1.optim) == (2000, 1000, 4000, 2000)
    z3 = state_bytes(r, zero(3, 4), "bf16")  # 2M/N + 4M/N + 4M/N + 8M/N = 18M/N, not the textbook 16M/N
    assert z3.held - z3.gathered == 18 * 1000 / 4
    fsdp = state_bytes(r, Layout(name="fsdp2", backend=BACKENDS["fsdp2"], stage=3, dp=4), "bf16")
    assert (fsdp.weights, fsdp.master, fsdp.grads, fsdp.optim, fsdp.gathered) == (1000, 0, 1000, 2000, 600)
    accum = state_bytes(r, Layout(name="fsdp2", backend=BACKENDS["fsdp2"], stage=3, dp=4), "bf16", grad_accum_steps=2)
    assert (accum.grads, accum.gathered) == (4000, 2000)  # no_sync keeps gradients and weights unsharded


def test_offload_frozen_roles_and_lora():
    r = RoleParams(trainable=1000, working=300)
    off = state_bytes(r, zero(3, 4, offload_optimizer="cpu", offload_param="nvme"), "fp32")
    assert (off.host, off.nvme) == (1000 + 2000 + 1000, 1000)  # master + Adam + grads on the host, weights on NVMe
    assert off.device == off.held - 5000
    frozen = RoleParams(trainable=0, frozen=1000, working=300)
    assert state_bytes(frozen, zero(3, 4), "bf16").held == 2 * 1000 / 4 + 2 * 300  # compute dtype, sharded
    assert state_bytes(frozen, zero(2, 4), "bf16").held == 2000
    assert state_bytes(frozen, Layout(dp=4, **DDP), "bf16").held == 4000  # DDP keeps a frozen role in fp32
    lora = state_bytes(RoleParams(trainable=10, frozen=1000), Layout(dp=4, **DDP), "fp32")
    assert (lora.weights, lora.grads, lora.optim) == (4 * 1010, 40, 80)  # the base: weights only


# ---- activations, logits, FLOPs -----------------------------------------------------------------

def test_activations_and_logits_by_hand():
    b, s, h, a, layers = 2, 1024, 1024, 16, 24
    assert activation_bytes_per_layer(b, s, h, a) == 34 * b * s * h + 5 * b * a * s * s
    assert activation_bytes_per_layer(b, s, h, a, scores=False) == 34 * b * s * h  # sdpa/flash: no scores kept
    assert activation_bytes_per_layer(b, s, h, a, tp=2, scores=False) == b * s * h * (10 + 12)
    full = activation_bytes(b, s, h, a, layers, checkpointing=False)
    recompute = activation_bytes(b, s, h, a, layers, checkpointing=True)
    assert full == layers * (34 * b * s * h + 5 * b * a * s * s) + 2 * s * b * h
    assert recompute == layers * 2 * s * b * h + (34 * b * s * h + 5 * b * a * s * s) + 2 * s * b * h
    assert logits_bytes(b, s, 32_000) == b * s * 32_000 * 4



GEMMA2 = "{model_type:gemma2,hidden_size:64,intermediate_size:128,num_hidden_layers:2,num_attention_heads:4," \
         "num_key_value_heads:2,head_dim:16}"


def test_eager_attention_scores_by_hand_and_when_the_resolved_attention_is_eager():
    """Eager attention keeps per block the fp32 softmax output, in 16-bit the copy scores·V saves, with softcapping
    tanh's output: b·a·s²·(4 + w' + w_c) bytes; k and v repeated to every head, no logsumexp. The planner counts it
    when the run resolves to eager: `auto` on Gemma-2 (no sdpa in transformers) on the CPU, not on a Llama."""
    from llmtrain.metrics.cost import eager_score_bytes, gated_activation_bytes_per_layer
    from llmtrain.models.facts import model_facts
    from llmtrain.plan.setting import planned_attention
    from llmtrain.plan.setting import setting as plan_setting

    b, s, h, a, kv, i = 2, 512, 256, 8, 2, 512
    assert (eager_score_bytes(4), eager_score_bytes(2), eager_score_bytes(2, True), eager_score_bytes(4, True)) == \
        (4, 6, 8, 8)
    sdpa = gated_activation_bytes_per_layer(b, s, h, a, intermediate=i, kv_heads=kv, elem=2, scores=False)
    assert sdpa == s * b * (8 * h + 2 * kv * (h // a) + 4 * i + a + 2) * 2
    eager = gated_activation_bytes_per_layer(b, s, h, a, intermediate=i, kv_heads=kv, elem=2, scores=True,
                                             softcapping=True)
    assert eager == s * b * (10 * h + 4 * i + 2) * 2 + b * a * s * s * (4 + 2 + 2)
    fp32 = gated_activation_bytes_per_layer(b, s, h, a, intermediate=i, kv_heads=kv, elem=4, scores=True)
    assert fp32 == s * b * (10 * h + 4 * i + 2) * 4 + b * a * s * s * 4
    layers, micro, seq = 2, 3, 64
    for family, eager_expected in ((GEMMA2, True), (None, False)):
        overrides = ["recipe=sft_tiny", f"trainer.micro_batch_size={micro}", f"data.max_seq_len={seq}"]
        if family:
            overrides += ["model.name_or_path=null", f"model.from_config={family}"]
        cfg = compose_config(overrides)
        f = model_facts(cfg)
        cpu = resolve_gpu(cfg.plan, "cpu")
        assert (planned_attention(cfg, cpu, "fp32", f) == "eager") is eager_expected
        st = plan_setting(cfg, 1, cpu, "fp32", f)
        assert st.scores is eager_expected and f.softcapping is eager_expected  # Gemma-2: attn_logit_softcapping 50
        row = plan_row(st, Layout(dp=1, **DDP))
        scores = layers * micro * f.heads * seq * seq * (8 if eager_expected else 0)  # fp32: softmax + tanh
        kv = (f.heads if eager_expected else f.kv_heads) * (f.hidden // f.heads)
        per_token = 8 * f.hidden + 2 * kv + 4 * f.intermediate + (0 if eager_expected else f.heads) + 2
        outside = seq * micro * (3 * f.hidden + 1) * 4
        assert row.activations == layers * seq * micro * per_token * 4 + scores + outside
    cfg = compose_config(["recipe=sft_tiny", "model.name_or_path=null", f"model.from_config={GEMMA2}"])
    h100 = resolve_gpu(compose_config(["recipe=sft_tiny", "plan.gpu=h100-80gb"]).plan)
    assert planned_attention(cfg, h100, "bf16", model_facts(cfg)) != "eager"  # flash / flex: Gemma-2 has both


def test_eager_attention_term_matches_the_saved_tensors_of_a_forward():
    """The planner's eager-minus-sdpa difference on a tiny Llama (fp32: exact), and softcapping's tanh on a tiny
    Gemma-2 (its eager attention with and without attn_logit_softcapping), against saved-tensor hooks."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.metrics.cost import gated_activation_bytes_per_layer
    from llmtrain.metrics.live import SavedTensorMeter

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=100)
    b, s = 2, 64

    def saved(model_type: str, attn: str, autocast: bool = False, **fields) -> int:
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **sizes, **fields)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).train()
        meter = SavedTensorMeter([model.model])
        with meter.watch(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model.model(input_ids=torch.randint(0, 100, (b, s)))
        return meter.peak

    def planned(elem: int, scores: bool, softcapping: bool = False) -> float:
        return 2 * gated_activation_bytes_per_layer(b, s, 64, 4, intermediate=128, kv_heads=2, elem=elem,
                                                    scores=scores, softcapping=softcapping)

    assert saved("llama", "eager") - saved("llama", "sdpa") == planned(4, True) - planned(4, False)
    measured = saved("llama", "eager", True) - saved("llama", "sdpa", True)
    assert measured == pytest.approx(planned(2, True) - planned(2, False), rel=0.01)  # logsumexp in fp32
    for autocast, elem in ((False, 4), (True, 2)):
        softcap = saved("gemma2", "eager", autocast) - saved("gemma2", "eager", autocast, attn_logit_softcapping=None)
        assert softcap == planned(elem, True, True) - planned(elem, True)

def test_flops_and_the_34_percent_mfu_example():
    """docs/formulas.md: L=24, h=1024, s=1024, b=48 per device, accumulation 2, DP 4 (RTX 4090, 165 TFLOP/s):
    103.9 TFLOP per device per micro-step, 831 TFLOP per step, 0.27 steps/s -> MFU ≈ 34 %."""
    layers, h, s = 24, 1024, 1024
    f = dataclasses.replace(facts(12 * layers * h * h, layers=layers, hidden=h), vocab=0)
    st = setting(f, world=4, micro=48, accum=2, seq=s, gpu="rtx-4090")
    model, hardware = step_flops(st, Layout(dp=4, **DDP))
    assert round(model / 4 / 2 / 1e12, 1) == 103.9 and round(model / 1e12) == 831 and hardware == model
    assert round(model * 0.27 / (4 * 165e12), 2) == 0.34
    _, recomputed = step_flops(dataclasses.replace(st, checkpointing=True), Layout(dp=4, **DDP))
    assert recomputed == pytest.approx(model + 48 * 2 * 4 * s * layers * (2 * f.block + 4 * h * s))


# ---- communication ------------------------------------------------------------------------------

def test_communication_per_step_against_the_formulas():
    """Ring bytes per rank: DDP and ZeRO-1/2 2Ψ, ZeRO-3 3Ψ (elements × bytes × (N-1)/N); TP 4 all-reduces a block."""
    m, n = 1000, 8
    ring = (n - 1) / n

    def wire(layout, precision="fp32", **kw):
        args = dict(accum=1, tokens_per_micro=64, hidden=16, layers=2, checkpointing=False) | kw
        return sum(c.wire for c in communication(RoleParams(trainable=m), layout, precision, **args))

    assert wire(Layout(dp=n, **DDP)) == pytest.approx(2 * m * 4 * ring)
    assert wire(zero(1, n)) == pytest.approx(2 * m * 4 * ring) == wire(zero(2, n))
    assert wire(zero(3, n)) == pytest.approx(3 * m * 4 * ring)
    assert wire(zero(2, n), accum=4) == pytest.approx(5 * m * 4 * ring)  # ZeRO-2 reduces every micro-batch
    assert wire(zero(3, n), "bf16") == pytest.approx((2 + 2 + 4) * m * ring)  # bf16 gathers, fp32 gradients
    tp = Layout(name="fsdp2_tp", backend=BACKENDS["fsdp2"], stage=3, dp=1, tp=2)
    assert wire(tp, "bf16") == pytest.approx(4 * 2 * 2 * 64 * 16 * 2 * (2 - 1) / 2)  # 4 per block, L=2


# ---- verdict, micro-batch search, devices, the command -------------------------------------------

def test_a_7b_does_not_fit_ddp_on_a_4090_and_the_search_finds_the_edge():
    f = facts(7_000_000_000, layers=32, hidden=4096, heads=32, vocab=32_000)
    row = plan_row(setting(f, world=8, micro=1, gpu="rtx-4090"), Layout(dp=8, **DDP))
    assert not row.fits and row.max_micro == 0 and row.device_bytes > 16 * 7e9
    st = setting(f, world=8, micro=1, seq=2048, checkpointing=True)
    best = plan_row(st, zero(3, 8)).max_micro
    usable = GPUS["h100-80gb"].memory_gib * GIB * 0.92
    assert best > 1
    assert plan_row(dataclasses.replace(st, micro=best), zero(3, 8)).device_bytes <= usable
    assert plan_row(dataclasses.replace(st, micro=best + 1), zero(3, 8)).device_bytes > usable


def test_unknown_gpu_names_the_known_ones_and_custom_devices_work():
    plan = compose_config(["recipe=sft_tiny", "plan.gpu=b300"]).plan
    with pytest.raises(ConfigError, match=r"plan.gpu='b300' is not a known device \(a100-40gb, a100-80gb, h100-80gb, "
                                          r"h200, rtx-4090, cpu\).*plan.peak_tflops"):
        resolve_gpu(plan)
    custom = resolve_gpu(compose_config(["recipe=sft_tiny", "plan.gpu=b300", "plan.peak_tflops=2250",
                                         "plan.memory_gb=270"]).plan)
    assert (custom.peak_tflops, custom.memory_gib) == (2250, 270)
    assert resolve_gpu(compose_config(["recipe=sft_tiny", "plan.gpu=H200"]).plan).memory_gib == 140.4


def test_compare_backends_on_sft_7b_has_one_row_and_a_verdict_per_backend():
    text = plan_text(compose_config([*SFT_7B_8XH100, "plan.compare_backends=true"]))
    table = [line.split()[0] for line in text.splitlines() if line.split() and line.split()[0] in COMPARED]
    assert table == list(COMPARED)  # fsdp2_tp too: tp=2 divides Llama-2's 32 heads and 11008
    for name in COMPARED:
        assert sum(line.startswith(f"{name}: fits") or line.startswith(f"{name}: does NOT fit")
                   for line in text.splitlines()) == 1, name
    assert "parameters 6,738,415,616 (exact" in text and "ddp: does NOT fit" in text and "zero3: fits" in text
    readme = (REPO / "README.md").read_text().split("## Plan before you run", 1)[1].split("## ", 1)[0]
    assert [line.split() for line in readme.splitlines() if line.split()[:1] and line.split()[0] in COMPARED] == \
        [line.split() for line in text.splitlines() if line.startswith(" ") and line.split()[0] in COMPARED]
    alone = plan_text(compose_config([*SFT_7B_8XH100, "plan.world_size=1", "plan.compare_backends=true"]))
    assert "fsdp2_tp: left out" in alone  # tp=2 cannot fit one rank


def test_the_command_runs_in_seconds_without_weights():
    result = subprocess.run([sys.executable, "-m", "llmtrain.plan", *SFT_7B_8XH100, "backend=zero3"], cwd=REPO,
                            env=cli_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "zero3: fits at micro-batch 4" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "llmtrain.plan", "recipe=sft_tiny", "plan.gpu=nope"], cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "plan.gpu='nope'" in bad.stderr


def test_a_ppo_iteration_by_hand():
    """ppo_tiny's shape on dp 2: 64 sequences, mini-batches of 16, 2 epochs, micro 16 -> 8 updates of 1 micro-batch
    each, 2 experience micro-batches; DDP sends the actor's and critic's gradients once per update and nothing for
    the experience; on-policy GRPO (1 epoch, 1 mini-batch, KL as a loss) skips the actor's experience forward."""
    from llmtrain.metrics.cost import Layout, RoleParams
    from llmtrain.plan.rl import RLIteration, rl_communication

    it = RLIteration(samples=64, mini_batch=16, epochs=2, micro=16, on_policy=False)
    schedule = it.schedule(dp=2)
    assert (schedule.updates, schedule.update_micro, schedule.experience_micro) == (8, 1, 2)
    ddp = Layout(name="ddp", backend=BACKENDS["ddp"], stage=0, dp=2, tp=1)
    roles = {"actor": (RoleParams(trainable=100), True), "critic": (RoleParams(trainable=90), True),
             "reference": (RoleParams(trainable=0, frozen=100), False)}
    shape = dict(tokens_per_micro=16 * 32, hidden=8, layers=2, checkpointing=False, on_gpu=False)
    sent = [(c.what, c.payload * c.times) for c in rl_communication(roles, ddp, "fp32", schedule, **shape) if c.payload]
    assert sent == [("actor update: gradients", 8 * 4 * 100), ("critic update: gradients", 8 * 4 * 90)]

    zero3 = Layout(name="zero3", backend=BACKENDS["deepspeed"], stage=3, dp=2, tp=1)
    on_policy = RLIteration(samples=8, mini_batch=8, epochs=1, micro=4, on_policy=True).schedule(dp=2)
    grpo = {"actor": roles["actor"], "reference": roles["reference"]}
    whats = [c.what for c in rl_communication(grpo, zero3, "fp32", on_policy, **shape)]
    assert "actor experience: weights, forward" not in whats and "reference experience: weights, forward" in whats
    assert whats.count("actor generation: weights") == 1 and "actor update: weights, backward" in whats


def test_rl_head_memory_is_the_response_positions_with_the_token_loss_gradients():
    """GRPO sends only the A + 1 response positions of each row to the fused head, and its token-level loss holds
    the head's gradients to the backward (as SFT's does); GSPO's sequence ratio recomputes instead."""
    from llmtrain.metrics.cost import fused_head_bytes
    from llmtrain.models.facts import model_facts
    from llmtrain.plan.core import head_bytes
    from llmtrain.plan.setting import setting as plan_setting

    for ratio, held in (("token", True), ("sequence", False)):
        cfg = compose_config(["recipe=grpo_tiny", "model.name_or_path=null", "model.from_config={model_type:llama}",
                              "model.tokenizer=" + str(REPO / "llmtrain" / "assets" / "tokenizer"),
                              "model.fused_loss=chunked", f"ppo.ratio={ratio}", "ppo.rollout.max_new_tokens=16",
                              "data.max_seq_len=128"])
        f = model_facts(cfg)
        st = plan_setting(cfg, 1, resolve_gpu(cfg.plan, "cpu"), "fp32", f)
        assert st.head_positions == 17 and st.head_loss_sum is held
        assert head_bytes(st, 4, 128) == fused_head_bytes(4, 17, f.vocab, f.hidden, st.head_chunk, held)


def test_a_vocab_sharded_head_divides_the_logits_and_the_head_states_by_tp():
    """FSDP2, dp 1 × tp 2, fp32, the fused head (chunks of 256 tokens, SFT's summed loss) with an odd, untied
    vocabulary: per rank the logits column is one chunk's 3 fp32 (c, ⌈V/2⌉) buffers plus the held gradients
    (b·s·h + ⌈V/2⌉·h)·4, and the head's weights, gradients and Adam state are halved like the TP plan's layers; the
    embedding stays whole. Full logits (fused_loss=off), a tied head and the pipeline (head_tp 1) keep V rows."""
    layers, h, vocab, b, s, chunk = 4, 256, 50_001, 2, 1024, 256
    blocks = layers * 12 * h * h
    f = dataclasses.replace(facts(blocks + 2 * vocab * h, layers=layers, hidden=h, vocab=vocab), head=vocab * h,
                            tp_params=blocks)
    st = dataclasses.replace(setting(f, world=2, micro=b, seq=s, precision="fp32"), head_chunk=chunk,
                             head_loss_sum=True)
    tp2 = Layout(name="fsdp2_tp", backend=BACKENDS["fsdp2"], stage=3, dp=1, tp=2, head_tp=2)
    row = plan_row(st, tp2)
    half = 25_001  # ⌈V/2⌉
    assert row.logits == 12 * chunk * half + 4 * (b * s * h + half * h)
    per_rank = vocab * h + vocab * h / 2 + blocks / 2  # embedding whole, head and blocks halved
    assert row.states["policy"].weights == pytest.approx(4 * per_rank, rel=1e-12)
    assert row.states["policy"].grads == pytest.approx(4 * per_rank, rel=1e-12)
    assert row.states["policy"].optim == pytest.approx(8 * per_rank, rel=1e-12)
    whole_head = vocab * h + vocab * h + blocks / 2
    for other, layout in ((dataclasses.replace(st, head_chunk=None), tp2),  # full logits
                          (st, dataclasses.replace(tp2, head_tp=1)),  # the pipeline's last stage
                          (dataclasses.replace(st, facts=dataclasses.replace(f, head=0)), tp2)):  # tied
        assert plan_row(other, layout).states["policy"].weights == pytest.approx(4 * whole_head, rel=1e-12)
    assert plan_row(dataclasses.replace(st, head_chunk=None), tp2).logits == b * s * vocab * 4
    assert plan_row(st, dataclasses.replace(tp2, head_tp=1)).logits == 12 * chunk * vocab + 4 * (b * s * h + vocab * h)


def test_the_longest_sequence_is_a_hand_searchs_edge_and_grows_sp_fold():
    """plan.longest_sequence against a linear search with the planner's own row (plan_row's device total at micro-batch
    1, s = 1, 2, ... until it no longer fits), on a device small enough for the search to be short; with sp 8 on
    the same 8 ranks (ZeRO-3 shards over dp × sp either way, each rank holds s/8 of the row) it is 8 times as long."""
    f = facts(120_000_000, layers=4, hidden=512, heads=8, vocab=32_000)
    st = dataclasses.replace(setting(f, world=8, seq=128, precision="fp32"),
                             gpu=dataclasses.replace(GPUS["h100-80gb"], memory_gib=0.5))
    usable = 0.5 * GIB * 0.92

    def fits(seq: int, layout: Layout) -> bool:
        return plan_row(dataclasses.replace(st, seq=seq), layout).device_bytes <= usable

    hand = next(s for s in range(1, 100_000) if not fits(s, zero(3, 8))) - 1
    assert 100 < hand == longest_sequence(st, zero(3, 8))
    sharded = zero(3, 1, sp=8)
    assert longest_sequence(st, sharded) == 8 * hand
    assert fits(8 * hand, sharded) and not fits(8 * hand + 1, sharded)
    assert longest_sequence(dataclasses.replace(st, gpu=dataclasses.replace(st.gpu, memory_gib=0.01)), sharded) == 0


def test_the_plan_prints_the_longest_sequence_per_backend_at_the_runs_sp():
    """`python -m llmtrain.plan recipe=sft_7b backend=zero3 backend.sp=8 data.max_seq_len=131072` on 8 H200s, one
    backend and every compared one: a line per backend; presets that shard sequences are taken to sp 8, ddp has
    none; each figure is plan.longest_sequence of that row (checked for zero3 here by hand)."""
    args = ["recipe=sft_7b", "backend=zero3", "backend.sp=8", "data.max_seq_len=131072", "plan.world_size=8",
            "plan.gpu=h200"]
    text = plan_text(compose_config(args))
    [line] = [line for line in text.splitlines() if "longest data.max_seq_len" in line]
    longest = int(line.split("micro-batch 1: ")[1].split(" (")[0].replace(",", ""))
    assert line.startswith("zero3: longest data.max_seq_len that fits at micro-batch 1: ")
    assert f"(sp 8: {-(-longest // 8):,} tokens of each row per rank)" in line and longest > 131072
    assert "(memory only: this model's config says max_position_embeddings=4,096" in text  # Llama 2's positions
    cfg = compose_config(args)
    facts_7b, gpu = model_facts(cfg), resolve_gpu(cfg.plan, "cuda", 8)
    st, layout = plan_setting(cfg, 8, gpu, "bf16", facts_7b), layout_of("zero3", cfg.backend, 8, facts_7b.hidden)
    usable = gpu.memory_gib * GIB * 0.92
    assert layout.sp == 8 and plan_row(dataclasses.replace(st, micro=1, seq=longest), layout).device_bytes <= usable
    assert plan_row(dataclasses.replace(st, micro=1, seq=longest + 1), layout).device_bytes > usable
    compared = plan_text(compose_config([*args, "plan.compare_backends=true"])).splitlines()
    lines = {line.split(":")[0]: line for line in compared if "longest data.max_seq_len" in line}
    assert set(lines) == {"ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2"}  # fsdp2_tp: sp 8 × tp 2 > 8
    assert lines["zero3"] == line and lines["ddp"].endswith("(no sp)")
    assert all("(sp 8: " in lines[name] for name in ("zero1", "zero2", "zero3_offload", "fsdp2"))
    assert any(line.startswith("fsdp2_tp: left out") and "backend.sp=8 × backend.tp=2" in line for line in compared)



def test_longest_sequence_with_context_parallelism_splits_rows_over_cp_times_sp():
    """backend.cp=4 × backend.sp=2 on 8 H200s: each rank plans s/8 tokens of each row (Layout.row_split), the compared
    presets that have both fields are taken to them, ddp has neither; the figure fits by the plan and one more token
    does not."""
    args = ["recipe=sft_7b", "backend=zero3", "backend.cp=4", "backend.sp=2", "data.max_seq_len=131072",
            "plan.world_size=8", "plan.gpu=h200"]
    compared = plan_text(compose_config([*args, "plan.compare_backends=true"])).splitlines()
    lines = {line.split(":")[0]: line for line in compared if "longest data.max_seq_len" in line}
    longest = int(lines["zero3"].split("micro-batch 1: ")[1].split(" (")[0].replace(",", ""))
    assert f"(cp 4 × sp 2: {-(-longest // 8):,} tokens of each row per rank)" in lines["zero3"]
    assert "(cp 4 × sp 2: " in lines["fsdp2"] and lines["ddp"].endswith("(no cp or sp)")
    cfg = compose_config(args)
    facts_7b, gpu = model_facts(cfg), resolve_gpu(cfg.plan, "cuda", 8)
    st, layout = plan_setting(cfg, 8, gpu, "bf16", facts_7b), layout_of("zero3", cfg.backend, 8, facts_7b.hidden)
    usable = gpu.memory_gib * GIB * 0.92
    assert layout.row_split == 8
    assert plan_row(dataclasses.replace(st, micro=1, seq=longest), layout).device_bytes <= usable
    assert plan_row(dataclasses.replace(st, micro=1, seq=longest + 1), layout).device_bytes > usable
