"""The Stage seam: what a stage names (roles, batch, step, eval, state), and the one update helper.

A Stage owns its maths; the trainer owns the loop (fetching, timing, logging, evaluating, saving) and
knows no loss. A stage never imports a backend: it sees Engines (`backends/base.py`).

- `roles`: name -> RoleSpec (where the weights come from, which head, trainable or frozen). The run
  builds one Engine per role with the run's backend: trainable roles get an optimizer, frozen ones are
  `wrap(model, None)`. All roles share one ParallelDims, so they read the same examples on a rank.
- `collate(examples) -> batch`: the stage's batch type; it has `.to(device)` and `.for_attention(...)`.
- `train_step(micro_batches, engines, updater) -> metrics`: one optimizer step of every trainable role,
  each through `Updater.update` (forward/backward/no-sync over the micro-batches, the global
  normalisation, clipping, the non-finite rule).
- `evaluate(batches, engines) -> metrics` (keys start with `eval_`), over every held-out example once.
- `state_dict()` / `load_state_dict()`: what the stage itself carries from step to step (a KL
  controller, the last eval's reward statistics); saved as `stage.json`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import torch

from llmtrain.distributed import all_reduce_sum
from llmtrain.metrics.timing import NoClock

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    pass


@dataclass(frozen=True)
class ModelSource:
    """Where a role's weights come from (plain values from `model.*`, or a stage's own field)."""
    name_or_path: str | None
    from_config: dict | None = None
    config_path: str | None = None
    trust_remote_code: bool = False


@dataclass(frozen=True)
class RoleSpec:
    source: ModelSource
    head: str = "lm"  # "lm": next-token logits; "scalar": one score per token (models/load.py HEADS)
    trainable: bool = True
    lr: float | None = None  # this role's peak lr (PPO's actor and critic); None: optim.lr
    # Under peft=lora this frozen role is the named trainable role's model with its adapters disabled: no second
    # copy of the base (backends/adapter_off.py). Without LoRA the role is built from `source` as usual.
    adapter_off_of: str | None = None


class Stage(Protocol):
    """Stages subclass this: the methods with a body are optional hooks with their default."""
    name: str
    roles: dict[str, RoleSpec]
    count_name: str  # what the update normalises by: "tokens" (target tokens) or "pairs"

    def collate(self, examples: list[dict]): ...
    def train_step(self, micro_batches: list, engines: dict, updater: Updater) -> dict: ...
    def evaluate(self, batches: Iterable, engines: dict) -> dict: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # Set by the trainer: the next batch of this rank's data stream, beyond the step's own fetches (PPO's dynamic
    # sampling draws more prompts with it, every rank together); data_position then counts what it drew.
    fetch_more: Callable[[], object] | None = None

    def prepare(self, engines: dict, data, prepare_batch: Callable) -> dict:
        """Once, after the engines are built and before the first step (a resumed run too): work over the whole data
        (DPO's precomputed reference log-probs). Returns the engines training keeps (a role it no longer needs
        dropped). `data`: the stage's train/eval examples; `prepare_batch`: a collated batch -> on the device."""
        return engines

    def close(self) -> None:
        """At the end of the run, also after a failure: stop what the stage started (PPO's inference server)."""

    def data_position(self, step: int) -> int:
        """Where the data stream resumes after `step` steps, in steps' worth of fetches (the sampler's index)."""
        return step

    def fetch_layout(self, micro_batch_size: int, grad_accum_steps: int, dp_size: int) -> tuple[int, int]:
        """(examples per fetch, fetches per step) on each rank (PPO: one fetch of the rank's share of prompts)."""
        return micro_batch_size, grad_accum_steps

    def optimizer_steps_per_step(self) -> int:
        """Optimizer steps in one trainer step (PPO: epochs × mini-batches); the lr schedule counts them."""
        return 1

    def export_config(self, role: str) -> dict:
        """What the stage adds to a role's exported config.json (a reward model's reward mean/std)."""
        return {}


# A micro-batch's summed loss (0-d, with grad) and the sums of its statistics ((K,), detached); optionally a third,
# a term averaged over the step's micro-batches and ranks (0-d, with grad: the MoE routers' coef × aux loss).
MicroLoss = Callable[[torch.nn.Module, object], tuple[torch.Tensor, ...]]


@dataclass
class StepResult:
    loss: float  # the global mean: Σ loss over every micro-batch of every rank / the global count (+ the mean term)
    grad_norm: float  # before clipping
    lr: float  # the lr this step used
    count: int  # the global count the loss is normalised by (target tokens, pairs, ...)
    sums: list[float]  # the statistics' sums over the global batch, in the order the MicroLoss gives them
    applied: bool  # False: a non-finite step was skipped


