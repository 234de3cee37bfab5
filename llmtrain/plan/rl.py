"""PPO / GRPO in the planner: what one iteration (one trainer step) communicates on each rank, and the inference
engine's memory beside the training roles'.

An iteration is not one optimizer step: the actor generates (ZeRO-3 and FSDP2 gather its weights once for it),
every role runs a no-grad forward over the rollout (the experience), then the actor and the critic each take
`ppo.epochs × mini-batches` optimizer steps. metrics/cost.py's single-step formulas are applied to each part.

With `ppo.rollout.engine=vllm` the rollout is sampled by vLLM servers (`EngineSetup`): their weights, the KV cache
the iteration's sequences need and the budget `gpu_memory_utilization` gives them (`EngineMemory`), per engine GPU,
and on a GPU shared with the trainer (colocated) the peak of both (`colocated_peak`). Nothing here imports or
contacts the engine: the figures come from the config and the model's config.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from llmtrain.config import ConfigError
from llmtrain.metrics.cost import GIB, Collective, RoleParams, communication
from llmtrain.metrics.devices import Gpu
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


# ---- the inference engine (ppo.rollout.engine=vllm) ---------------------------------------------------------------

ENGINE_BLOCK_TOKENS = 16  # vLLM's KV cache block on CUDA (--block-size): a sequence holds whole blocks
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # the run's precision -> the engine's weight dtype
VLLM_DTYPES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}  # --dtype (auto: the run's)


def engine_arg(args, *names: str) -> str | None:
    """The value of the last of `names` in a server's argument list (`--name VALUE` or `--name=VALUE`), else None."""
    value, args = None, [str(a) for a in args]
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def engine_int(value: str, where: str) -> int:
    """An integer server argument, with vLLM's suffixes: k, m (10³, 10⁶) and K, M (2¹⁰, 2²⁰): 32k, 40K."""
    scale = {"k": 1000, "m": 1000 ** 2, "K": 1024, "M": 1024 ** 2}.get(value[-1:], 1)
    try:
        return int(float(value[:-1] if scale > 1 else value) * scale)
    except ValueError:
        raise ConfigError(f"{where}: not a whole number (the planner reads it)") from None


