"""What the planner reads from a model built on the meta device (no weights, no storage): parameter counts,
shape, the block and embedding sizes, the share its tensor-parallel plan splits, LoRA's adapter count."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from omegaconf import DictConfig


@dataclass(frozen=True)
class ModelFacts:
    """Counts read from the model on the meta device."""
    label: str
    params: int
    numels: tuple[int, ...]  # every parameter tensor, tied ones once
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int | None
    block: int  # parameters of one decoder block
    embed: int
    head: int  # 0 when tied to the embedding
    tp_params: int  # parameters the model's TP plan splits; 0: no plan
    model_type: str
    lacks_attention: frozenset[str] = frozenset()  # attentions its transformers class does not run (Gemma-2: sdpa)
    softcapping: bool = False  # attention-logit softcapping (Gemma-2): eager attention keeps tanh's output too
    max_positions: int | None = None  # the config's max_position_embeddings (what its rotary was trained to)
    experts: int = 0  # routed experts per MoE layer (0: dense)
    expert_params: int = 0  # parameters of the routed experts, every layer (what backend.ep splits)
    tp_expert_params: int = 0  # of those, the ones the TP plan splits (ExpertsOverTP) when ep is off
    top_k: int = 0  # experts per token
    moe_layers: int = 0  # decoder layers with routed experts
    moe_intermediate: int = 0  # one routed expert's MLP width (0: dense)
    muon_params: int = 0  # the hidden matrices optim=muon updates (optim/build.muon_params); the rest stays on AdamW

    @property
    def mlp_width(self) -> float | None:
        """The MLP width the activation count uses (its 4i per token: gate, up, silu(gate), their product). An MoE
        layer keeps them for each of its k experts per token, plus each slot's sorted input row and weighted output
        (2·k·h) and the router logits (E): 4·w = 4·k·i_e + 2·k·h + E (measured, tiny Mixtral: the count within 5 %)."""
        if not self.experts or self.intermediate is None:
            return self.intermediate
        routed = self.top_k * self.moe_intermediate + self.top_k * self.hidden / 2 + self.experts / 4
        dense_share = 1 - self.moe_layers / self.layers  # Qwen-MoE's mlp_only_layers keep a dense MLP
        return dense_share * self.intermediate + (1 - dense_share) * routed


def local_vocab_size(tokenizer_source: str | None, trust_remote_code: bool) -> int | None:
    """The tokenizer's size when it is on disk (cheap, no weights); None for a hub id offline."""
    from pathlib import Path

    from llmtrain.models.load import load_tokenizer

    if tokenizer_source is None or not Path(tokenizer_source).is_dir():
        return None
    return len(load_tokenizer(tokenizer_source, trust_remote_code))


def model_facts(cfg: DictConfig) -> ModelFacts:
    import torch
    from transformers import AutoModelForCausalLM

    from llmtrain.models.backbone import backbone
    from llmtrain.models.load import model_config, unsupported_attentions
    from llmtrain.models.tp import tp_plan
    from llmtrain.optim.build import muon_params

    m = cfg.model
    vocab = local_vocab_size(m.tokenizer or m.name_or_path, m.trust_remote_code)
    arch = model_config(m.name_or_path, m.from_config, m.config_path, m.trust_remote_code, vocab_size=vocab)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(arch)
    numels = tuple(p.numel() for p in model.parameters())
    base = backbone(model)
    blocks = next(getattr(base, n) for n in ("layers", "h", "blocks") if hasattr(base, n))
    out = model.get_output_embeddings()
    embed = model.get_input_embeddings().weight
    plan = tp_plan(arch) or {}
    tp_params = sum(p.numel() for name, p in base.named_parameters()
                    if any(fnmatch.fnmatch(name.rsplit(".", 1)[0], pattern) for pattern in plan))
    return ModelFacts(label=m.name_or_path or arch.model_type, params=sum(numels), numels=numels,
                      layers=arch.num_hidden_layers, hidden=arch.hidden_size, heads=arch.num_attention_heads,
                      kv_heads=getattr(arch, "num_key_value_heads", None) or arch.num_attention_heads,
                      vocab=arch.vocab_size, intermediate=getattr(arch, "intermediate_size", None),
                      block=sum(p.numel() for p in blocks[0].parameters()), embed=embed.numel(),
                      head=0 if out is None or out.weight is embed else out.weight.numel(), tp_params=tp_params,
                      model_type=arch.model_type, lacks_attention=unsupported_attentions(arch),
                      softcapping=getattr(arch, "attn_logit_softcapping", None) is not None,
                      max_positions=getattr(arch, "max_position_embeddings", None), **_expert_facts(model, arch),
                      muon_params=sum(p.numel() for p in muon_params(model, "per_matrix")[0]))


def _expert_facts(model, arch) -> dict:
    from llmtrain.models.expert_parallel import experts_modules, moe_layers
    from llmtrain.models.moe import expert_count
    from llmtrain.models.tp import tp_plan

    experts = expert_count(arch) or 0
    if not experts:
        return {}
    modules = experts_modules(model, arch)
    routed = sum(p.numel() for _, m in modules for p in m.parameters())
    plan = tp_plan(arch) or {}
    in_tp = sum(p.numel() for name, m in modules if any(fnmatch.fnmatch(name, pattern) for pattern in plan)
                for p in m.parameters())
    return {"experts": experts, "expert_params": routed, "tp_expert_params": in_tp, "moe_layers": moe_layers(arch),
            "moe_intermediate": getattr(arch, "moe_intermediate_size", None) or arch.intermediate_size,
            "top_k": int(getattr(arch, "num_experts_per_tok", 0) or 0)}


def lora_trainable(cfg: DictConfig) -> int:
    """peft=lora: Σ r·(d_in + d_out) over the targeted Linear layers (all-linear: every one but the output layer),
    from the meta model; the base stays frozen. 0 without LoRA."""
    p = cfg.peft
    if p.name != "lora":
        return 0
    import torch
    from transformers import AutoModelForCausalLM

    from llmtrain.config import OUTPUT_LAYERS
    from llmtrain.models.load import model_config

    m = cfg.model
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(m.name_or_path, m.from_config, m.config_path,
                                                              m.trust_remote_code))
    targets = None if isinstance(p.target_modules, str) else set(p.target_modules)
    total = 0
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and leaf not in OUTPUT_LAYERS and (targets is None or leaf in targets):
            total += p.r * (module.in_features + module.out_features)
    return total
