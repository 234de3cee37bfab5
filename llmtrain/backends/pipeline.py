"""Pipeline stages of a Hugging Face decoder, run by torch.distributed.pipelining's schedules.

The split (torchtitan's pipeline_llm, done on an HF model): the decoder's blocks go to P·v stages by cost
(pipeline_checks.split_blocks); each stage is a copy of the causal LM in which the blocks of other stages are
`PipelineIdentity` (so the kept ones keep their `model.layers.N` names and checkpoints their keys), the embedding
lives on the first stage only and the final norm and head on the last. Stage s sits on pp rank s mod P (zbv: the V,
rank r holds stages r and 2P−1−r, so the first and the last stage share rank 0).

What travels between stages: the hidden states (b, W, h) and the micro-batch's index (b,) in the step. Every rank of
one pipeline reads the same examples (as tensor-parallel peers do), so each stage rebuilds the micro-batch's
attention inputs (padding mask, packed position ids and sample lengths, whatever the attention reads) from its own
copy, found by that index: only the first stage receives the schedule's arguments, and no (b, 1, W, W) mask crosses
a link. Micro-batches are padded to one shape (b, W) (the stage buffers have one shape), fixed by the stage's first
micro-batch: b = trainer.micro_batch_size rows of W = data.max_seq_len for token stages; for pair stages (reward
model, DPO, SimPO, ORPO) a micro-batch holds whole pairs, its 2P sequences as 2P rows or one packed row
(PairBatch.pipeline_shape), so both sequences of a pair reach the last stage together, where the pair loss (score
head, or the LM head's per-sequence log-prob sums) is computed.

The loss: the last stage runs the stage's own MicroLoss (the fused head, exactly as without a pipeline) and returns
the micro-batch's summed loss; the schedule's loss_fn multiplies it by dp / (global target count), known before the
step, so `scale_grads` is off (the schedules would divide by M once more).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.backends.pipeline_checks import (
    SCHEDULES,
    StageCosts,
    describe_stage,
    rank_stages,
    split_blocks,
    stage_ranks,
)
from llmtrain.data.collate import Batch
from llmtrain.losses.lm import IGNORE_INDEX

log = logging.getLogger(__name__)


class PipelineIdentity(nn.Module):
    """A block of another stage: hands the hidden states through (no parameters, so no state-dict keys)."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


def has_layer_stack(arch) -> bool:
    """The split's assumption, checked on the meta device (no weights): `model.layers` blocks, `model.embed_tokens`,
    `model.norm` and `lm_head` (Llama, Qwen2/3, Mistral, Gemma...; GPT-2 names them transformer.h/wte/ln_f)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(arch)
    base = getattr(model, "model", None)
    return (isinstance(getattr(base, "layers", None), nn.ModuleList) and hasattr(base, "embed_tokens")
            and hasattr(base, "norm") and hasattr(model, "lm_head"))


HEAD_NAMES = ("lm_head", "score")  # a causal LM's head; a sequence classifier's (the reward model's scalar head)


def head_name(causal_lm: nn.Module) -> str:
    """The last stage's head: `lm_head` (next-token logits) or `score` (one score per token, models/heads.py)."""
    for name in HEAD_NAMES:
        if isinstance(getattr(causal_lm, name, None), nn.Module):
            return name
    raise ValueError(f"{type(causal_lm).__name__} has none of the heads {', '.join(HEAD_NAMES)} the pipeline splits")


def stage_copy(causal_lm: nn.Module, blocks: range, first: bool, last: bool) -> nn.Module:
    """The model with only this stage's modules: deepcopy's memo maps every other block to an identity (and the
    embedding, final norm and head away from the stages without them), so nothing of other stages is copied."""
    base = causal_lm.model
    memo = {id(layer): PipelineIdentity() for i, layer in enumerate(base.layers) if i not in blocks}
    if not first:
        memo[id(base.embed_tokens)] = None
    if not last:
        memo[id(base.norm)] = nn.Identity()
        memo[id(getattr(causal_lm, head_name(causal_lm)))] = None
    return copy.deepcopy(causal_lm, memo)


@dataclass
class StepInputs:
    """What every stage of this rank reads during one schedule step (set by the engine before it)."""
    micro_batches: list = field(default_factory=list)  # the step's Batches, padded to one width
    micro_loss: object = None  # the stage's MicroLoss: (module, batch) -> (loss_sum, stats, *mean term)
    sums: list = field(default_factory=list)  # last stage: per micro-batch (loss sum, mean term, *stats), detached
    forward_only: bool = False  # evaluation: micro_loss is (module, batch) -> (K,) sums, no graph


