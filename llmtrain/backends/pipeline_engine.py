"""The FSDP2 engine with pipeline stages (backend.pp > 1): dp × pp, FSDP2 per stage on the dp mesh.

Order (ARCHITECTURE.md: tp → sp → ac → compile → fsdp → pp): the split into stages comes first here because every
stage is its own FSDP root (blocks, then the stage: one all-gather per block, the stage's embedding or norm + head in
the root's group); the stages then go to torch's PipelineStage, which drives FSDP's gradient reduction itself (no
sync on every micro-batch's backward, one reduce-scatter per stage after the last).

Build (fsdp2's way, per stage): rank 0 builds the whole model (random init or from_pretrained, so the weights are
DDP's bit for bit), the others build it on the meta device; every rank copies its own stages' modules (meta copies,
no storage, on ranks other than 0), empties them, parallelizes them (tp, fsdp) and fills its shards from rank 0's
tensors, broadcast one at a time (`load_stages_from_rank0`): only rank 0 ever holds the whole model.

The step (`run_schedule`, called by stages/base.Updater for an engine with `pipelined`): one schedule step over the
M micro-batches (the schedule is built on the first step, its buffers shaped by that step's micro-batches); the last
stage's per-micro-batch sums are summed over the pp ranks, so every rank returns them.
The gradient norm is the whole model's: squared norms summed over the pp ranks.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from llmtrain.backends.base import OptimizerSpec, autocast_dtype, build_scheduler, param_groups, save_hf
from llmtrain.backends.fsdp2 import (
    FSDP2Backend,
    FSDP2Engine,
    clip_to_norm,
    split_groups_by_mesh,
    total_grad_norm,
)
from llmtrain.backends.fsdp2_parallelize import ranks_on_meta
from llmtrain.backends.pipeline import (
    SCHEDULES,
    RankModel,
    Shapes,
    StepInputs,
    build_parts,
    build_schedule,
    micro_batch_shape,
    pad_micro_batch,
    rows_of,
)
from llmtrain.distributed import DistContext, all_reduce_sum
from llmtrain.models.lora import is_peft, unwrap_peft
from llmtrain.models.tp import apply_tp_plan
from llmtrain.parallel import ParallelDims

log = logging.getLogger(__name__)


TIED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")  # RankModel's names of a tied weight's two copies


def first_and_last_group(dims: ParallelDims):
    """The process group of this rank's pipeline's first and last pp ranks (None on the ranks between): every rank
    creates every such group, in the same order (a collective)."""
    ranks = dims.mesh("world").mesh.reshape(dims.pp, -1)  # (pp, the other dimensions' ranks)
    mine = None
    for column in ranks.t().tolist():
        group = dist.new_group([column[0], column[-1]])
        if dist.get_rank() in (column[0], column[-1]):
            mine = group
    return mine


def _renamed(state: dict, old: str, new: str) -> dict:
    """A flat state dict with `old` (a parameter name) replaced by `new` in its keys (model: `name`; flattened
    optimizer: `state.name.exp_avg`, `param_groups.name.lr`)."""
    def rename(key: str) -> str:
        for prefix in ("", "state.", "param_groups."):
            if key == prefix + old or key.startswith(prefix + old + "."):
                return prefix + new + key[len(prefix + old):]
        return key

    return {rename(key): value for key, value in state.items()}


def to_meta(module: torch.nn.Module) -> None:
    """The module's tensors to the meta device, in place (fsdp2_parallelize.set_aside_and_empty's way)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device="meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def load_stages_from_rank0(model: RankModel, parts: list, rank0_weights: tuple[dict, dict] | None,
                           device: torch.device) -> None:
    """After parallelize: allocate this rank's shards and fill them from rank 0's whole model (None elsewhere), one
    tensor broadcast at a time; each rank keeps the tensors of its own stages (fsdp2_parallelize.load_from_rank0, per
    stage)."""
    state, buffers = rank0_weights or ({}, {})
    for part in parts:
        part.to_empty(device=device)
    names = [[(k, tuple(v.shape), v.dtype) for k, v in items.items()] for items in (state, buffers)]
    dist.broadcast_object_list(names, src=0)
    mine, full = set(model.state_dict()), {}
    for key, shape, dtype in names[0]:
        tensor = state[key].to(device) if state else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=0)
        if key in mine:
            full[key] = tensor
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))  # sharded on each mesh here
    for name, shape, dtype in names[1]:  # non-persistent buffers (rotary inv_freq) are in no state dict
        buffer = buffers[name].to(device) if buffers else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buffer, src=0)
        for part in parts:
            owned = dict(part.named_buffers())
            if name in owned:
                owned[name].copy_(buffer)
    rng = [torch.get_rng_state()]  # building on meta drew no random numbers: rank 0's generator, as DDP's ranks
    dist.broadcast_object_list(rng, src=0)
    torch.set_rng_state(rng[0])


