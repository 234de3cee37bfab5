"""PPO / GRPO in the planner: what one iteration (one trainer step) communicates on each rank.

An iteration is not one optimizer step: the actor generates (ZeRO-3 and FSDP2 gather its weights once for it),
every role runs a no-grad forward over the rollout (the experience), then the actor and the critic each take
`ppo.epochs × mini-batches` optimizer steps. metrics/cost.py's single-step formulas are applied to each part.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmtrain.metrics.cost import Collective, RoleParams, communication
from llmtrain.metrics.flops import training_flops_per_token
from llmtrain.stages.registry import stage_spec


@dataclass(frozen=True)
class RLSchedule:
    """One iteration on each rank, in micro-batches."""
    updates: int  # optimizer steps of each trainable role (epochs × mini-batches)
    update_micro: int  # micro-batches per optimizer step
    experience_micro: int  # micro-batches of the experience forwards (the whole rollout's share)
    actor_experience: bool  # False: on-policy GRPO takes the old log-probs from the update's own forward


@dataclass(frozen=True)
class RLIteration:
    """The config's numbers that shape an iteration."""
    samples: int  # sequences generated per iteration, global
    mini_batch: int  # sequences per optimizer step, global
    epochs: int
    micro: int  # sequences per micro-batch on a rank
    on_policy: bool  # the update's forward gives the old log-probs (stages/ppo/build.old_logps_from_update)

    @classmethod
    def from_config(cls, cfg) -> RLIteration | None:
        """None for the stages whose step is one optimizer step."""
        shape_of = stage_spec(cfg.stage.name).rl_shape
        if shape_of is None:
            return None
        shape = shape_of(cfg)
        return cls(samples=shape.samples, mini_batch=shape.mini_batch, epochs=shape.epochs, micro=shape.micro,
                   on_policy=shape.on_policy)

    @property
    def updates(self) -> int:
        """Optimizer steps of each trainable role per iteration (epochs × mini-batches)."""
        return self.epochs * (self.samples // self.mini_batch)

    def schedule(self, dp: int) -> RLSchedule:
        def micro_batches(sequences: int) -> int:
            share = -(-sequences // dp)  # this rank's share of the sequences (ceil)
            return -(-share // self.micro)  # ... in micro-batches (ceil)

        return RLSchedule(updates=self.updates,
                          update_micro=micro_batches(self.mini_batch), experience_micro=micro_batches(self.samples),
                          actor_experience=not self.on_policy)


def rl_flops(it: RLIteration, roles: dict[str, bool], params: int, layers: int, hidden: int, seq: int) -> float:
    """Model FLOPs of one iteration over all ranks (sequences of `seq` tokens, the upper bound): generation (a
    forward per new token with the KV cache: 2·M + 4·L·h·s each; the prompt's prefill counted as forward tokens),
    the experience forwards of every role, and each trainable role's updates (6·M + 12·L·h·s per token, epochs
    times)."""
    forward = training_flops_per_token(params, layers, hidden, seq) / 3
    experienced = sum(1 for role, trainable in roles.items() if not trainable or role != "actor" or not it.on_policy)
    generation = it.samples * seq * forward
    experience = experienced * it.samples * seq * forward
    updates = sum(roles.values()) * it.epochs * it.samples * seq * 3 * forward
    return generation + experience + updates


def forward_only(role: RoleParams) -> RoleParams:
    """A trainable role's no-grad forward moves its weights as a frozen role's does."""
    return replace(role, trainable=0, frozen=role.trainable + role.frozen, regathered=None)


def rl_communication(roles: dict[str, tuple[RoleParams, bool]], layout, precision: str, schedule: RLSchedule,
                     **shape) -> list[Collective]:
    """Collectives of one iteration: `roles` {name: (parameters, trainable)}; `shape`: communication's
    tokens_per_micro, hidden, layers, checkpointing, on_gpu."""
    out = []
    for name, (params, trainable) in roles.items():
        if trainable:
            # ZeRO-3 keeps a block gathered for its backward only while the forward trace it recorded holds; the
            # generation and experience forwards between updates break it, so every backward gathers again
            # (measured: tests/dist/test_ppo.py). Only ZeRO-3's figures have a `regathered` (backend.gathers).
            updated = replace(params, regathered=None)
            out += [replace(c, what=f"{name} update: {c.what}", times=c.times * schedule.updates)
                    for c in communication(updated, layout, precision, accum=schedule.update_micro, **shape)]
        if not trainable or name != "actor" or schedule.actor_experience:
            out += [replace(c, what=f"{name} experience: {c.what}")
                    for c in communication(forward_only(params), layout, precision, accum=schedule.experience_micro,
                                           **shape) if c.payload]
    if layout.stage == 3 and "actor" in roles:  # ZeRO-3 / FSDP2 gather the actor whole once and generate from it
        out += [replace(c, what="actor generation: weights", times=1)
                for c in communication(forward_only(roles["actor"][0]), layout, precision, accum=1, **shape)
                if c.kind == "all_gather"]
    return out
