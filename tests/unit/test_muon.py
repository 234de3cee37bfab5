"""optim=muon against torch itself: MuonAdamW (llmtrain/optim) on a tiny Llama equals torch.optim.Muon on the hidden
matrices plus torch.optim.AdamW on the rest, bit for bit over several steps (and through a state_dict round trip);
a 3-D expert weight equals torch's Muon on each expert matrix; the config refuses what Muon cannot do, naming the
field; the planner's figures."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmtrain.backends.base import OptimizerSpec
from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.metrics.cost import RoleParams, muon_gathers
from llmtrain.optim.build import build_optimizer, muon_params
from llmtrain.optim.muon import MuonAdamW
from llmtrain.optim.spec import MuonSpec, muon_spec, optimizer_state_bytes, state_floats_per_param
from llmtrain.validation import validate

MUON = MuonSpec(lr=2e-2, weight_decay=0.05, momentum=0.9, nesterov=True, ns_steps=5, eps=1e-7)
SPEC = OptimizerSpec(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0, schedule="constant",
                     min_lr_ratio=0.0, max_grad_norm=0.0, max_steps=4, muon=MUON)


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def torch_reference(model: torch.nn.Module, spec: OptimizerSpec) -> list[torch.optim.Optimizer]:
    """What a user writes with torch alone: Muon on the hidden matrices, AdamW (decay on matrices) elsewhere."""
    io = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    hidden = [p for p in model.parameters() if p.ndim == 2 and id(p) not in io]
    rest = [p for p in model.parameters() if not (p.ndim == 2 and id(p) not in io)]
    m = spec.muon
    muon = torch.optim.Muon(hidden, lr=m.lr, weight_decay=m.weight_decay, momentum=m.momentum, nesterov=m.nesterov,
                            ns_coefficients=m.ns_coefficients, eps=m.eps, ns_steps=m.ns_steps,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": spec.weight_decay},
                               {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                              lr=spec.lr, betas=spec.betas, eps=spec.eps)
    return [muon, adamw]


def train(model: torch.nn.Module, optimizers: list, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 12), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("tied", [False, True])
def test_muon_adamw_equals_torch_muon_plus_adamw_bitwise(tied):
    ours_model, ref_model = tiny_llama(tied), tiny_llama(tied)
    ours = build_optimizer(ours_model, SPEC)
    assert isinstance(ours, MuonAdamW) and not ours.param_groups[0].get("muon")  # AdamW first: the logged lr
    train(ours_model, [ours], 3)
    train(ref_model, torch_reference(ref_model, SPEC), 3)
    for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name
    moved = max((a - b).abs().max().item() for a, b in zip(ours_model.parameters(), tiny_llama(tied).parameters()))
    assert moved > 1e-3  # the updates did something


def test_muon_splits_hidden_matrices_from_io_norms_and_biases():
    model = tiny_llama(False)
    muon, rest = muon_params(model, "per_matrix")
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].startswith("model.layers.") and p.ndim == 2 for p in muon)
    assert {names[id(p)] for p in rest} >= {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert len(muon) == 7  # q, k, v, o, gate, up, down of the one layer


def test_state_dict_round_trip_resumes_bitwise():
    straight, resumed = tiny_llama(False), tiny_llama(False)
    opt_straight = build_optimizer(straight, SPEC)
    train(straight, [opt_straight], 2)
    resumed.load_state_dict(straight.state_dict())
    opt_resumed = build_optimizer(resumed, SPEC)
    opt_resumed.load_state_dict(copy.deepcopy(opt_straight.state_dict()))  # a saved copy, not shared tensors
    assert {k for state in opt_resumed.state.values() for k in state} == {"momentum_buffer", "exp_avg",
                                                                            "exp_avg_sq", "step"}
    train(straight, [opt_straight], 2, seed=7)
    train(resumed, [opt_resumed], 2, seed=7)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.w = torch.nn.Parameter(torch.randn(3, 8, 5))  # (E, m, n)
        self.embed = torch.nn.Embedding(4, 5)

    def get_input_embeddings(self):
        return self.embed


def test_3d_experts_are_muon_per_expert_matrix():
    """experts=per_matrix: each expert matrix updated as torch.optim.Muon updates a 2-D parameter (lr adjusted by
    (m, n)); experts=adamw leaves the 3-D weight to AdamW."""
    model = Experts()
    spec = OptimizerSpec(**{**SPEC.__dict__, "muon": MUON})
    ours = build_optimizer(model, spec)
    ref = [torch.nn.Parameter(model.w.detach()[e].clone()) for e in range(3)]
    torch_muon = torch.optim.Muon(ref, lr=MUON.lr, weight_decay=MUON.weight_decay, momentum=MUON.momentum,
                                  adjust_lr_fn="match_rms_adamw")
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        grad = torch.randn(3, 8, 5, generator=generator)
        model.w.grad = grad.clone()
        for e in range(3):
            ref[e].grad = grad[e].clone()
        ours.step()
        torch_muon.step()
    assert torch.equal(model.w.detach(), torch.stack([p.detach() for p in ref]))
    assert muon_params(model, "adamw")[0] == []


def compose(*overrides):
    return compose_config(["recipe=sft_tiny", *overrides])


def test_config_muon_composes_and_refuses_what_it_cannot_do():
    cfg = compose("optim=muon")
    validate(cfg, world_size=1)
    spec = muon_spec(cfg.optim)
    assert spec.lr == cfg.optim.lr and spec.adjust_lr_fn == "match_rms_adamw" and spec.momentum == 0.95
    assert muon_spec(compose().optim) is None
    refused = [(["optim.name=lion"], "optim.name"), (["optim=muon", "optim.muon.ns_steps=0"], "optim.muon.ns_steps"),
               (["optim=muon", "optim.muon.adjust_lr_fn=x"], "optim.muon.adjust_lr_fn"),
               (["optim=muon", "peft=lora"], "peft=none"),
               (["optim=muon", "backend=zero3_offload"], "backend.offload_optimizer.device"),
               (["optim=muon", "backend=zero1", "precision=bf16"], "backend.zero_stage=2"),
               (["optim=muon", "backend=fsdp2", "backend.pp=2"], "backend.pp=1"),
               (["optim=muon", "backend=fsdp2", "backend.cpu_offload=true"], "backend.cpu_offload=false")]
    for overrides, field in refused:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            validate(compose(*overrides), world_size=2)


def test_planner_figures():
    assert state_floats_per_param("adamw") == 2.0 and state_floats_per_param("muon", 1.0) == 1.0
    assert optimizer_state_bytes("muon", 100, muon_params=75, shards=2) == 4 * (75 + 2 * 25) / 2
    role = RoleParams(trainable=1000, muon_fraction=0.75)
    (gather,) = muon_gathers(role, 4)
    assert (gather.kind, gather.payload, gather.wire) == ("all_gather", 4 * 750, 4 * 750 * 3 / 4)
    assert muon_gathers(role, 1) == [] and muon_gathers(RoleParams(trainable=1000), 4) == []
    with pytest.raises(ValueError, match="optim.name"):
        state_floats_per_param("sgd")
