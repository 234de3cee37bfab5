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
                      max_positions=getattr(arch, "max_position_embeddings", None))


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
