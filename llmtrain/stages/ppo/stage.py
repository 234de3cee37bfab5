"""PPO (and GRPO): actor, critic, frozen reference and a reward model or function, every role on every rank.

One trainer step is one iteration: each dp rank generates responses to its share of the step's prompts
(rollout), scores them and computes the experience (log-probs, values, KL, rewards, advantages), then
every rank holds the global experience and `epochs` passes go over it in mini-batches drawn by a seeded
permutation of the global batch; a mini-batch is one optimizer step of the actor (clipped surrogate) and
of the critic (clipped value loss), each through the shared Updater: losses are token sums normalised by
the action tokens of the global mini-batch. GRPO is the same stage with group-relative advantages, no
critic, and the KL (k3) as a loss term. The update and its losses are update.py's (PPOUpdate); this
module samples, scores, makes the experience and evaluates.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from llmtrain.data.prompts import REFERENCE, PromptBatch, collate_prompts
from llmtrain.distributed import all_gather_rows
from llmtrain.losses.importance import importance_weight_metrics
from llmtrain.stages.base import RoleSpec, Stage, Updater, reduce_sums
from llmtrain.stages.ppo.engines import HFEngine
from llmtrain.stages.ppo.experience import (
    Experience,
    ExperienceSettings,
    gather_rollout,
    make_experience,
    update_layout,
)
from llmtrain.stages.ppo.filtering import chosen_groups, concat_experiences, group_rows, varied_groups
from llmtrain.stages.ppo.rewards import (
    Completions,
    RewardFunction,
    ScoreShaping,
    combined_scores,
    query_texts,
    reads_queries,
    reward_model_scores,
    score_metrics,
)
from llmtrain.stages.ppo.rollout import Rollout, SamplingSettings, decode_responses
from llmtrain.stages.ppo.update import PPOUpdate, UpdateSettings


class PPOStage(PPOUpdate, Stage):
    name = "ppo"
    count_name = "samples"

    def __init__(self, roles: dict[str, RoleSpec], tokenizer, *, sampling: SamplingSettings,
                 eval_sampling: SamplingSettings,
                 experience: ExperienceSettings, update: UpdateSettings, kl_controller, shaping: ScoreShaping,
                 reward_functions: list[RewardFunction] | None = None, prompts_per_step: int, seed: int,
                 stop_ids: list[int], attention: str = "sdpa", reward_model_weight: float = 1.0,
                 critic_warmup_steps: int = 0, filter_max_rounds: int = 0, rollout_engine=None, off_policy=None):
        self.roles, self.tokenizer = roles, tokenizer
        self.sampling, self.eval_sampling, self.experience, self.update = sampling, eval_sampling, experience, update
        self.kl_controller, self.shaping, self.reward_functions = kl_controller, shaping, reward_functions or []
        self.prompts_per_step, self.seed, self.rollout_attention = prompts_per_step, seed, attention
        self.reward_model_weight = reward_model_weight  # the reward model's weight beside reward functions
        self.critic_warmup_steps = critic_warmup_steps  # iterations that update only the critic
        self.collate = partial(collate_prompts, pad_token_id=tokenizer.pad_token_id)
        self.eos_ids = list(stop_ids)  # every token a reply ends with (models/stop_tokens.py): eos, end of turn
        self.iteration = 0  # set from the trainer's step at each train_step: seeds the rollout and the permutation
        self.has_reference = "reference" in roles  # none when β = 0 (build.uses_reference)
        self.kl_loss_coef = 0.0  # this iteration's β of the KL loss term (the controller's value; 0: KL in reward)
        self.filter_max_rounds = filter_max_rounds  # ppo.filter_groups: prompt batches per iteration at most; 0: off
        self.extra_prompt_batches = 0  # drawn by dynamic sampling so far, beyond one per iteration (data position)
        self.rollout_engine = rollout_engine or HFEngine()  # ppo.rollout.engine: who samples (stages/ppo/engines)
        self.off_policy = off_policy  # ppo.off_policy.max_staleness > 0: the rollouts in flight (async_rollout.py)

    # ---- the rollout engine ----------------------------------------------------------------------
    def prepare(self, engines: dict, data, prepare_batch) -> dict:
        self.rollout_engine.start(engines["actor"])
        return engines

    def close(self) -> None:
        self.rollout_engine.close()

    def _synced(self, actor, updates: int) -> dict:
        """The engine holds the policy after `updates` updates (a collective; nothing to do for hf or when it does)."""
        return self.rollout_engine.sync(actor, f"policy-{updates}")

    # ---- data layout -----------------------------------------------------------------------------
    def fetch_layout(self, micro_batch_size: int, grad_accum_steps: int, dp_size: int) -> tuple[int, int]:
        """(prompts per fetch, fetches per step) on each rank: one batch of this rank's share of the prompts."""
        return self.prompts_per_step // dp_size, 1

    def data_position(self, step: int) -> int:
        return step + self.extra_prompt_batches

    def optimizer_steps_per_step(self) -> int:
        samples = self.prompts_per_step * self.sampling.n_samples_per_prompt
        return self.update.epochs * (samples // self.update.mini_batch_size)

    # ---- scores ----------------------------------------------------------------------------------
    def raw_scores(self, rollout: Rollout, engines: dict) -> tuple[torch.Tensor, dict]:
        """(b,) scores: the reward functions' weighted sum, plus ppo.reward.model_weight × the reward model's score
        when both are set; and each source's mean over every dp rank (`score_fn_<name>`, `score_rm` beside
        functions). NaN: no function scored the row, and no reward model did (make_experience: unscored)."""
        parts, metrics = [], {}
        if self.reward_functions:
            scores, means = combined_scores(self.reward_functions, self.completions(rollout),
                                            engines["actor"].dp_group)
            parts.append(torch.tensor(scores, dtype=torch.float32, device=rollout.sequences.device))
            metrics = score_metrics(self.reward_functions, means)
        if "reward" in engines:
            rows, size = rollout.sequences.shape[0], self.experience.micro_batch_size
            model_scores = torch.cat([reward_model_scores(engines["reward"], rollout, slice(i, min(i + size, rows)))
                                      for i in range(0, rows, size)])  # (b,)
            if parts:  # beside functions: weighted, and its own mean logged
                total, count = reduce_sums([model_scores.double().sum(), model_scores.new_tensor(float(rows))],
                                           engines["actor"])
                metrics["score_rm"] = total / max(count, 1.0)
                model_scores = self.reward_model_weight * model_scores
            parts.append(model_scores)
        # beside a reward model, which scores every row, an unscored row is the model's score alone (TRL's nansum)
        return (parts[0] if len(parts) == 1 else torch.nansum(torch.stack(parts), dim=0)), metrics

    def completions(self, rollout: Rollout) -> Completions:
        from transformers import TrainerState

        responses, mask = rollout.responses.cpu(), rollout.action_mask.cpu()
        return Completions(prompts=rollout.prompts, texts=decode_responses(self.tokenizer, rollout, self.eos_ids),
                           ids=[row[m].tolist() for row, m in zip(responses, mask)], columns=rollout.columns,
                           trainer_state=TrainerState(global_step=self.iteration),
                           queries=query_texts(self.tokenizer, rollout) if reads_queries(self.reward_functions) else [])

    # ---- one iteration ---------------------------------------------------------------------------
    def train_step(self, micro_batches: list[PromptBatch], engines: dict, updater: Updater) -> dict:
        actor = engines["actor"]
        self.iteration = updater.step
        start = time.perf_counter()
        # the weights before this iteration's update (off-policy: the queue syncs when a rollout would be too stale)
        synced = self._synced(actor, self.iteration - 1) if self.off_policy is None else {}
        gathered, raw, metrics, times = self._sample(micro_batches[0], engines)
        self.rollout_engine.after_rollout()  # colocated: the engine frees its memory for the update
        metrics.update(synced if self.off_policy is None else self.off_policy.metrics)
        layouts = self._layouts(gathered.sequences.shape[0], actor)  # per epoch, per mini-batch: micro-batch rows
        kl_coef = self.kl_controller.value
        self.kl_loss_coef = kl_coef if self.update.kl_in_loss else 0.0
        first_epoch = [rows for mini_batch in layouts[0] for rows in mini_batch]
        experience = make_experience(gathered, engines, first_epoch, kl_coef, self.experience, group=actor.dp_group)
        made = time.perf_counter()
        metrics.update(self._rollout_metrics(experience, raw, kl_coef))
        if self._mismatch_in_experience:  # the trainer's old log-probs against the engine's, the global batch
            metrics.update(self._mismatch(experience.old_logps, experience.engine_logps, experience.action_mask))
            if self.experience.importance is not None:
                metrics.update(importance_weight_metrics(experience.is_weights, experience.action_mask,
                                                         self.experience.importance[0]))
        metrics.update(self._update(experience, engines, updater, layouts))
        # after the update: on-policy GRPO measures the KL in the update's own forward
        self.kl_controller.update(metrics["kl"], experience.sequences.shape[0])
        done = time.perf_counter()
        metrics.update(time_rollout_s=times["generate"], time_experience_s=made - start - times["generate"],
                       time_update_s=done - made, time_gather_s=times["gather"],
                       generation_share=times["generate"] / (done - start), samples=experience.sequences.shape[0])
        return metrics

    def _sample(self, batch: PromptBatch, engines: dict) -> tuple[Experience, torch.Tensor, dict, dict]:
        """Generate, score and gather on every rank: (the global batch, its raw scores (N,), the reward functions'
        means, seconds spent generating and gathering). With ppo.filter_groups, rounds on the next prompts until
        enough groups have varied scores (stages/ppo/filtering.py)."""
        actor, n = engines["actor"], self.sampling.n_samples_per_prompt
        rounds, times = [], {"generate": 0.0, "gather": 0.0}
        for round_index in range(max(self.filter_max_rounds, 1)):
            if round_index:
                batch = self.fetch_more()
                self.extra_prompt_batches += 1
            began = time.perf_counter()
            rollout = self._generate(actor, batch, round_index)
            times["generate"] += time.perf_counter() - began
            times["gather"] += rollout.gather_s
            raw, function_means = self.raw_scores(rollout, engines)
            function_means.update(rollout.metrics)  # a multi-turn engine's tool counts (stages/ppo/tools)
            shaped = self.shaping.apply(raw, rollout.ended, rollout.action_mask.sum(-1))
            rounds.append((gather_rollout(rollout, shaped, actor.dp_group), all_gather_rows(raw, actor.dp_group),
                           function_means))
            if not self.filter_max_rounds:
                break
            varied = varied_groups(torch.cat([r[0].scores for r in rounds]), n)
            if int(varied.sum()) >= self.prompts_per_step:
                break
        gathered = concat_experiences([r[0] for r in rounds], self.tokenizer.pad_token_id)
        raw = torch.cat([r[1] for r in rounds])
        metrics = {name: sum(r[2][name] for r in rounds) / len(rounds) for name in rounds[0][2]}  # equal-sized
        if self.filter_max_rounds:
            groups, topped_up = chosen_groups(varied, self.prompts_per_step)
            rows = group_rows(groups, n)
            gathered, raw = gathered.select(rows), raw[rows]
            metrics.update(filter_rounds=len(rounds), filter_varied_groups=int(varied.sum()),
                           filter_uniform_groups=int((~varied).sum()), filter_topped_up=topped_up,
                           filter_prompt_batches=self.extra_prompt_batches)
        return gathered, raw, metrics, times

    def _generate(self, actor, batch: PromptBatch, round_index: int) -> Rollout:
        """This iteration's rollout: sampled now, or (ppo.off_policy) the oldest in flight, `batch` sent in turn."""
        options = dict(pad_token_id=self.tokenizer.pad_token_id, eos_ids=self.eos_ids, group=actor.dp_group)
        if self.off_policy is not None:
            return self.off_policy.next(actor, batch, self.iteration, self.sampling, fetch_more=self.fetch_more,
                                        seed_of=lambda j: self._seed("rollout", actor.dp_rank, iteration=j), **options)
        return self.rollout_engine.generate(actor, batch, self.sampling,
                                            seed=self._seed("rollout", actor.dp_rank, round_index), **options)

    def _seed(self, purpose: str, dp_rank: int, round_index: int = 0, iteration: int | None = None) -> int:
        salt = {"rollout": 1, "permutation": 2, "eval": 3}[purpose] + 11 * round_index  # dynamic sampling's rounds
        step = self.iteration if iteration is None else iteration  # ppo.off_policy: the rollout's own iteration
        return (self.seed * 1_000_003 + step * 7919 + dp_rank * 104_729 + salt) % (2 ** 63)

    def _layouts(self, total: int, actor) -> list[list[list[torch.Tensor]]]:
        """Each epoch's seeded permutation of the global batch, cut into this rank's micro-batches per mini-batch."""
        generator = torch.Generator().manual_seed(self._seed("permutation", 0))  # the same on every rank
        device = actor.ctx.device
        return [update_layout(torch.randperm(total, generator=generator).to(device), self.update.mini_batch_size,
                              self.experience.micro_batch_size, actor.dp_rank, actor.dp_size)
                for _ in range(self.update.epochs)]

    def _rollout_metrics(self, exp: Experience, raw: torch.Tensor, kl_coef: float) -> dict:
        """exp and raw (N,): the global batch, the same on every rank. The rollout as sampled: a response
        ppo.mask_truncated cut out of the loss still counts with its tokens and KL (the adaptive KL controller reads
        `kl`); scores as TRL logs them, unscored (NaN) rows left out."""
        mask = exp.sampled_mask.float()
        lengths = mask.sum(-1)  # (N,)
        kl_seq = (exp.kl * mask).sum(-1)  # (N,)
        scored = raw.double()[~raw.isnan()]  # (n,)
        rewards = exp.scores - (0.0 if self.update.kl_in_loss else kl_coef) * kl_seq  # (N,), NaN where unscored
        return {"score": scored.mean().item(), "score_std": scored.std(correction=0).item(),
                "reward": rewards.nanmean().item(), "kl": kl_seq.mean().item(),
                "kl_token": (kl_seq.sum() / lengths.sum().clamp(min=1)).item(), "kl_coef": kl_coef,
                "response_len": lengths.mean().item(),
                # `ended`: the last turn's stop token (a multi-turn trajectory has one per turn)
                "eos_rate": (exp.sampled_mask.any(-1) & exp.ended).float().mean().item()}

    # ---- eval ------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches, engines: dict) -> dict:
        actor = engines["actor"]
        sums = torch.zeros(5, dtype=torch.float64, device=actor.ctx.device)  # score, exact, length, count, scored
        self._synced(actor, self.iteration)  # greedy through the same engine, on the weights after the last update
        for batch in batches:
            rollout = self.rollout_engine.generate(actor, batch, self.eval_sampling,
                                                   pad_token_id=self.tokenizer.pad_token_id, eos_ids=self.eos_ids,
                                                   seed=self._seed("eval", actor.dp_rank), group=actor.dp_group)
            scores = self.raw_scores(rollout, engines)[0].double()
            real = rollout.real.double()
            exact = torch.zeros_like(real)
            if REFERENCE in rollout.columns:
                texts = decode_responses(self.tokenizer, rollout, self.eos_ids)
                exact = torch.tensor([float(t.strip() == str(r).strip())
                                      for t, r in zip(texts, rollout.columns[REFERENCE])],
                                     dtype=torch.float64, device=real.device)
            sums += torch.stack([(scores.nan_to_num(0.0) * real).sum(), (exact * real).sum(),  # NaN: unscored
                                 (rollout.action_mask.sum(-1).double() * real).sum(), real.sum(),
                                 (real * ~scores.isnan()).sum()])
        self.rollout_engine.after_rollout()
        score, exact, length, count, scored = reduce_sums(list(sums), actor)
        count = max(count, 1)
        return {"eval_score": score / max(scored, 1), "eval_exact_match": exact / count,
                "eval_response_len": length / count,
                "eval_samples": int(count)}

    def state_dict(self) -> dict:
        state = {"kl_controller": self.kl_controller.state_dict(), "extra_prompt_batches": self.extra_prompt_batches}
        return state if self.off_policy is None else {**state, "in_flight": self.off_policy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "kl_controller" in state:
            self.kl_controller.load_state_dict(state["kl_controller"])
        self.extra_prompt_batches = state.get("extra_prompt_batches", 0)
        if self.off_policy is not None and "in_flight" in state:  # answered before the save: used, not re-sampled
            self.off_policy.load_state_dict(state["in_flight"])
