"""What the pairwise stages (reward model, DPO) share: the batch of pairs and how it is collated.

A micro-batch of P pairs is ONE forward over its 2P sequences, chosen ones first (0..P-1), then the
rejected ones (P..2P-1) in the same order: one pass over the weights instead of two. Padding-free where the
attention keeps sequences apart without a dense mask (`sdpa_segments`, `flex_segments`, flash varlen): the 2P
sequences go back to back in one packed row (positions restart per sequence), which on the benchmark's
pairs does 2.7x less work than padding them to the longest (39 % of a padded batch is real tokens).
With `sdpa`/`eager` (a dense mask over the packed row would grow with its square) they are right-padded
rows. `trainer.micro_batch_size` counts pairs (as in TRL).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate

import torch
import torch.nn.functional as F

from llmtrain.data import PREFERENCE_FORMATS
from llmtrain.data.collate import FILLER, Batch, collate
from llmtrain.data.packing import merge_packed
from llmtrain.data.sequence_shard import RowShare
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.attention import SEGMENT_ATTENTION
from llmtrain.models.flex import FLEX_ATTENTION
from llmtrain.stages.pair_shard import shard_pairs, sum_over_peers
from llmtrain.stages.reference_cache import pair_key
from llmtrain.stages.spec import StageSpec

PAIR_DATA_HINT = ("trains on pairs: data.format={format} must be preference (rows with chosen and rejected, and "
                  "optionally prompt)")
HARD = "hard"  # the `kind` of a pair whose eval accuracy is reported apart (eval_accuracy_hard)


def padding_free_for(attn_implementation: str) -> bool:
    """Pairs go padding-free under attentions that isolate packed sequences without a dense mask."""
    return (attn_implementation in (SEGMENT_ATTENTION, FLEX_ATTENTION)
            or attn_implementation.startswith("flash_attention"))


@dataclass
class PairBatch:
    rows: Batch  # (R, T): one packed row of 2P sequences, or 2P right-padded rows (chosen, then rejected)
    ends: torch.Tensor  # (2P,) long: flat index into the (R·T) positions of each sequence's last token (its EOS);
    # on a sequence shard -1 where another sp peer holds it
    sequence_ids: torch.Tensor  # (R, T) long: the sequence (0..2P-1) at each position, -1 on padding; on a sequence
    # shard (rows.shifted) the sequence of the token each position predicts, shifted before the cut as the labels are
    margin: torch.Tensor  # (P,) float: per-pair margin (0 without a margin column)
    hard: torch.Tensor  # (P,) bool: pairs tagged kind == "hard"
    weight: torch.Tensor  # (P,) float: 1, or 0 for an eval filler pair that only keeps a rank in step
    num_pairs: int  # real pairs (weight 1), counted on the host
    keys: tuple[str, ...] = ()  # (P,) each pair's reference_cache.pair_key, when the collate was asked for them
    # Under sequence parallelism (stages/pair_shard.py): the sp peers' group, over which each sequence's partial
    # values are summed (None: whole rows), and this shard's share of the pairs' losses, statistics and count (1 on
    # sp rank 0, 0 on its peers, which hold the same whole-sequence values: each pair counts once)
    sp_group: object = None
    share: float = 1.0

    @property
    def num_sequences(self) -> int:
        return self.ends.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PairBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return replace(self, rows=self.rows.to(device, non_blocking), ends=move(self.ends),
                       sequence_ids=move(self.sequence_ids), margin=move(self.margin), hard=move(self.hard),
                       weight=move(self.weight))

    def for_attention(self, attn_implementation: str, mask_dtype: torch.dtype = torch.float32) -> PairBatch:
        return replace(self, rows=self.rows.for_attention(attn_implementation, mask_dtype))

    def with_rows(self, rows: Batch) -> PairBatch:
        """This batch on `rows`, its own rows padded (backends/pipeline.widen: more columns, more rows after them):
        each sequence keeps its row and column, so `ends` is re-indexed for the new width and `sequence_ids` padded
        with -1 (no sequence)."""
        old_rows, old_width = self.rows.input_ids.shape
        new_rows, new_width = rows.input_ids.shape
        if new_rows < old_rows or new_width < old_width:
            raise ValueError(f"rows of {(new_rows, new_width)} cannot hold this batch's {(old_rows, old_width)}")
        ends = torch.div(self.ends, old_width, rounding_mode="floor") * new_width + self.ends % old_width  # (2P,)
        sequence_ids = torch.nn.functional.pad(self.sequence_ids, (0, new_width - old_width, 0, new_rows - old_rows),
                                               value=-1)  # (R', T')
        return replace(self, rows=rows, ends=ends, sequence_ids=sequence_ids)

    def pipeline_shape(self, pairs: int | None, seq_len: int) -> tuple[int, int]:
        """(rows, width) that hold any batch of `pairs` pairs (None: this batch's, fillers too) laid out as this one,
        sequences up to `seq_len` tokens: 2·pairs rows of seq_len, or (padding-free) one packed row of
        2·pairs·seq_len."""
        pairs = pairs or self.margin.shape[0]
        return (1, 2 * pairs * seq_len) if self.rows.is_packed else (2 * pairs, seq_len)

    def sequence_shard(self, attn_implementation: str, rows: RowShare) -> PairBatch:
        """This rank's shard (data/sequence_shard.sequence_preparer calls it; stages/pair_shard.py)."""
        return shard_pairs(self, attn_implementation, rows)

    def target_owners(self) -> torch.Tensor:
        """(R, T) long: the sequence of the token each position predicts (-1: none), aligned with rows.targets()."""
        if self.rows.shifted:
            return self.sequence_ids
        return F.pad(self.sequence_ids[:, 1:], (0, 1), value=-1)

    def whole(self, values: torch.Tensor) -> torch.Tensor:
        """(2P, ...) this shard's parts of per-sequence values -> the whole sequences' (summed over the sp peers);
        values as they are without sp."""
        return sum_over_peers(values, self.sp_group)

    @property
    def counted(self) -> torch.Tensor:
        """(P,) float: 1 for a real pair this rank counts in sums over ranks (filler pairs 0; sp peers' shares 0)."""
        return self.weight * self.share

    def split(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(2P, ...) -> chosen (P, ...), rejected (P, ...)."""
        half = values.shape[0] // 2
        return values[:half], values[half:]


def collate_pairs(examples: list[dict], pad_token_id: int, padding_free: bool = False,
                  keyed: bool = False) -> PairBatch:
    """Preference examples (chosen_/rejected_ input_ids and labels, margin, kind) -> one PairBatch; `keyed`: with
    each pair's key into DPO's precomputed reference log-probs."""
    sides = [{"input_ids": e[f"{side}_input_ids"],
              "labels": [IGNORE_INDEX] * len(e[f"{side}_labels"]) if e.get(FILLER) else e[f"{side}_labels"]}
             for side in ("chosen", "rejected") for e in examples]
    lengths = [len(s["input_ids"]) for s in sides]
    if padding_free:
        rows = collate([merge_packed(sides)], pad_token_id=pad_token_id)  # (1, N), positions restart per sequence
        ends = torch.tensor(list(accumulate(lengths))) - 1
        sequence_ids = torch.repeat_interleave(torch.arange(len(sides)), torch.tensor(lengths))[None]  # (1, N)
    else:
        rows = collate(sides, pad_token_id=pad_token_id)  # right padding: each row's EOS is its last real token
        width = rows.width
        ends = torch.arange(len(sides)) * width + torch.tensor(lengths) - 1
        sequence_ids = torch.where(torch.arange(width)[None] < torch.tensor(lengths)[:, None],
                                   torch.arange(len(sides))[:, None], -1)  # (2P, T)
    weight = torch.tensor([0.0 if e.get(FILLER) else 1.0 for e in examples])
    return PairBatch(rows=rows, ends=ends, sequence_ids=sequence_ids,
                     margin=torch.tensor([float(e.get("margin") or 0.0) for e in examples]),
                     hard=torch.tensor([e.get("kind") == HARD for e in examples]), weight=weight,
                     num_pairs=int(weight.sum().item()), keys=tuple(pair_key(e) for e in examples) if keyed else ())


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) padding mask, left or right padded -> (B,) index of each row's last real token."""
    width = attention_mask.shape[1]
    return width - 1 - attention_mask.flip(-1).long().argmax(-1)


def reward_eval_sums(terms, batch: PairBatch) -> torch.Tensor:
    """(4,) fp64 sums over the real pairs of a batch of implicit-reward terms (losses, chosen_rewards,
    rejected_rewards (P,)): loss, correct (chosen reward above rejected), margin, pairs."""
    w = batch.counted.double()  # (P,) 0 for a filler pair (and on an sp peer: counted once)
    margin = (terms.chosen_rewards - terms.rejected_rewards).double()  # (P,)
    return torch.stack([(terms.losses.double() * w).sum(), ((margin > 0).double() * w).sum(), (margin * w).sum(),
                        w.sum()])


def reward_eval_metrics(sums: list[float]) -> dict:
    """`reward_eval_sums` summed over batches and ranks -> the eval record of an implicit-reward stage."""
    loss, correct, margin, pairs = sums
    pairs = max(pairs, 1)
    return {"eval_loss": loss / pairs, "eval_reward_accuracy": correct / pairs, "eval_reward_margin": margin / pairs,
            "eval_pairs": int(pairs)}


def pair_spec(**fields) -> StageSpec:
    """The spec of a pairwise stage: preference data, both sequences of a pair in one forward, counted in pairs. Under
    backend.pp > 1 a pair's sequences travel in one micro-batch and its loss is computed on the last stage."""
    defaults = dict(data_formats=PREFERENCE_FORMATS, data_hint=PAIR_DATA_HINT, count_name="pairs",
                    sequences_per_sample=2, pipelines=True)
    return StageSpec(**{**defaults, **fields})  # a stage on the pair layout may name its own (KTO's formats)


def pair_problems(cfg, stage: str) -> list[str]:
    """What every pairwise stage needs from the data and the model."""
    problems = []
    if cfg.data.packing:
        problems.append(f"stage {stage}: data.packing=true packs single sequences; pairs are not packed: "
                        "set data.packing=false")
    if cfg.model.dropout > 0:
        problems.append(f"stage {stage} runs every forward without dropout (as TRL does: the chosen and rejected "
                        f"scores must come from the same function): model.dropout={cfg.model.dropout} must be 0")
    return problems