class LastStageView(nn.Module):
    """The module a MicroLoss calls on the last stage, `module(**batch.model_inputs(), logits_to_keep=K)`: the causal
    LM (or the reward model's sequence classifier) from the received hidden states (the token ids were embedded on
    the first stage)."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.lm = causal_lm
        self.hidden: torch.Tensor | None = None

    def forward(self, input_ids=None, **kwargs):
        return self.lm(inputs_embeds=self.hidden, **kwargs)


class StageModule(nn.Module):
    """One stage; its modules under the whole model's names (`model.*`, `lm_head` or `score`), so the keys match."""

    def __init__(self, causal_lm: nn.Module, index: int, num_stages: int, blocks: range, inputs: StepInputs,
                 head: str = "lm_head"):
        super().__init__()
        self.index, self.blocks, self.inputs, self.head = index, blocks, inputs, head
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.model = causal_lm.model
        if self.is_last:
            setattr(self, head, getattr(causal_lm, head))
            self.__dict__["view"] = LastStageView(causal_lm)  # not a submodule: its modules are the ones above

    def forward(self, x: torch.Tensor, index: torch.Tensor):
        """x: (b, W) token ids on the first stage, else (b, W, h) hidden states; index: (b,) the micro-batch."""
        i = int(index[0])
        batch = self.inputs.micro_batches[i]
        if self.is_last:
            return self._loss(x, batch)
        inputs = {k: v for k, v in rows_of(batch).model_inputs().items() if k != "input_ids"}
        embedded = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        hidden = self.model(**embedded, **inputs).last_hidden_state  # (b, W, h)
        return hidden, index

    def _loss(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        self.view.hidden = hidden
        try:
            if self.inputs.forward_only:
                self.inputs.sums.append(self.inputs.micro_loss(self.view, batch).double())
                return hidden.new_zeros(1)
            loss_sum, stats, *term = self.inputs.micro_loss(self.view, batch)
        finally:
            self.view.hidden = None
        term = term[0] if term else loss_sum.new_zeros(())
        self.inputs.sums.append(torch.cat([loss_sum.detach().float().reshape(1), term.detach().float().reshape(1),
                                           stats.detach().float().reshape(-1)]))
        return loss_sum.reshape(1)  # (1,) the micro-batch's summed loss, with its graph


class RankModel(nn.Module):
    """This rank's stages under the whole model's names (model.embed_tokens, model.layers.N, model.norm, lm_head or
    score):
    what the optimizer, the gradient norm, DCP checkpoints and the export see. Not called: the schedule runs the
    stages."""

    def __init__(self, parts: list[StageModule], config):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict()
        for part in parts:
            for i in part.blocks:
                self.model.layers[str(i)] = part.model.layers[i]
            if part.is_first:
                self.model.embed_tokens = part.model.embed_tokens
            if part.is_last:
                self.model.norm = part.model.norm
                setattr(self, part.head, getattr(part, part.head))


def rows_of(batch) -> Batch:
    """The token rows of a micro-batch: a Batch itself, or a PairBatch's `rows` (its 2P sequences)."""
    return getattr(batch, "rows", batch)


def pad_micro_batch(batch, rows: int, width: int, attn_implementation: str, mask_dtype: torch.dtype):
    """`widen` for a Batch, or for a PairBatch's rows (its sequence positions moved with them: `with_rows`)."""
    if not hasattr(batch, "rows"):
        return widen(batch, rows, width, attn_implementation, mask_dtype)
    return batch.with_rows(widen(batch.rows, rows, width, attn_implementation, mask_dtype))


def micro_batch_shape(batch, seq_len: int, count: int | None = None) -> tuple[int, int]:
    """(rows, width) of the stage buffers for micro-batches of `count` examples (None: as many as `batch` holds) laid
    out like `batch`: a Batch's count rows of data.max_seq_len, or a PairBatch's `pipeline_shape` (2·count rows, or
    one packed row of 2·count sequences)."""
    shape = getattr(batch, "pipeline_shape", None)
    if shape is None:
        return (count or batch.input_ids.shape[0], seq_len)
    return shape(count, seq_len)


def widen(batch: Batch, rows: int, width: int, attn_implementation: str, mask_dtype: torch.dtype) -> Batch:
    """The batch padded to (rows, width): ids 0, labels ignored, padding outside every sample; added rows hold one
    token each (no row is fully masked); the attention inputs rebuilt for that shape from the sample lengths."""
    extra, pad = rows - batch.input_ids.shape[0], width - batch.width
    if extra == 0 and pad == 0:
        return batch
    device = batch.input_ids.device
    lengths = (*batch.row_lengths, *(1,) * extra)
    mask = None if batch.is_packed else \
        (torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]).long()  # (b, W)
    raw = replace(batch, input_ids=F.pad(batch.input_ids, (0, pad, 0, extra)),
                  labels=F.pad(batch.labels, (0, pad, 0, extra), value=IGNORE_INDEX), attention_mask=mask,
                  position_ids=None if batch.position_ids is None else F.pad(batch.position_ids, (0, pad, 0, extra)),
                  seq_lens=None if batch.seq_lens is None else (*batch.seq_lens, *((1,),) * extra),
                  row_lengths=lengths, attention_kwargs={})
    return raw.for_attention(attn_implementation, mask_dtype)


def block_costs(causal_lm: nn.Module, seq_len: int) -> StageCosts:
    config = causal_lm.config
    block = sum(p.numel() for p in causal_lm.model.layers[0].parameters())
    head = getattr(causal_lm, head_name(causal_lm)).weight.numel()
    return StageCosts.of(block, config.hidden_size, config.vocab_size, seq_len, head)