def apply_fsdp_per_stage(parts: list, dp_mesh, reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy) -> None:
    """Each stage its own FSDP root over the dp mesh: its blocks first (one all-gather each), then the stage (its
    embedding, or final norm and head); the root is not resharded after forward, backward needs it first."""
    for part in parts:
        for i in part.blocks:
            fully_shard(part.model.layers[i], mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=mp_policy)
        fully_shard(part, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)


class PipelineEngine(FSDP2Engine):
    pipelined = True  # stages/base.Updater: the schedule runs the micro-batches (run_schedule)

    def __init__(self, model: torch.nn.Module, optim: OptimizerSpec | None, ctx: DistContext, precision: str,
                 dims: ParallelDims, *, schedule: str, virtual_stages: int, microbatches: int, seq_len: int,
                 micro_batch_size: int, reshard_after_forward: bool = True):
        if optim is None:
            raise ValueError("backend.pp > 1 pipelines trainable roles only (no frozen role is pipelined yet)")
        self.ctx, self.dims, self.optim_spec = ctx, dims, optim
        self.reshard_after_forward = reshard_after_forward
        data_mesh = dims.mesh("dp")
        self.dp_rank, self.dp_size, self.dp_group = data_mesh.get_local_rank(), data_mesh.size(), data_mesh.get_group()
        pp_mesh = dims.mesh("pp")
        self.pp_rank, self.pp_group = pp_mesh.get_local_rank(), pp_mesh.get_group()
        self.mixed_precision = ctx.device.type == "cuda" and precision == "bf16"
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.mixed_precision else MixedPrecisionPolicy()
        self.compute_dtype = None if self.mixed_precision else autocast_dtype(precision)
        self.mask_dtype = autocast_dtype(precision) or torch.float32  # run.batch_preparer's
        self.attn = model.config._attn_implementation
        self.inputs = StepInputs()
        # peft=lora: the stages are cut from the transformers model inside the PeftModel, its LoRA layers in place
        # (keys without peft's `base_model.model.` prefix); the export puts the whole PeftModel back together
        self.peft_config = copy.deepcopy(model.peft_config["default"]) if is_peft(model) else None
        model = unwrap_peft(model)
        on_meta = ranks_on_meta(model) if ctx.world_size > 1 else []
        rank0_weights = (model.state_dict(), dict(model.named_buffers())) if on_meta and ctx.is_main else None
        self.model_class = type(model)  # the export's empty whole model (a causal LM, or the reward model's)
        parts = build_parts(model, self.pp_rank, dims.pp, virtual_stages, seq_len, self.inputs,
                            log_split=ctx.is_main, v_shape=SCHEDULES[schedule].v_shape)
        del model  # the caller's reference goes with build_engines' frame: only this rank's copies stay
        for part in parts:  # the fixed order: tp, then fsdp (backends/fsdp2_parallelize.py says why), per stage
            to_meta(part) if on_meta else part.to(ctx.device)  # every rank parallelizes the same empty stages
            if dims.tp > 1:
                apply_tp_plan(part.model, dims.mesh("tp"), part.model.config)
        apply_fsdp_per_stage(parts, dims.mesh("fsdp"), reshard_after_forward, mp_policy)
        self.parts = parts
        self.model = self.module = RankModel(parts, parts[0].model.config)
        if on_meta:
            load_stages_from_rank0(self.model, parts, rank0_weights, ctx.device)
            del rank0_weights
        self.shapes = Shapes(micro_batch_size, seq_len, parts[0].model.config.hidden_size,
                             torch.bfloat16 if self.mixed_precision else torch.float32)
        # built on the first step, its buffers shaped by the stage's micro-batches (pairs: 2 rows per pair, or a row)
        self.schedule, self.schedule_name, self.micro_batch_size = None, schedule, micro_batch_size
        self.train_shapes: Shapes | None = None
        self.microbatches, self.loss_scale = microbatches, 1.0
        self.eval_schedule, self.eval_shapes = None, None  # forward only, built on the first evaluation
        groups = split_groups_by_mesh(param_groups(self.model, optim.weight_decay))
        self.optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                           fused=ctx.device.type == "cuda" or None)
        self.scheduler = build_scheduler(self.optimizer, optim)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=False)  # fp16 is refused under pp
        # Tied input and output embeddings: a copy on the first stage and one on the last, their gradients summed
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False)) and parts[0].head == "lm_head"
        self.tied_group = first_and_last_group(dims) if self.tied else None

    # ---- the step --------------------------------------------------------------------------------------------------
    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's summed loss of one micro-batch (1,) as this rank's share of the global mean; × dp because
        FSDP averages gradients over the dp ranks (backends/fsdp2.py)."""
        return output.sum() * self.loss_scale

    def run_schedule(self, micro_batches: list, micro_loss, inverse: float, share: float, size: int) -> torch.Tensor:
        """One schedule step over the micro-batches -> (size,) their summed (loss, mean term, *stats), every rank."""
        if len(micro_batches) != self.microbatches:
            raise ValueError(f"the pipeline was built for {self.microbatches} micro-batches (trainer.grad_accum_steps)"
                             f", this step has {len(micro_batches)}")
        if self.schedule is None:
            rows, width = micro_batch_shape(micro_batches[0], self.shapes.width, self.micro_batch_size)
            self.train_shapes = replace(self.shapes, rows=rows, width=width)
            self.schedule = build_schedule(self.parts, self.schedule_name, self.microbatches, self.ctx.device,
                                           self.pp_group, self._loss, self.train_shapes)
        self.inputs.micro_batches = self._padded(micro_batches, self.train_shapes)
        self.inputs.micro_loss, self.inputs.sums, self.inputs.forward_only = micro_loss, [], False
        self.loss_scale = inverse * self.dp_size
        rows = self.train_shapes.rows
        ids = torch.cat([rows_of(b).input_ids for b in self.inputs.micro_batches])  # (M·b, W)
        index = torch.arange(len(micro_batches), device=ids.device).repeat_interleave(rows)  # (M·b,)
        targets = index.clone()  # the last stage reads its labels from its own copy of the batch
        with self.autocast():
            if any(part.is_first for part in self.parts):
                self.schedule.step(ids, index, target=targets, return_outputs=False)
            else:
                self.schedule.step(target=targets, return_outputs=False)
        totals = torch.zeros(size, device=self.ctx.device)
        for sums in self.inputs.sums:
            totals += sums
        self.inputs.micro_batches, self.inputs.sums = [], []
        self._sum_tied_grads()
        return all_reduce_sum(totals, self.pp_group)  # only the last stage's rank holds them

    def _padded(self, micro_batches: list, shapes: Shapes) -> list:
        """The micro-batches padded to the stage buffers' (rows, width); one that does not fit is an error."""
        sizes = [tuple(rows_of(b).input_ids.shape) for b in micro_batches]
        if any(rows > shapes.rows or width > shapes.width for rows, width in sizes):
            raise ValueError(f"micro-batches of {sizes} tokens do not fit the pipeline's buffers "
                             f"({shapes.rows}, {shapes.width})")
        return [pad_micro_batch(b, shapes.rows, shapes.width, self.attn, self.mask_dtype) for b in micro_batches]

    def _sum_tied_grads(self) -> None:
        """The embedding's gradient (first stage) + the head's (last stage), on both: one weight's gradient, so both
        copies take the same update and stay equal."""
        if self.tied_group is None:
            return
        for name, param in self.model.named_parameters():
            if name in TIED_NAMES and param.grad is not None:
                grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad  # this dp shard
                dist.all_reduce(grad, group=self.tied_group)

    @torch.no_grad()
    def evaluate_sums(self, batches, micro_sums, size: int) -> torch.Tensor:
        """Forward only, batch by batch through the stages (one micro-batch each) -> (size,) fp64 the sums of
        `micro_sums(module, batch) -> (size,)` over the batches, computed on the last stage, on every rank."""
        self.module.eval()
        totals = torch.zeros(size, dtype=torch.float64, device=self.ctx.device)
        for batch in batches:
            shapes = self._eval_shapes(batch)
            self.inputs.micro_batches = self._padded([batch], shapes)
            self.inputs.micro_loss, self.inputs.sums, self.inputs.forward_only = micro_sums, [], True
            ids = rows_of(self.inputs.micro_batches[0]).input_ids  # (b, W)
            index = torch.zeros(shapes.rows, dtype=torch.long, device=self.ctx.device)  # (b,)
            with self.autocast():
                if any(part.is_first for part in self.parts):
                    self.eval_schedule.step(ids, index, return_outputs=False)
                else:
                    self.eval_schedule.step(return_outputs=False)
            for sums in self.inputs.sums:
                totals += sums
        self.inputs.micro_batches, self.inputs.sums, self.inputs.forward_only = [], [], False
        return all_reduce_sum(totals, self.pp_group)

    def _eval_shapes(self, batch) -> Shapes:
        """The evaluation stages' shapes: for the first batch's examples (trainer.eval_batch_size; a shorter last
        batch is padded)."""
        if self.eval_schedule is None:
            rows, width = micro_batch_shape(batch, self.shapes.width)
            shapes = replace(self.shapes, rows=rows, width=width)
            self.eval_schedule = build_schedule(self.parts, self.schedule_name, 1, self.ctx.device, self.pp_group, None,
                                                shapes)  # forward only, in the training schedule's stage placement
            self.eval_shapes = shapes
        return self.eval_shapes

    @contextlib.contextmanager
    def no_sync(self, is_last_micro_batch: bool):
        raise RuntimeError("backend.pp > 1: the pipeline schedule runs the micro-batches (run_schedule)")
        yield  # pragma: no cover

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError("backend.pp > 1: the pipeline schedule runs backward (run_schedule)")

    def clip_or_fused_step(self) -> torch.Tensor:
        """The whole model's gradient norm: this rank's stages' (dp shards reduced), squared, summed over pp."""
        grads = [p.grad for name, p in self.model.named_parameters()
                 if p.grad is not None and not (self.tied and name == TIED_NAMES[1])]  # a tied weight counts once
        self._measure_after_step(grads)
        local = total_grad_norm(grads) if grads else torch.zeros((), device=self.ctx.device)
        norm = all_reduce_sum(local.double().pow(2).reshape(1), self.pp_group).sqrt()[0].to(local.dtype)
        clip_to_norm(self.model, self.optim_spec.max_grad_norm, norm)
        return norm

    @contextlib.contextmanager
    def generation_context(self):
        raise RuntimeError("backend.pp > 1: no generation through the pipeline (PPO/GRPO refuse pp)")
        yield  # pragma: no cover

    # ---- checkpoints: FSDP2's DCP layout, keys of the whole model -------------------------------------------------
    def load_checkpoint(self, directory: Path) -> None:
        """As fsdp2 loads; with tied embeddings the last stage's head copy reads the embedding's entries (a
        one-process checkpoint holds the tied weight and its Adam state once, under the embedding's name)."""
        if not (self.tied and any(part.is_last for part in self.parts)):
            return super().load_checkpoint(directory)
        options = self._dcp_options()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": _renamed(model_sd, *TIED_NAMES[::-1]), "optimizer": _renamed(optim_sd, *TIED_NAMES[::-1])}
        dcp.load(state, checkpoint_id=directory / "dcp")
        set_state_dict(self.model, self.optimizer, model_state_dict=_renamed(state["model"], *TIED_NAMES),
                       optim_state_dict=_renamed(state["optimizer"], *TIED_NAMES), options=options)
        self._load_scheduler(directory)

    # ---- export: every stage's full tensors, gathered to rank 0 -------------------------------------------------
    def export_hf(self, directory: Path) -> None:
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))  # over dp
        mine = {k: v.detach().cpu() for k, v in state.items()} if self.dp_rank == 0 else {}
        gathered = [None] * dist.get_world_size() if self.ctx.is_main else None
        dist.gather_object(mine, gathered, dst=0)
        if self.ctx.is_main:
            model = self._whole_model()
            # under peft=lora the stages' keys are the transformers model's, inside the PeftModel under a prefix
            prefix = next(f"{name}." for name, module in model.named_modules() if module is unwrap_peft(model)) \
                if is_peft(model) else ""
            save_hf(model, {prefix + k: v for part in gathered for k, v in part.items()}, directory)

    def _whole_model(self) -> torch.nn.Module:
        """An empty model of the whole architecture (meta), inside a PeftModel under peft=lora: save_hf writes the
        gathered tensors with it (the adapters and the merged model through models/lora.save_adapter_and_merged)."""
        with torch.device("meta"):
            model = self.model_class._from_config(self.model.config)
            if self.peft_config is None:
                return model
            from peft import get_peft_model

            return get_peft_model(model, copy.deepcopy(self.peft_config))


class FSDP2PipelineBackend(FSDP2Backend):
    """The fsdp2 backend (its registered engine), with pipeline stages when backend.pp > 1 (a PipelineEngine; rank 0
    builds the whole model, the others on meta, as under fsdp2); with pp = 1 it is FSDP2Backend exactly."""

    def __init__(self, ctx: DistContext, precision: str, options: dict | None = None):
        super().__init__(ctx, precision, options)
        options = options or {}
        run = options.get("run", {})
        self.pipeline = {"schedule": options.get("pp_schedule", "1f1b"),
                         "virtual_stages": options.get("pp_virtual_stages", 1),
                         "microbatches": run.get("grad_accum_steps", 1), "seq_len": run.get("max_seq_len", 2048),
                         "micro_batch_size": run.get("micro_batch_size", 1)}

    def wrap(self, model: torch.nn.Module, optim: OptimizerSpec | None) -> FSDP2Engine:
        if self.dims.pp == 1:
            return super().wrap(model, optim)
        # pp last in the fixed order (tp → sp → ac → compile → fsdp → pp): see the module docstring
        return PipelineEngine(model, optim, self.ctx, self.precision, self.dims, **self.pipeline,
                              reshard_after_forward=self.settings.get("reshard_after_forward", True))
