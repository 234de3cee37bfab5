"""Pretrain and SFT share one stage: next-token loss on target tokens, one trainable role "policy".

They differ only in their data: pretraining labels every token, SFT labels only the response
(the data formats set -100 elsewhere), so the loss code cannot drift between them.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from llmtrain.data.collate import Batch, collate
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.fused_head import HeadQuery, negative_log_likelihood
from llmtrain.stages.base import ModelSource, RoleSpec, Stage, Updater, eval_totals
from llmtrain.stages.head import lm_forward, routed_update, target_logps, with_router
from llmtrain.stages.spec import SFT_FORMATS, StageSpec


class CausalLMStage(Stage):
    count_name = "tokens"

    def __init__(self, name: str, source: ModelSource, pad_token_id: int):
        self.name = name
        self.roles = policy_role(None, source)
        self.collate = partial(collate, pad_token_id=pad_token_id)

    @staticmethod
    def micro_batch_loss(module: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, ...]:
        """Summed loss over the micro-batch's target tokens (the updater normalises it); no statistics. An MoE model
        adds its routers' coef × aux loss as the mean term, and (aux, busiest expert's load) as statistics."""
        query = HeadQuery(batch.targets(), token_loss=negative_log_likelihood)
        answer, aux_term, router_stats = lm_forward(module, batch, query, route=True)
        loss_sum = answer.loss_sum  # −Σ log p over the target tokens: the head's chunks, never the (B, T, V) logits
        return with_router(loss_sum, torch.zeros(0, device=loss_sum.device), aux_term, router_stats)

    def train_step(self, micro_batches: list[Batch], engines: dict, updater: Updater) -> dict:
        targets = sum(b.num_targets for b in micro_batches)  # counted on the host: no device sync
        result, routed = routed_update(updater, engines["policy"], micro_batches, self.micro_batch_loss, targets, 0)
        return {"loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm, "tokens": result.count, **routed}

    @staticmethod
    def eval_sums(module: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """(−Σ log p, target tokens, argmax hits) of one batch, (3,) fp64."""
        answer, _, _ = target_logps(module, batch, accuracy=True)  # (B, T) each
        # targets(): under sequence parallelism the shard's own (shifted before the cut)
        return torch.stack([-answer.logps.double().sum(), (batch.targets() != IGNORE_INDEX).sum().double(),
                            answer.correct.sum().double()])

    @torch.no_grad()
    def evaluate(self, batches, engines: dict) -> dict:
        engine = engines["policy"]
        engine.module.eval()
        loss_sum, targets, correct = eval_totals(engine, batches, self.eval_sums, 3)
        eval_loss = loss_sum / max(targets, 1)
        return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0)),
                "eval_accuracy": correct / max(targets, 1), "eval_tokens": int(targets)}


def policy_role(cfg, source: ModelSource) -> dict[str, RoleSpec]:
    return {"policy": RoleSpec(source, head="lm", trainable=True)}


def build(cfg, source: ModelSource, tokenizer, attn_implementation: str) -> CausalLMStage:
    return CausalLMStage(cfg.stage.name, source, tokenizer.pad_token_id)


STAGE_SPECS = (
    StageSpec(name="pretrain", build=build, roles=policy_role, data_formats=("text",),
              data_hint="trains on every token: data.format={format} must be text (use stage=sft for prompt/response "
                        "data)", token_losses=True, sequence_parallel=True, pipelines=True, lm_loss_sum=True),
    StageSpec(name="sft", build=build, roles=policy_role, data_formats=SFT_FORMATS,
              data_hint=f"trains on responses only: data.format={{format}} must be one of {', '.join(SFT_FORMATS)} "
                        "(use stage=pretrain for plain text)", token_losses=True, sequence_parallel=True,
              pipelines=True, lm_loss_sum=True),
)