def build_parts(causal_lm: nn.Module, pp_rank: int, pp: int, virtual: int, seq_len: int, inputs: StepInputs,
                log_split: bool, v_shape: bool = False) -> list[StageModule]:
    """This rank's stage modules (stages pp_rank, pp_rank + pp, ...; v_shape: pp_rank and 2·pp−1−pp_rank), in stage
    order."""
    layers = len(causal_lm.model.layers)
    num_stages = pp * virtual
    bounds = split_blocks(layers, num_stages, block_costs(causal_lm, seq_len))
    if log_split:
        for s, blocks in enumerate(bounds):
            log.info("pp rank %d: stage %d: %s", stage_ranks(s, pp, v_shape), s, describe_stage(s, num_stages, blocks))
    mine, head = rank_stages(pp_rank, pp, num_stages, v_shape), head_name(causal_lm)
    return [StageModule(stage_copy(causal_lm, bounds[s], s == 0, s == num_stages - 1), s, num_stages, bounds[s],
                        inputs, head) for s in mine]


@dataclass(frozen=True)
class Shapes:
    """One micro-batch's shapes: every stage's buffers are fixed when the stage is built (torch's STATIC mode; the
    other mode infers them by running the stage's forward on empty tensors, which a stage that reads its batch by
    index cannot do)."""
    rows: int  # b: trainer.micro_batch_size (pairs: 2 × micro_batch_size rows, or 1 packed row)
    width: int  # W: data.max_seq_len (a packed row of pairs: 2 × micro_batch_size × it), every micro-batch padded
    hidden: int  # h
    dtype: torch.dtype  # the hidden states' (bf16 under FSDP's bf16 parameters, else fp32)

    def inputs(self, first: bool) -> tuple[torch.Tensor, ...]:
        index = torch.empty(self.rows, dtype=torch.long, device="meta")  # (b,)
        if first:
            return torch.empty(self.rows, self.width, dtype=torch.long, device="meta"), index  # (b, W) token ids
        hidden = torch.empty(self.rows, self.width, self.hidden, dtype=self.dtype, device="meta")  # (b, W, h)
        return hidden.requires_grad_(), index  # requires_grad: the stage sends (receives) its gradient back

    def outputs(self, last: bool) -> tuple[torch.Tensor, ...]:
        if last:
            return (torch.empty(1, device="meta").requires_grad_(),)  # the micro-batch's summed loss (1,)
        return self.inputs(first=False)


def build_schedule(parts: list[StageModule], schedule: str, microbatches: int, device: torch.device, group,
                   loss_fn, shapes: Shapes):
    """torch's PipelineStage per part and the named schedule over them, with scale_grads off (module docstring);
    loss_fn None: forward only (evaluation) in GPipe's order, in the named schedule's stage placement."""
    from torch.distributed import pipelining

    num_stages = len(parts) * group.size()
    stages = [pipelining.PipelineStage(part, part.index, num_stages, device, group=group,
                                       input_args=shapes.inputs(part.is_first),
                                       output_args=shapes.outputs(part.is_last)) for part in parts]
    if loss_fn is None:
        if len(stages) == 1:
            return pipelining.ScheduleGPipe(stages[0], n_microbatches=microbatches)
        looped = _v_shaped_bfs() if SCHEDULES[schedule].v_shape else pipelining.ScheduleLoopedBFS
        return looped(stages, n_microbatches=microbatches)
    cls = getattr(pipelining, SCHEDULES[schedule].torch_class)
    single = not SCHEDULES[schedule].multi
    return cls(stages[0] if single else stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def _v_shaped_bfs():
    from torch.distributed.pipelining import ScheduleLoopedBFS
    from torch.distributed.pipelining.schedules import _ComputationType as Action

    class VShapedBFS(ScheduleLoopedBFS):
        """torch's ScheduleLoopedBFS over zbv's V placement (rank r: stages r and 2P−1−r) instead of the looped one,
        forwards only: the evaluation's schedule for a zbv run (torch maps stages to ranks from these actions). Its
        backward actions are dropped once lowered: they would hand gradients between the V's two stages on rank P−1,
        which a stage without backward refuses (torch's check of the actions wants them until then)."""

        def _calculate_single_rank_operations(self, rank):
            looped = super()._calculate_single_rank_operations(rank)
            mine = rank_stages(rank, self.pp_group_size, self._num_stages, v_shape=True)
            order = {s: mine[i] for i, s in enumerate(range(rank, self._num_stages, self.pp_group_size))}
            return [a if a is None else a._replace(stage_index=order[a.stage_index]) for a in looped]

        def _prepare_schedule_with_comms(self, actions, format="compute_only"):
            super()._prepare_schedule_with_comms(actions, format)
            keep = (Action.FORWARD, Action.SEND_F, Action.RECV_F, Action.UNSHARD, Action.RESHARD)
            self.pipeline_order_with_comms = {rank: [a for a in ops if a.computation_type in keep]
                                              for rank, ops in self.pipeline_order_with_comms.items()}

    return VShapedBFS
