"""Pretrain and SFT share one stage: next-token loss on target tokens.

They differ only in their data: pretraining labels every token, SFT labels only the response
(the data formats set -100 elsewhere), so the loss code cannot drift between them.
"""

from __future__ import annotations

import torch

from llmtrain.losses.lm import count_target_tokens, lm_correct_count, lm_loss_sum


class CausalLMStage:
    roles = {"policy": True}  # role -> trainable

    def __init__(self, name: str):
        self.name = name

    def micro_batch_loss(self, module: torch.nn.Module, batch) -> torch.Tensor:
        """Summed loss over the micro-batch's target tokens (the trainer normalises it)."""
        logits = module(**batch.model_inputs()).logits  # (B, T, V)
        return lm_loss_sum(logits, batch.labels)

    @torch.no_grad()
    def eval_sums(self, module: torch.nn.Module, batch) -> torch.Tensor:
        """[loss sum, target tokens, correctly predicted target tokens] as a float tensor (3,)."""
        logits = module(**batch.model_inputs()).logits  # (B, T, V)
        return torch.stack([lm_loss_sum(logits, batch.labels), count_target_tokens(batch.labels).float(),
                            lm_correct_count(logits, batch.labels).float()])
