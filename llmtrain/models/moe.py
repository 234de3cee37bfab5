"""Mixture-of-experts routers (Mixtral, Qwen3-MoE, ...): the load-balancing loss is always part of training.

transformers adds `router_aux_loss_coef × load_balancing_loss_func(router_logits, ..., attention_mask)` to its own
loss only when the config says `output_router_logits` (most checkpoints say false) and only with its own labels;
llmtrain computes the loss itself (`stages/*`), so it asks every training forward for the router logits and
computes the same function here, per micro-batch, with a (B, T) mask of real tokens: padding excluded, and packed
rows' padding tails too (the model's attention_mask is then None or 4-D, which transformers' function cannot use;
routing is per token, so packing itself changes nothing else). The Updater averages the term over the step's
micro-batches and ranks (stages/base.py).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

# the config fields that name the expert count, by family (Mixtral's, then Qwen-MoE's and most others')
EXPERT_FIELDS = ("num_local_experts", "num_experts")


@dataclass(frozen=True)
class Router:
    num_experts: int
    top_k: int
    coef: float  # the config's router_aux_loss_coef


def expert_count(config) -> int | None:
    """A transformers config's expert count (Mixtral's num_local_experts, Qwen-MoE's num_experts); None: dense."""
    return next((getattr(config, f) for f in EXPERT_FIELDS if getattr(config, f, None)), None)


def router_of(module: torch.nn.Module) -> Router | None:
    """The router settings of a (wrapped: DDP, DeepSpeed, peft) MoE causal LM; None for a dense model."""
    while not isinstance(getattr(module, "config", None), PretrainedConfig) and hasattr(module, "module"):
        module = module.module  # DDP, DeepSpeed (whose own `config` is its json); peft forwards `config`
    config = getattr(module, "config", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    experts = expert_count(config)
    if coef is None or experts is None or not getattr(config, "num_experts_per_tok", None):
        return None
    if not balances_experts(family_class(module, config)):
        return None
    return Router(int(experts), int(config.num_experts_per_tok), float(coef))


def family_class(module, config) -> type | None:
    """The transformers class of a (wrapped) model, or the causal LM class of a bare config's family."""
    if isinstance(module, torch.nn.Module):
        return type(next((m for m in module.modules() if isinstance(m, PreTrainedModel)), module))
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return None


def balances_experts(cls: type | None) -> bool:
    """Whether transformers trains this family with the load-balancing loss: its modeling module has
    `load_balancing_loss_func` (Mixtral, Qwen-MoE, OLMoE, Granite-MoE, ...). Llama-4's configs carry a
    router_aux_loss_coef its sigmoid top-1 router never uses, so llmtrain adds none there either. Remote code: kept."""
    for base in cls.__mro__ if cls is not None else ():  # FSDP2 and peft subclass or wrap the transformers class
        if base.__module__.startswith("transformers.models."):
            return hasattr(sys.modules[base.__module__], "load_balancing_loss_func")
    return True


def router_losses(router: Router, router_logits: tuple, token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: per MoE layer (B·T, E); token_mask (B, T) -> (aux loss as transformers computes it (0-d, with
    grad), the busiest expert's share of the routed tokens × E (0-d, detached: 1 = balanced, E = all on one))."""
    aux = load_balancing_loss_func(router_logits, router.num_experts, router.top_k, token_mask)
    with torch.no_grad():
        weights = token_mask.reshape(-1, 1).float()  # (B·T, 1)
        load = sum(torch.nn.functional.one_hot(layer.topk(router.top_k, dim=-1).indices, router.num_experts)
                   .float().sum(1).mul(weights).sum(0) for layer in router_logits)  # (E,)
        busiest = load.max() / load.sum().clamp(min=1) * router.num_experts
    return aux, busiest


def router_forward(module: torch.nn.Module, batch, **kwargs) -> tuple:
    """`module(**batch.model_inputs(), **kwargs)` (batch: data/collate.Batch) -> (outputs, mean term, statistics):
    for an MoE model the term is coef × aux loss (0-d, with grad: the Updater's mean term) and the statistics (aux,
    busiest expert's load) (2,), detached; for a dense model both are None."""
    return routed_forward(module, batch.model_inputs(), batch.token_mask, **kwargs)


def routed_forward(module: torch.nn.Module, inputs: dict, token_mask, **kwargs) -> tuple:
    """`router_forward` for any inputs; token_mask() -> (B, T) float 1 on real tokens (called for an MoE model only)."""
    router = router_of(module)
    if router is None:
        return module(**inputs, **kwargs), None, None
    out = module(**inputs, output_router_logits=True, **kwargs)
    return out, *router_terms(router, out.router_logits, token_mask())


ROUTER_STATS = ("aux_loss", "expert_load_max")


def router_metrics(sums: list[float], micro_batches: int, dp_size: int) -> dict[str, float]:
    """The ROUTER_STATS sums over the step's micro-batches and ranks -> their means (logged as aux_loss, ...)."""
    return {name: value / (micro_batches * dp_size) for name, value in zip(ROUTER_STATS, sums)}


@contextlib.contextmanager
def captured_router_logits(model: torch.nn.Module):
    """Within the block, each forward of the model's backbone appends its router logits (per MoE layer (B·T, E)) to
    the yielded list: a sequence classifier (reward model, critic) drops them from its own output."""
    backbone = next(m for m in model.modules() if isinstance(m, PreTrainedModel) and m.base_model is m)
    captured: list = []
    handle = backbone.register_forward_hook(lambda module, args, out: captured.append(out.router_logits))
    try:
        yield captured
    finally:
        handle.remove()


def router_terms(router: Router, router_logits: tuple, token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (coef × aux loss (0-d, with grad), (aux, busiest expert's load) (2,) detached), as `router_forward`."""
    aux, busiest = router_losses(router, router_logits, token_mask)
    return router.coef * aux, torch.stack([aux.detach(), busiest])
