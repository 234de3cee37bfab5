"""What the stages ask of the LM head, through the fused head-and-loss path (models/fused_head.py): one forward of
the wrapped module each, MoE routers' aux loss included where the stage trains on it."""

from __future__ import annotations

import torch

from llmtrain.data.collate import Batch
from llmtrain.losses.dpo import owned_sums
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.fused_head import HeadAnswer, HeadQuery, action_targets, asking
from llmtrain.models.moe import ROUTER_STATS, routed_forward, router_metrics, router_of


def asked_forward(module: torch.nn.Module, inputs: dict, token_mask, query: HeadQuery, route: bool):
    """One forward of the wrapped module with `query` open on its head -> (answer, MoE term or None, MoE statistics
    or None). route: ask an MoE model for its routers' aux loss (token_mask() -> (B, T) 1 on real tokens)."""
    with asking(module, query) as ask:
        if route:
            out, term, stats = routed_forward(module, inputs, token_mask, **ask.kwargs)
        else:
            out, term, stats = module(**inputs, **ask.kwargs), None, None
    return ask.read(out.logits), term, stats


def lm_forward(module: torch.nn.Module, batch: Batch, query: HeadQuery, route: bool = False):
    """-> (answer, MoE term or None, MoE statistics or None). route: ask an MoE model for its routers' aux loss."""
    return asked_forward(module, batch.model_inputs(), batch.token_mask, query, route)


def target_logps(module: torch.nn.Module, batch: Batch, route: bool = False, accuracy: bool = False):
    """(answer with (B, T) log p of each target token (position t: label t + 1; 0 elsewhere), term, statistics)."""
    return lm_forward(module, batch, HeadQuery(batch.targets(), accuracy=accuracy), route)


def pair_logps(module: torch.nn.Module, batch, average: bool, route: bool = False):
    """A PairBatch's sequences' summed (or averaged) response log-probs (2P,) fp32, and the MoE term and statistics."""
    sums, counts, term, stats = pair_totals(module, batch, route)
    return (sums / counts.clamp(min=1) if average else sums), term, stats


def pair_totals(module: torch.nn.Module, batch, route: bool = False):
    """A PairBatch's sequences' summed response log-probs (2P,) and target counts (2P,), fp32, whole sequences' (on a
    sequence shard summed over the sp peers: stages/pair_shard.py), and the MoE term and statistics."""
    answer, term, stats = target_logps(module, batch.rows, route)
    parts = owned_sums(answer.logps, batch.rows.targets(), batch.target_owners(), batch.num_sequences)
    sums, counts = batch.whole(torch.stack(parts))  # (2, 2P): one reduction for both
    return sums, counts, term, stats


def action_answer(module: torch.nn.Module, inputs: dict, sequences: torch.Tensor, num_actions: int,
                  temperature: float, entropy: bool = False, route: bool = False, token_loss=None,
                  states: torch.Tensor | None = None):
    """Rollout rows `sequences` (b, T) (`inputs`: their model inputs, with the attention mask) whose last A tokens
    are actions -> log p of each action (b, A), and its entropy (b, A) when asked, under softmax(logits / temperature);
    only the last A + 1 positions reach the head. With `route`: (answer, MoE term, MoE statistics). token_loss: a
    models/fused_head.TokenLoss over the b·(A + 1) flattened positions (`flat_actions` lays tensors out so), whose sum
    is the answer's loss_sum. states: (b, A + 1) long when `inputs` is one packed row (stages/ppo/packed.py): the
    position of the state before each action (negative: none; log p 0 there), which alone reach the head."""
    if not 0 < num_actions < sequences.size(1):
        raise ValueError(f"num_actions={num_actions} must be in [1, T) for T={sequences.size(1)} positions")
    targets = action_targets(sequences, num_actions)  # (b, A + 1)
    positions = None
    if states is not None:  # one packed row: the head reads b·(A + 1) states, in flat_actions' order
        targets, positions = targets.masked_fill(states < 0, IGNORE_INDEX).reshape(1, -1), states.clamp(min=0).flatten()
    query = HeadQuery(targets, temperature=temperature, entropy=entropy, token_loss=token_loss, positions=positions)
    token_mask = (lambda: inputs["attention_mask"].float()) if states is None else \
        (lambda: torch.ones_like(inputs["input_ids"], dtype=torch.float32))  # a packed row has no padding
    answer, term, stats = asked_forward(module, inputs, token_mask, query, route)
    shape = (sequences.shape[0], num_actions + 1)  # (b, A + 1): the last position predicts nothing
    answer = HeadAnswer(logps=answer.logps.view(shape)[:, :-1],
                        entropy=None if answer.entropy is None else answer.entropy.view(shape)[:, :-1],
                        loss_sum=answer.loss_sum)
    return (answer, term, stats) if route else answer


def flat_actions(x: torch.Tensor) -> torch.Tensor:
    """(b, A) per-action values -> (b·(A + 1),): the positions action_answer's head sees (the last predicts nothing)."""
    return torch.cat([x, torch.zeros_like(x[:, :1])], dim=1).flatten()


def with_router(loss: torch.Tensor, stats: torch.Tensor, term, router_stats) -> tuple:
    """A MicroLoss's return: (loss, statistics), with an MoE forward's router statistics and mean term appended."""
    if term is None:
        return loss, stats
    return loss, torch.cat([stats, router_stats]), term


def routed_update(updater, engine, micro_batches: list, micro_loss, count: float, num_stats: int):
    """`updater.update` with room for the MoE routers' statistics when the engine's model has routers ->
    (StepResult, the routers' metrics: aux_loss, expert_load_max, {} for a dense model)."""
    moe = router_of(engine.module) is not None
    result = updater.update(engine, micro_batches, micro_loss, count,
                            num_stats=num_stats + (len(ROUTER_STATS) if moe else 0))
    ranks = engine.dp_size * getattr(engine, "sp_size", 1)  # sp peers each route their shard of the rows
    routed = router_metrics(result.sums[num_stats:], len(micro_batches), ranks) if moe else {}
    return result, routed
