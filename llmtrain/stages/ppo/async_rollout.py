"""Rollouts that overlap training (`ppo.off_policy.max_staleness=k > 0`, through the vLLM engine): the rollouts of the
next k iterations are requested before the current one trains, so the engine samples while the trainer updates.

Versions: the policy after u updates is version u, so iteration i updates version i − 1 (one version per iteration,
whatever its optimizer steps). A rollout sampled by version s and trained at iteration i is i − 1 − s versions stale
(logged: `staleness_mean`, `staleness_max`). Each iteration i:
1. the oldest rollout in flight, iteration i's, is waited for (`trainer_wait_s`);
2. the trainer's prompt batch is iteration i + k's: the data stream runs k batches ahead (the first iteration of a
   process draws those k with `fetch_more`; `data_position` does not count them, so a resume re-draws them). Before
   it is requested, the engine receives the current weights when the version it holds would be more than k versions
   old at iteration i + k (the sync, a collective, first lets the requests still in flight finish on their weights);
3. the oldest is laid out as a rollout (a collective) and the stage scores, gathers and trains on it as it would a
   fresh one. With k = 1 the engine samples iteration i + 1's rollout on version i − 1 while iteration i trains.
`engine_idle_s`: how long this rank had no request in flight before it sent the next one (the sync included);
`rollout_version`: the version that sampled the iteration's rollout.

The correction is decoupled PPO (Hilton et al. 2022, as AReaL): the behaviour policy is the engine's (its log-probs),
the proximal policy the trainer's recomputation at the start of the update (the experience's old log-probs): the
clipped ratio is taken against the proximal policy, and the behaviour → proximal weight π_prox / π_behav is
ppo.importance_sampling's (`is_weights`: one mechanism, which validation requires on).

Seeds: iteration j's rollout is seeded as the on-policy loop seeds it (run seed, j, dp rank), whenever it is sent.
Resume: a save waits for the requests in flight and stores their answers (token ids, engine log-probs, weight
versions; multi-turn: each finished trajectory, tool results included) in the stage's state, every rank's; the
resumed run re-draws their prompt batches and requests only what was not sent: the same rollouts as the
uninterrupted run.

Multi-turn (ppo.tools): a rollout's whole loop (each turn's requests, the tool calls) runs in a background thread
from `submit`; `collect`, on the main thread, lays it out and counts the tool metrics (the collectives).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch.distributed as dist

from llmtrain.data.prompts import PromptBatch
from llmtrain.stages.ppo.engines.vllm import Requests
from llmtrain.stages.ppo.rollout import Rollout, SamplingSettings


@dataclass
class InFlight:
    iteration: int  # the iteration that trains on it
    version: int  # the policy version the engine held when it was requested
    batch: PromptBatch
    requests: Requests


def version_number(name: str | None) -> int | None:
    """'policy-3' -> 3 (the stage names versions so); None: the engine holds no weights of this run yet."""
    return None if name is None else int(name.rsplit("-", 1)[1])


def needs_sync(held: int | None, trained_at: int, max_staleness: int) -> bool:
    """Whether a rollout requested now, trained at iteration `trained_at` (on version trained_at − 1), would be more
    than `max_staleness` versions stale on the version the engine `held`."""
    return held is None or (trained_at - 1) - held > max_staleness


class AsyncRollouts:
    """The queue of rollouts in flight on this rank; `engine`: a VLLMEngine, or the multi-turn engine around one
    (`submit`, `collect`, `sync`, `weight_version`, `checkpointed`)."""

    def __init__(self, engine, max_staleness: int):
        self.engine, self.k = engine, max_staleness
        self.queue: deque[InFlight] = deque()
        self.restored: list | None = None  # every rank's saved rollouts (load_state_dict), used at the first `next`
        self.last_answer: float | None = None  # perf_counter of the latest answer this rank received
        self.metrics: dict = {}  # the last iteration's: staleness, waits, and the sync's when it synced

    def next(self, actor, batch: PromptBatch, iteration: int, settings: SamplingSettings, *, fetch_more, seed_of,
             pad_token_id: int, eos_ids: list[int], group=None) -> Rollout:
        """Iteration `iteration`'s rollout; `batch`: the trainer's prompt batch of this call (iteration + k's, or
        this iteration's on the first call of a process); seed_of(j): iteration j's rollout seed on this rank."""
        version, fresh, metrics = iteration - 1, not self.queue, {"engine_idle_s": 0.0}
        if fresh:  # this batch and the k after it; a resumed run's were answered before the save
            restored = self._restored(iteration)
            to_send = [(batch, iteration)] + [(fetch_more(), iteration + j) for j in range(1, self.k + 1)]
        else:
            restored, to_send = {}, [(batch, iteration + self.k)]
        waited = 0.0 if fresh else self._wait(self.queue[0])
        for drawn, trained_at in to_send:
            if trained_at in restored:
                saved = restored[trained_at]
                requests = Requests.answered(saved["url"], saved["weight_version"], saved["answers"])
                self.queue.append(InFlight(trained_at, saved["version"], drawn, requests))
                continue
            if needs_sync(version_number(self.engine.weight_version), trained_at, self.k):
                metrics.update(self.engine.sync(actor, f"policy-{version}"))  # a collective, on every rank alike
            metrics["engine_idle_s"] += self._idle()
            requests = self.engine.submit(actor, drawn, settings, eos_ids, seed_of(trained_at))
            for future in requests.futures:
                future.add_done_callback(self._answered)
            self.queue.append(InFlight(trained_at, version_number(requests.version), drawn, requests))
        oldest = self.queue.popleft()
        if oldest.iteration != iteration:
            raise RuntimeError(f"the oldest rollout in flight is iteration {oldest.iteration}'s, iteration "
                               f"{iteration} trains now: the prompt stream and the queue disagree")
        if fresh:
            waited = self._wait(oldest)
        rollout = self.engine.collect(actor, oldest.batch, oldest.requests, settings, pad_token_id=pad_token_id,
                                      eos_ids=eos_ids, group=group)
        staleness = version - oldest.version
        self.metrics = {**metrics, "staleness_mean": float(staleness), "staleness_max": float(staleness),
                        "rollout_version": float(oldest.version), "trainer_wait_s": waited}
        return rollout

    def _wait(self, entry: InFlight) -> float:
        began = time.perf_counter()
        for future in entry.requests.futures:
            future.exception()  # blocks until answered; a failure raises when the rollout is collected
        return time.perf_counter() - began

    def _answered(self, _future) -> None:
        self.last_answer = time.perf_counter()  # a pool thread; a float store is atomic under the GIL

    def _idle(self) -> float:
        """Seconds since this rank's engine ran out of requests (0 while any is in flight, or before the first)."""
        if self.last_answer is None or not all(entry.requests.done() for entry in self.queue):
            return 0.0
        return max(time.perf_counter() - self.last_answer, 0.0)

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Every rank's rollouts in flight, answered (waits for them; a collective: every rank saves)."""
        mine = [{"iteration": e.iteration, "version": e.version, "url": e.requests.url,
                 "weight_version": e.requests.version,
                 "answers": self.engine.checkpointed(e.requests)}
                for e in self.queue]
        ranks = [mine]
        if dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        return {"max_staleness": self.k, "ranks": ranks}

    def load_state_dict(self, state: dict) -> None:
        self.restored = state.get("ranks")

    def _restored(self, iteration: int) -> dict[int, dict]:
        """This rank's saved rollouts by the iteration that trains them (once: the first call after a resume)."""
        ranks, self.restored = self.restored, None
        if not ranks:
            return {}
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if len(ranks) != world:
            raise ValueError(f"resume: the checkpoint holds the rollouts in flight of {len(ranks)} ranks, this run "
                             f"has {world}: resume ppo.off_policy.max_staleness > 0 on the same number of ranks")
        return {saved["iteration"]: saved for saved in ranks[rank] if saved["iteration"] >= iteration}


def off_policy_problems(p) -> list[str]:
    """ppo.off_policy's rules (the `ppo` node): what overlapping rollouts with training needs, each naming the fix."""
    k = p.off_policy.max_staleness
    if k == 0:
        return []
    if k < 0:
        return [f"ppo.off_policy.max_staleness={k} must be >= 0 (0: on-policy rollouts)"]
    problems, off = [], f"ppo.off_policy.max_staleness={k}"
    if p.rollout.engine != "vllm":
        problems.append(f"{off} overlaps rollouts with training, which needs an inference engine apart from the "
                        f"trainer: ppo.rollout.engine={p.rollout.engine} samples with the training model itself, "
                        "between updates; set ppo.rollout.engine=vllm (with ppo.rollout.vllm.urls or .python), or "
                        "ppo.off_policy.max_staleness=0")
    if p.old_logprobs == "engine":
        problems.append(f"{off} clips the ratio against the proximal policy, the trainer's log-probs at the start of "
                        "the update (decoupled PPO); ppo.old_logprobs=engine would clip against the stale behaviour "
                        "policy: set ppo.old_logprobs=trainer, or ppo.off_policy.max_staleness=0")
    if p.importance_sampling.mode == "none":
        problems.append(f"{off} weighs each token by π_proximal / π_behaviour through ppo.importance_sampling; "
                        "mode=none would train on stale rollouts uncorrected: set ppo.importance_sampling.mode=auto "
                        "(or token_truncate, token_mask, sequence_truncate, sequence_mask)")
    if p.filter_groups:
        problems.append(f"{off}: ppo.filter_groups=true draws more prompts inside an iteration, which the rollouts "
                        "requested ahead cannot follow: set ppo.filter_groups=false, or ppo.off_policy.max_staleness=0")
    if getattr(p, "environment", None) is not None:
        problems.append(f"{off}: ppo.environment's instances hold the state their get_reward reads when the rollout "
                        "is scored, and the pool hands them to the next rollout, which would reset them while the "
                        "one requested ahead is in flight; nor can a checkpoint save them for a rollout in flight "
                        "(user objects): use ppo.tools (rollouts requested ahead are saved whole), or "
                        "ppo.off_policy.max_staleness=0")
    if p.rollout.vllm.sleep:
        problems.append(f"{off}: ppo.rollout.vllm.sleep=true frees the engine's memory while the trainer updates, "
                        "when it would sample the next rollouts: set ppo.rollout.vllm.sleep=false (the engine on "
                        "devices of its own), or ppo.off_policy.max_staleness=0")
    return problems
