"""The planner's input: a `Setting`, everything a row needs besides the layout, read from the resolved config and
the model's facts (the attention the run resolves, LoRA, the stage's roles and heads, the fused head's chunk, an RL
iteration's shape); core.py computes a row's figures from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from llmtrain.metrics.devices import Gpu
from llmtrain.models.facts import ModelFacts, lora_trainable
from llmtrain.models.fused_head import default_chunk_tokens, head_is_fused
from llmtrain.optim.spec import state_floats_per_param
from llmtrain.plan.rl import RLIteration
from llmtrain.stages.registry import stage_roles, stage_spec


@dataclass
class Setting:
    """Everything a row needs besides the layout."""
    facts: ModelFacts
    roles: dict[str, bool]  # role -> trainable
    lora: int
    views: frozenset[str]  # frozen roles that are a trainable role's model with adapters off (no weights of their own)
    precision: str
    gpu: Gpu
    world: int
    micro: int
    accum: int
    seq: int
    rows_per_sample: int  # 2 for pair stages (chosen and rejected in one forward)
    checkpointing: bool
    scores: bool  # the resolved attention is eager: it stores the (b, a, s, s) scores (planned_attention)
    mfu: float
    logits_vocab: int  # V, or 1 for a reward model's score
    head_chunk: int | None = None  # the fused LM head's chunk tokens (model.fused_loss); None: full logits
    optim_floats: float = 2.0  # fp32 optimizer-state values per trainable parameter (optim/spec.py: Adam 2, Muon 1)
    muon_share: float = 0.0  # share of the trainable parameters optim=muon updates (0: AdamW, or LoRA's adapters)
    head_loss_sum: bool = False  # the fused head's summed loss (pretrain/SFT, RL's token loss): gradients held
    head_positions: int | None = None  # positions per row through the LM head (RL: the A + 1 response ones); None: all
    rl: RLIteration | None = None  # PPO/GRPO: a step is an iteration of several optimizer steps per role
    scalar_heads: frozenset[str] = frozenset()  # roles whose model ends in a scalar head (hidden -> 1), not the LM head
    concat_outputs: bool = False  # packed rows through per-sample attention (sdpa_segments, the ring): + h/t a token

    @property
    def fused_head(self) -> bool:
        """The trained head is an LM head computed in chunks (model.fused_loss), not full logits or a score."""
        return self.head_chunk is not None and self.logits_vocab != 1


def planned_attention(cfg: DictConfig, gpu: Gpu, precision: str, facts: ModelFacts) -> str:
    """The attention the run resolves (stages/registry.decide_attention, as run.py does): an explicit one as given,
    `auto`'s pick for the planned device, then the same decision (sp, the family: eager where its transformers class
    lacks it, Gemma-2 has no sdpa; the stage's own need). A GPU planned
    from a machine without one is taken to have Triton (CUDA builds of torch ship it): flex_segments, or sdpa_segments
    with dropout; flash-attention and flex both exist in the families that lack sdpa, so either gives the same count."""
    from llmtrain.models.attention import SEGMENT_ATTENTION
    from llmtrain.models.flex import FLEX_ATTENTION
    from llmtrain.models.load import resolve_attn_implementation
    from llmtrain.stages.registry import decide_attention

    m = cfg.model
    if m.attn_implementation != "auto":
        attn = m.attn_implementation
    elif gpu.name == "cpu" or torch.cuda.is_available():
        attn = resolve_attn_implementation("auto", torch.device("cpu" if gpu.name == "cpu" else "cuda"), precision,
                                           m.dropout)
    else:
        attn = FLEX_ATTENTION if m.dropout == 0 else SEGMENT_ATTENTION
    return decide_attention(cfg, attn, lambda a: "eager" if a in facts.lacks_attention else a)


def setting(cfg: DictConfig, world: int, gpu: Gpu, precision: str, facts: ModelFacts) -> Setting:
    from llmtrain.models.attention import SEGMENT_ATTENTION

    attn = planned_attention(cfg, gpu, precision, facts)
    lora = lora_trainable(cfg)
    spec, roles = stage_spec(cfg.stage.name), stage_roles(cfg)
    views = frozenset(role for role, r in roles.items() if lora and r.adapter_off_of)
    scalar_heads = frozenset(role for role, r in roles.items() if r.head == "scalar")
    trainable_scalar = all(r.head == "scalar" for r in roles.values() if r.trainable)
    rl = spec.rl_shape(cfg) if spec.rl_shape else None
    muon_share = facts.muon_params / facts.params if cfg.optim.name == "muon" and not lora else 0.0
    return Setting(facts=facts, roles={role: r.trainable for role, r in roles.items()}, scalar_heads=scalar_heads,
                   lora=lora, views=views, precision=precision, gpu=gpu, world=world,
                   micro=cfg.trainer.micro_batch_size, accum=cfg.trainer.grad_accum_steps, seq=cfg.data.max_seq_len,
                   rows_per_sample=spec.sequences_per_sample, checkpointing=cfg.model.activation_checkpointing,
                   scores=attn == "eager", mfu=cfg.plan.mfu, logits_vocab=1 if trainable_scalar else facts.vocab,
                   rl=RLIteration.from_config(cfg), head_chunk=planned_head_chunk(cfg.model, facts),
                   head_loss_sum=spec.token_losses or bool(rl and rl.token_loss),
                   head_positions=rl.max_new_tokens + 1 if rl else None,
                   optim_floats=state_floats_per_param(cfg.optim.name, muon_share), muon_share=muon_share,
                   concat_outputs=attn == SEGMENT_ATTENTION and bool(cfg.data.packing))


def planned_head_chunk(m, facts: ModelFacts) -> int | None:
    """model.fused_loss / loss_chunk_tokens -> the fused head's chunk tokens; None: full logits."""
    if not head_is_fused(m.fused_loss, facts.vocab, facts.hidden):
        return None
    return m.loss_chunk_tokens or default_chunk_tokens(facts.vocab, facts.hidden)


def plan_precision(cfg: DictConfig, gpu: Gpu) -> str:
    return cfg.precision if cfg.precision != "auto" else ("fp32" if gpu.name == "cpu" else "bf16")
