"""ppo.packing: the experience and update forwards over one packed row per micro-batch (OpenRLHF's packing_samples).

A micro-batch of rollout rows (b, T) is a left-padded prompt and a right-padded response each. Packed, its real
tokens (prompt + response, the attention mask's ones) lie back to back in one row (1, N), N = Σ L_i, position ids
restart at 0 per sample and attention stays within each sample (per-sample causal sdpa from the sample lengths, or
flash-attention's varlen from cu_seq_lens). The head then reads, for every (row i, action j) of the (b, A) layout
the losses use, the hidden state of the token before action j: its position in the packed row is `states[i, j]`.

Exactness: the experience and the update pack a micro-batch by the same pure function of its rows (trimmed the
same), so the first ratio of each iteration stays exactly 1; packed and padded log-probs agree to ~1e-7 (fp32),
not bit for bit (other matmul shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmtrain.data.collate import Batch
from llmtrain.models.attention import PACKABLE_SDPA, SEGMENT_LENGTHS
from llmtrain.stages.ppo.rollout import model_inputs

PACKED_ATTENTIONS = (PACKABLE_SDPA, "flash_attention_2", "flash_attention_3")  # per-sample attention in one row
NO_STATE = -1  # in `states`: the action does not exist (after the response's end, and the last column)


@dataclass(frozen=True)
class ActionRows:
    """What a forward over a micro-batch of rollout rows reads."""
    inputs: dict  # model keyword arguments: (b, T) padded rows, or one packed row (1, N)
    # (b, A + 1) long: packed, the position in the row of the state before action j (NO_STATE where there is no
    # action; column A never has one); None: padded rows, where the head reads the last A + 1 positions
    states: torch.Tensor | None = None

    def token_mask(self) -> torch.Tensor:
        """(rows, width) float, 1 on real tokens: what an MoE router's aux loss counts (a packed row has no pads)."""
        return self.inputs["attention_mask"].float() if "attention_mask" in self.inputs else \
            torch.ones_like(self.inputs["input_ids"], dtype=torch.float32)  # flash-attention's packed row: no mask


def action_rows(sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int,
                attention: str | None) -> ActionRows:
    """Rollout rows (b, T) with their (b, T) attention mask -> the forward's inputs: padded as they are
    (`attention` None), or packed into one row for `attention` (one of PACKED_ATTENTIONS)."""
    if attention is None:
        return ActionRows(model_inputs(sequences, attention_mask))
    if attention not in PACKED_ATTENTIONS:
        raise ValueError(f"ppo.packing: attention {attention!r} cannot keep packed samples apart; one of "
                         f"{', '.join(PACKED_ATTENTIONS)}")
    real = attention_mask.bool()  # (b, T): a left-padded prompt, then the response up to its end
    width = sequences.shape[1]
    prompt_lens = real[:, :width - num_actions].sum(1)  # (b,)
    response_lens = real[:, width - num_actions:].sum(1)  # (b,)
    if bool((prompt_lens < 1).any()):
        raise ValueError("ppo.packing: a rollout row without a prompt token has no state before its first action")
    lengths = prompt_lens + response_lens  # (b,)
    starts = lengths.cumsum(0) - lengths  # (b,) where each sample begins in the packed row
    tokens = sequences[real]  # (N,) row by row, prompt then response
    positions = torch.cat([torch.arange(int(n), device=sequences.device) for n in lengths.tolist()])  # (N,)
    column = torch.arange(num_actions + 1, device=sequences.device)  # (A + 1,)
    states = (starts + prompt_lens - 1)[:, None] + column[None, :]  # (b, A + 1): the token before action j
    states = states.masked_fill(column[None, :] >= response_lens[:, None], NO_STATE)
    return ActionRows(packed_inputs(tokens, positions, tuple(lengths.tolist()), attention), states)


def packed_inputs(tokens: torch.Tensor, positions: torch.Tensor, lengths: tuple[int, ...], attention: str) -> dict:
    """Model keyword arguments for one packed row of samples of `lengths` (tokens, positions: (N,))."""
    if attention == PACKABLE_SDPA:
        # an all-ones padding mask: transformers then builds no (N, N) mask (packable_sdpa reads the segments)
        return {"input_ids": tokens[None], "position_ids": positions[None], SEGMENT_LENGTHS: (lengths,),
                "attention_mask": torch.ones_like(tokens)[None]}
    row = Batch(tokens[None], tokens[None], None, positions[None], (lengths,), row_lengths=(len(tokens),))
    return row.for_attention(attention).model_inputs()  # flash-attention: cu_seq_lens over the samples


def action_values(scores: torch.Tensor, rows: ActionRows, num_actions: int) -> torch.Tensor:
    """A critic's per-token scores (rows, width) -> (b, A) V_t at the state before each action (0 where none)."""
    if rows.states is None:
        return scores[:, -num_actions - 1:-1]
    states = rows.states[:, :num_actions]  # (b, A)
    return torch.where(states >= 0, scores[0, states.clamp(min=0)], 0.0)