class Updater:
    """One optimizer step of one engine over its micro-batches, the same for every stage and role.

    The loss of a step is Σ(per-example loss) over every micro-batch on every rank divided by the global
    count (target tokens for LM, pairs for RM/DPO, action tokens for PPO), counted on the host before the
    first forward: not a mean of per-micro-batch means. A non-finite loss or grad norm stops every rank
    together (NonFiniteError) or, with `skip_nonfinite`, skips the update; both values are reduced over
    all ranks, so every rank takes the same branch. A loss spike (trainer.spike, llmtrain/spikes.py) may skip it too.
    """

    def __init__(self, device: torch.device, skip_nonfinite: bool, skipped_steps: int = 0):
        self.device, self.skip_nonfinite, self.skipped_steps = device, skip_nonfinite, skipped_steps
        self.step = 0  # the optimizer step being taken (1-based), set by the trainer: named in errors
        self.clock = NoClock()  # the trainer's StepClock (metrics/timing.py): the optimizer's share of the step
        self.spikes = None  # a SpikeMonitor (llmtrain/spikes.py) under trainer.spike, set by the trainer

    def update(self, engine, micro_batches: Sequence, micro_loss: MicroLoss, local_count: float,
               num_stats: int = 0) -> StepResult:
        engine.module.train()
        global_count = int(all_reduce_sum(torch.tensor([float(local_count)], dtype=torch.float64,
                                                       device=self.device), engine.dp_group).item())
        inverse = 1.0 / max(global_count, 1)  # nothing to learn from: loss 0, gradient 0, never NaN
        # A mean term (MoE aux loss, computed per forward as transformers does) is averaged over every micro-batch of
        # every rank: each weighs 1 / (micro-batches × dp × sp) (backends sum gradients over ranks, as for the loss
        # sum; an sp rank's forward sees its shard of the rows).
        share = 1.0 / (len(micro_batches) * engine.dp_size * getattr(engine, "sp_size", 1))
        totals = torch.zeros(2 + num_stats, device=self.device)  # loss sum, mean-term sum, the statistics' sums
        if getattr(engine, "pipelined", False):  # a pipeline schedule runs every micro-batch (backends/pipeline.py)
            totals += engine.run_schedule(micro_batches, micro_loss, inverse, share, totals.numel())
        else:
            for i, batch in enumerate(micro_batches):
                with engine.no_sync(is_last_micro_batch=i == len(micro_batches) - 1):
                    with engine.autocast():
                        loss_sum, stats, *mean_term = micro_loss(engine.module, batch)
                    term = mean_term[0] if mean_term else loss_sum.new_zeros(())
                    engine.backward(loss_sum * inverse + term * share)
                totals += torch.cat([loss_sum.detach().float().reshape(1), term.detach().float().reshape(1),
                                     stats.detach().float().reshape(-1)])
        totals = all_reduce_sum(totals, engine.dp_group)
        self.clock.enter("optim")  # clipping, the optimizer step and the one sync: left before the return
        lr = engine.current_lr()  # this step's lr: read before clip_or_fused_step (DeepSpeed updates there)
        values = to_host(*totals, engine.clip_or_fused_step())  # one device sync for all of them
        loss, sums, grad_norm = values[0] * inverse + values[1] * share, values[2:-1], values[-1]
        applied = math.isfinite(loss) and (math.isfinite(grad_norm) or engine.skips_nonfinite_grads)
        if applied and self.spikes is not None and not self.spikes.accept(loss, grad_norm):
            applied = False
            engine.skip_step()  # a spike under trainer.spike.policy=skip or rollback (llmtrain/spikes.py)
        elif applied:
            engine.step()
        else:
            self._nonfinite(engine, loss, grad_norm)
        self.clock.leave()
        return StepResult(loss, grad_norm, lr, global_count, sums, applied)

    def _nonfinite(self, engine, loss: float, grad_norm: float) -> None:
        step = self.step
        if not self.skip_nonfinite:
            raise NonFiniteError(
                f"step {step}: loss={loss} grad_norm={grad_norm} is not finite; all ranks stop here. "
                "Lower optim.lr, check the data, or set trainer.skip_nonfinite=true to skip such steps")
        self.skipped_steps += 1
        log.warning("step %d: loss=%s grad_norm=%s not finite, step skipped (%d so far)",
                    step, loss, grad_norm, self.skipped_steps)
        engine.skip_step()


def to_host(*scalars: torch.Tensor) -> list[float]:
    """0-d tensors as floats, with one device sync for all of them (fp32 -> fp64 is exact)."""
    device = scalars[0].device
    return torch.stack([scalar.detach().to(device, torch.float64) for scalar in scalars]).tolist()


def reduce_sums(values: list[torch.Tensor], engine) -> list[float]:
    """Per-rank sums (0-d tensors) summed over the data-parallel ranks, in fp64, fetched with one sync."""
    stacked = torch.stack([v.detach().double() for v in values])
    return all_reduce_sum(stacked, engine.dp_group).tolist()


def eval_totals(engine, batches: Iterable, batch_sums: Callable, size: int) -> list[float]:
    """Σ over the batches of `batch_sums(module, batch) -> (size,)` fp64, summed over the data-parallel ranks. A
    pipelined engine (backend.pp > 1) runs each batch through its stages and computes the sums on the last stage."""
    if getattr(engine, "pipelined", False):
        sums = engine.evaluate_sums(batches, batch_sums, size)
    else:
        sums = torch.zeros(size, dtype=torch.float64, device=engine.ctx.device)
        for batch in batches:
            with engine.autocast():
                sums += batch_sums(engine.module, batch)
    return reduce_sums(list(sums), engine)


def trainable_roles(roles: dict[str, RoleSpec]) -> list[str]:
    return [name for name, spec in roles.items() if spec.trainable]