def vllm_batch_defaults(gpu: Gpu) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of vLLM's API server when the args leave them out: 8192 and 1024 on a
    GPU of 70 GiB or more that is not an A100 (H100, H200), else 2048 and 256 (vLLM's EngineArgs.get_batch_defaults)."""
    big = gpu.memory_gib >= 70 and "a100" not in gpu.name.lower()
    return (8192, 1024) if big else (2048, 256)


@dataclass(frozen=True)
class EngineSetup:
    """ppo.rollout.engine=vllm as the planner sees it (`engine_setup`)."""
    colocated: bool  # on the training GPUs: sleep=true, or the server llmtrain starts itself (vllm.python, no urls)
    sleep: bool  # colocated: its memory is freed while the trainer updates (/sleep), taken again to sample
    servers: int  # len(ppo.rollout.vllm.urls); 1: the one llmtrain starts
    tp: int  # --tensor-parallel-size / -tp (1)
    dp: int  # --data-parallel-size / -dp (1): engine replicas inside one server
    utilization: float  # gpu_memory_utilization: the share of each engine GPU vLLM takes
    weight_bytes: int  # the run's precision (--dtype overrides): bf16 2, fp32 4
    kv_bytes: int  # the weights' (--kv-cache-dtype fp8*: 1)
    max_num_seqs: int | None = None  # --max-num-seqs; None: vLLM's default for the GPU (vllm_batch_defaults)
    max_batched_tokens: int | None = None  # --max-num-batched-tokens; None: vLLM's default for the GPU
    max_model_len: int | None = None  # --max-model-len (the server llmtrain starts: data.max_seq_len); None: the
    #                                   model's max_position_embeddings
    block: int = ENGINE_BLOCK_TOKENS

    @property
    def replicas(self) -> int:
        """Engines that split the iteration's sequences: servers × their data-parallel replicas."""
        return self.servers * self.dp

    @property
    def gpus(self) -> int:
        return self.replicas * self.tp

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "server"


def engine_setup(cfg, precision: str) -> EngineSetup | None:
    """The engine of an RL stage whose rollout node says `engine: vllm` (the stage's config node, `ppo.rollout`);
    None for the training model's own sampling (engine=hf) and for every other stage."""
    from llmtrain.stages.registry import stage_spec

    spec = stage_spec(cfg.stage.name)
    node = cfg.get(spec.config_node) if spec.rl_shape is not None and spec.config_node else None
    rollout = node.get("rollout") if node is not None else None
    if rollout is None or rollout.get("engine", "hf") != "vllm":
        return None
    v, args = rollout.vllm, list(rollout.vllm.args)

    def number(*names: str) -> int | None:
        value = engine_arg(args, *names)
        return None if value is None else engine_int(value, f"ppo.rollout.vllm.args: {names[0]} {value}")

    weight = VLLM_DTYPES.get(str(engine_arg(args, "--dtype")).lower(), WEIGHT_BYTES.get(precision, 4))
    kv_dtype = str(engine_arg(args, "--kv-cache-dtype") or "auto").lower()
    return EngineSetup(colocated=bool(v.sleep) or not v.urls, sleep=bool(v.sleep), servers=max(len(v.urls), 1),
                       tp=number("--tensor-parallel-size", "-tp") or 1, dp=number("--data-parallel-size", "-dp") or 1,
                       utilization=float(v.gpu_memory_utilization), weight_bytes=weight,
                       kv_bytes=1 if kv_dtype.startswith("fp8") else weight,
                       max_num_seqs=number("--max-num-seqs"), max_batched_tokens=number("--max-num-batched-tokens"),
                       # the server llmtrain starts gets --max-model-len data.max_seq_len (engines/vllm_server.py)
                       max_model_len=number("--max-model-len") or (None if v.urls else cfg.data.max_seq_len),
                       block=number("--block-size") or ENGINE_BLOCK_TOKENS)


@dataclass(frozen=True)
class EngineModel:
    """What the engine's memory depends on in the model (its config.json; the engine samples the actor)."""
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int | None = None


def engine_model(cfg, facts) -> EngineModel:
    """The actor's sizes for the engine: the planner's counts (`ModelFacts`) and the head dimension of its config
    (Qwen3 and Gemma set one apart from hidden / heads)."""
    from llmtrain.models.load import model_config

    m = cfg.model
    arch = model_config(m.name_or_path, m.from_config, m.config_path, m.trust_remote_code)
    head_dim = getattr(arch, "head_dim", None) or facts.hidden // facts.heads
    return EngineModel(params=facts.params, layers=facts.layers, hidden=facts.hidden, heads=facts.heads,
                       kv_heads=facts.kv_heads, head_dim=head_dim, intermediate=facts.intermediate or 4 * facts.hidden,
                       vocab=facts.vocab, max_positions=facts.max_positions)


@dataclass(frozen=True)
class EngineMemory:
    """Bytes on one engine GPU (`engine_memory`)."""
    weights: float  # M·w/t
    activations: float  # vLLM's profile run: a forward of its token budget and the sampler over max_num_seqs
    kv_per_token: float  # 2·L·⌈kv/t⌉·d·w_kv
    tokens: int  # one sequence: prompt + new tokens (data.max_seq_len), rounded up to whole blocks
    sequences: int  # in flight on one engine replica: ⌈prompts × samples / replicas⌉
    budget: float  # u·G: what vLLM takes of the GPU
    max_num_seqs: int  # R: vLLM runs at most this many sequences at once
    batched_tokens: int  # T: vLLM's token budget per forward (its profile run's size)
    max_model_len: int  # vLLM refuses to start unless one sequence this long fits its KV cache space

    @property
    def kv_per_sequence(self) -> float:
        return self.kv_per_token * self.tokens

    @property
    def kv_needed(self) -> float:
        """The KV cache of every sequence of the iteration at once."""
        return self.kv_per_sequence * self.sequences

    @property
    def kv_space(self) -> float:
        """What vLLM reserves for the KV cache: its budget less the weights and the profile run's activations."""
        return max(self.budget - self.weights - self.activations, 0.0)

    @property
    def fits(self) -> bool:
        return self.kv_needed <= self.kv_space

    @property
    def at_once(self) -> int:
        """Sequences of `tokens` whose KV cache fits the space at once (memory only: max_num_seqs caps it too)."""
        return int(self.kv_space // self.kv_per_sequence)

    @property
    def starts(self) -> bool:
        """vLLM starts only when one sequence of max_model_len fits its KV cache space."""
        return self.kv_per_token * self.max_model_len <= self.kv_space


def engine_memory(model: EngineModel, setup: EngineSetup, gpu: Gpu, *, samples: int, seq: int) -> EngineMemory:
    """Per engine GPU. tp t splits the weights and the KV heads (⌈kv/t⌉: vLLM repeats a KV head when t > kv); the
    profile run's activations, per token of the token budget T: the residual stream and norms 4h, q/k/v (a + 2kv)·d/t,
    the MLP's gate/up and their product 3i/t, in the weights' dtype; the sampler's fp32 logits and probabilities over
    max_num_seqs R rows, 2·R·V·4."""
    tp, w = setup.tp, setup.weight_bytes
    tokens_budget, max_seqs = vllm_batch_defaults(gpu)
    tokens_budget = setup.max_batched_tokens or tokens_budget
    max_seqs = setup.max_num_seqs or max_seqs
    per_token = (4 * model.hidden + (model.heads + 2 * model.kv_heads) * model.head_dim / tp
                 + 3 * model.intermediate / tp)
    activations = tokens_budget * per_token * w + 2 * max_seqs * model.vocab * 4
    kv_per_token = 2 * model.layers * math.ceil(model.kv_heads / tp) * model.head_dim * setup.kv_bytes
    return EngineMemory(weights=model.params * w / tp, activations=activations, kv_per_token=kv_per_token,
                        tokens=math.ceil(seq / setup.block) * setup.block,
                        sequences=math.ceil(samples / setup.replicas), budget=setup.utilization * gpu.memory_gib * GIB,
                        max_num_seqs=max_seqs, batched_tokens=tokens_budget,
                        max_model_len=setup.max_model_len or model.max_positions or seq)


def engine_utilization_needed(mem: EngineMemory, gpu: Gpu) -> float:
    """The gpu_memory_utilization at which every sequence in flight fits the KV cache at once: (weights +
    activations + KV needed) / G."""
    return (mem.weights + mem.activations + mem.kv_needed) / (gpu.memory_gib * GIB)


def colocated_peak(training_peak: float, training_states: float, engine_budget: float, sleep: bool) -> float:
    """One GPU shared by a training rank and the engine. Without sleep the engine holds its budget throughout: the
    sum. With sleep the engine frees it while the trainer updates and takes it again to sample, while the trainer's
    model states (weights, gradients, optimizer: everything but activations) stay: max(training peak, states + budget).
    """
    if not sleep:
        return training_peak + engine_budget
    return max(training_peak, training_states + engine_budget)


def colocated_utilization(training_peak: float, training_states: float, memory: float, usable: float,
                          sleep: bool) -> float:
    """The largest gpu_memory_utilization whose colocated peak stays within usable × memory (0: none)."""
    if training_peak > usable * memory:  # the training rank alone does not fit
        return 0.0
    room = usable * memory - (training_states if sleep else training_peak)
    return max(room / memory, 0.0)


def _gib(value: float) -> str:
    return f"{value / GIB:.3g}"


def engine_lines(setup: EngineSetup, mem: EngineMemory, gpu: Gpu, rows, usable: float) -> list[str]:
    """The planner's engine section: `rows` [(backend, training bytes on a GPU, its model states)] for the colocated
    verdict of each backend of the table."""
    awake = "sleeps while the trainer updates" if setup.sleep else "no sleep: awake throughout"
    where = f"shared with training ranks ({awake})" if setup.colocated else "of its own"
    servers = f"{setup.servers} server{'s' if setup.servers > 1 else ''}"
    tokens = f"{mem.tokens:,} tokens (prompt + new, in {setup.block}-token blocks)"
    queued = (f"; vLLM runs at most max_num_seqs={mem.max_num_seqs} at once, the rest wait"
              if mem.sequences > mem.max_num_seqs else "")
    kv = (f"fits ({mem.at_once:,} such sequences fit at once{queued})" if mem.fits else
          f"does NOT fit: {mem.at_once:,} of the {mem.sequences:,} at once, the rest wait for a free slot "
          f"(more tp, more engines or a higher gpu_memory_utilization){queued}")
    lines = [
        f"engine: vLLM {setup.mode}, {servers} × dp {setup.dp} × tp {setup.tp} = {setup.gpus} GPU(s) {where}, "
        f"{gpu.name} ({gpu.memory_gib:.1f} GiB), weights {8 * setup.weight_bytes}-bit, "
        f"gpu_memory_utilization {setup.utilization:g}",
        f"engine per GPU, GiB: weights M·w/t {_gib(mem.weights)}, activations {_gib(mem.activations)} (profile run, "
        f"T={mem.batched_tokens} tokens, R={mem.max_num_seqs} sequences: T·(4h + (a+2kv)·d/t + 3i/t)·w + 2·R·V·4), "
        f"budget u·G {_gib(mem.budget)}, KV cache space = budget − weights − activations {_gib(mem.kv_space)}",
        f"engine KV cache 2·L·⌈kv/t⌉·d·w = {mem.kv_per_token / 1024:.3g} KiB per token per GPU; "
        f"{mem.sequences:,} sequences in flight per engine (prompts × samples / {setup.replicas} engine(s)) × "
        f"{tokens} need {_gib(mem.kv_needed)} GiB: {kv}; all at once need gpu_memory_utilization ≥ "
        f"{math.ceil(engine_utilization_needed(mem, gpu) * 100) / 100:.2f}",
        f"engine: max_model_len {mem.max_model_len:,} needs {_gib(mem.kv_per_token * mem.max_model_len)} GiB of KV "
        "cache for one sequence: " + ("vLLM starts" if mem.starts else
                                       "vLLM refuses to start (pass --max-model-len to ppo.rollout.vllm.args)"),
    ]
    memory = gpu.memory_gib * GIB
    if not setup.colocated:
        lines.append(f"engine GPUs hold the engine alone: {_gib(mem.budget)} of {gpu.memory_gib:.1f} GiB each; the "
                     "training table above is the training GPUs'")
        return lines
    rule = "max(training peak, model states + engine budget)" if setup.sleep else "training peak + engine budget"
    for name, training, states in rows:
        peak = colocated_peak(training, states, mem.budget, setup.sleep)
        most = colocated_utilization(training, states, memory, usable, setup.sleep)
        verdict = "fits" if peak <= usable * memory else "does NOT fit"
        lines.append(f"{name} + engine on each of the engine's GPUs: {rule} = {_gib(peak)} of {gpu.memory_gib:.1f} "
                     f"GiB ({usable:.0%} usable): {verdict}; the largest gpu_memory_utilization that fits: "
                     f"{math.floor(most * 100) / 100:.2f}")
    return lines
