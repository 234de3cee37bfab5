"""Stages by name: each turns a Batch into loss sums with pure functions from llmtrain.losses."""

from llmtrain.stages.causal_lm import CausalLMStage

STAGES = {"pretrain": CausalLMStage, "sft": CausalLMStage}


def build_stage(name: str):
    return STAGES[name](name)
