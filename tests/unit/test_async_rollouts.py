"""ppo.off_policy (stages/ppo/async_rollout.py): the queue's schedule of syncs and requests with the staleness it logs,
its resume from a saved state against the uninterrupted schedule, the engine's version check, decoupled PPO's loss
against a hand computation, and what validation refuses."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import open_dict, read_write

from llmtrain.compose import compose_config
from llmtrain.losses.importance import importance_weights
from llmtrain.losses.ppo import policy_loss_terms
from llmtrain.stages.ppo.async_rollout import AsyncRollouts, needs_sync, off_policy_problems, version_number
from llmtrain.stages.ppo.checks import ppo_problems
from llmtrain.stages.ppo.engines.http import EngineError
from llmtrain.stages.ppo.engines.vllm import Requests, VLLMEngine
from llmtrain.stages.ppo.engines.vllm_choices import check_versions


class RecordingEngine:
    """The VLLMEngine verbs the queue calls, answering at once: a choice naming its prompt batch, seed and version.
    (The real engine against a real server: tests/dist/test_async_rollouts.py.)"""

    def __init__(self):
        self.weight_version, self.log = None, []

    def sync(self, actor, version: str) -> dict:
        self.log.append(("sync", version))
        self.weight_version = version
        return {"sync_max_abs": 0.0}

    def submit(self, actor, batch, settings, eos_ids, seed) -> Requests:
        self.log.append(("submit", batch, self.weight_version, seed))
        choice = {"index": 0, "token_ids": [batch, seed], "logprobs": {"content": [{"logprob": -0.25}]},
                  "finish_reason": "length", "stop_reason": None,
                  "weight_versions": [{"version": self.weight_version}]}
        return Requests.answered("http://engine", self.weight_version, [[choice]])

    def collect(self, actor, batch, requests, settings, **options):
        return batch, requests.answers()[0][0]

    checkpointed = staticmethod(VLLMEngine.checkpointed)  # what a save keeps of the answers: the engine's own


def run(queue: AsyncRollouts, first: int, last: int, position: int) -> list[tuple]:
    """The trainer's loop over iterations first..last, its prompt stream at `position` (batch b: iteration b + 1's)."""
    stream = iter(range(position, 1000))
    out = []
    for iteration in range(first, last + 1):
        rollout = queue.next(None, next(stream), iteration, None, fetch_more=lambda: next(stream),
                             seed_of=lambda j: 100 + j, pad_token_id=0, eos_ids=[1])
        out.append((iteration, rollout, queue.metrics["staleness_max"]))
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_the_queue_trains_each_batch_in_order_at_most_k_versions_stale(k):
    engine = RecordingEngine()
    out = run(AsyncRollouts(engine, k), 1, 5, 0)
    for iteration, (batch, choice), staleness in out:
        assert batch == iteration - 1 and choice["token_ids"] == [batch, 100 + iteration]  # its own seed
        assert staleness == min(iteration - 1, k)  # 0 at the first, then exactly k
        assert iteration - 1 - version_number(choice["weight_versions"][0]["version"]) == staleness
    # the first iteration syncs the initial weights and sends k + 1 batches; later ones sync then send one each
    assert engine.log[:k + 2] == [("sync", "policy-0")] + [("submit", b, "policy-0", 101 + b) for b in range(k + 1)]
    for iteration in range(2, 6):
        assert ("sync", f"policy-{iteration - 1}") in engine.log
        assert ("submit", iteration + k - 1, f"policy-{iteration - 1}", 100 + iteration + k) in engine.log


def test_needs_sync_counts_versions_at_the_iteration_that_trains():
    assert needs_sync(None, 1, 1)  # nothing of this run on the engine yet
    assert not needs_sync(0, 2, 1) and needs_sync(0, 3, 1)  # trained at 3 on version 2: 2 stale > 1
    assert not needs_sync(0, 3, 2) and needs_sync(0, 4, 2)


def test_a_resumed_queue_continues_as_the_uninterrupted_one():
    straight_engine = RecordingEngine()
    straight = run(AsyncRollouts(straight_engine, 1), 1, 4, 0)
    first = AsyncRollouts(RecordingEngine(), 1)
    run(first, 1, 2, 0)
    state = first.state_dict()  # iteration 3's rollout, answered, with its weight version
    assert [s["iteration"] for s in state["ranks"][0]] == [3] and state["ranks"][0][0]["version"] == 1
    resumed_engine = RecordingEngine()  # a fresh process: the engine holds no version of this run
    resumed = AsyncRollouts(resumed_engine, 1)
    resumed.load_state_dict(state)
    again = run(resumed, 3, 4, 2)  # data_position(2) = 2: the saved rollout's batch is drawn again
    assert again == straight[2:]
    # the saved rollout is not sampled again; the next one is sent on the same weights, with the same seed
    assert resumed_engine.log[0] == ("sync", "policy-2")
    assert resumed_engine.log[1] == ("submit", 3, "policy-2", 104) and resumed_engine.log[1] in straight_engine.log


def test_a_resume_on_another_number_of_ranks_is_refused():
    queue = AsyncRollouts(RecordingEngine(), 1)
    queue.load_state_dict({"max_staleness": 1, "ranks": [[], []]})
    with pytest.raises(ValueError, match="on the same number of ranks"):
        run(queue, 3, 3, 2)


def test_the_engine_insists_on_the_version_a_request_was_sent_under():
    choices = [{"weight_versions": [{"version": "policy-1"}]}, {"weight_versions": [{"version": "policy-1"}]}]
    check_versions("http://e", choices, "policy-1")
    with pytest.raises(EngineError, match="expected only 'policy-2'"):
        check_versions("http://e", choices, "policy-2")
    choices[1]["weight_versions"].append({"version": "policy-2"})  # weights changed under a request
    with pytest.raises(EngineError, match=r"\['policy-1', 'policy-2'\]"):
        check_versions("http://e", choices, "policy-1")


def test_decoupled_ppo_loss_and_gradient_by_hand():
    """Per token: π_θ, π_prox (the trainer's at the update's start), π_behav (the engine's), advantage.
    Loss = w · max(−A·r, −A·clip(r, 0.8, 1.2)), r = π_θ / π_prox, w = min(π_prox / π_behav, 3) (token_truncate)."""
    theta = torch.tensor([[0.55, 0.3, 0.2]]).log().requires_grad_()
    prox, behav = torch.tensor([[0.5, 0.2, 0.1]]).log(), torch.tensor([[0.4, 0.25, 0.01]]).log()
    advantages, mask = torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3, dtype=torch.bool)
    weights = importance_weights(prox, behav, mask, "token_truncate", 3.0, None)
    torch.testing.assert_close(weights, torch.tensor([[1.25, 0.8, 3.0]]))
    terms = policy_loss_terms(theta, prox, advantages, mask, 0.2)
    loss = (terms.losses * weights).sum()
    # r = 1.1 (inside the clip): −1.1·1.25; r = 1.5, A < 0: the unclipped 1.5 is larger, ·0.8; r = 2: clipped −1.2·3
    assert math.isclose(loss.item(), -1.375 + 1.2 - 3.6, rel_tol=1e-6)
    loss.backward()
    # d/dlog π_θ of −A·r·w is −A·r·w where unclipped; 0 where the clipped branch holds
    torch.testing.assert_close(theta.grad, torch.tensor([[-1.375, 1.2, 0.0]]))
    masked = importance_weights(prox, behav, mask, "token_mask", 3.0, None)  # AReaL's cap: the token is dropped
    torch.testing.assert_close(masked, torch.tensor([[1.25, 0.8, 0.0]]))


GRPO = ["recipe=grpo_tiny", "model.name_or_path=x"]  # a path that is never read: no trained base is built


def problems(*overrides: str) -> list[str]:
    return ppo_problems(compose_config([*GRPO, *overrides]), "grpo", 1)


def test_validation_refuses_what_async_rollouts_cannot_do():
    vllm = ["ppo.rollout.engine=vllm", "ppo.rollout.vllm.urls=[http://127.0.0.1:8000]"]
    assert not problems(*vllm, "ppo.off_policy.max_staleness=1")
    assert not problems("ppo.off_policy.max_staleness=0")
    hf = problems("ppo.off_policy.max_staleness=1")
    assert any("ppo.rollout.engine=hf samples with the training model itself" in p and "set ppo.rollout.engine=vllm"
               in p for p in hf), hf
    engine = problems(*vllm, "ppo.off_policy.max_staleness=1", "ppo.old_logprobs=engine")
    assert any("set ppo.old_logprobs=trainer" in p for p in engine), engine
    uncorrected = problems(*vllm, "ppo.off_policy.max_staleness=2", "ppo.importance_sampling.mode=none")
    assert any("ppo.off_policy.max_staleness=2" in p and "mode=auto" in p for p in uncorrected), uncorrected
    filtered = problems(*vllm, "ppo.off_policy.max_staleness=1", "ppo.filter_groups=true")
    assert any("set ppo.filter_groups=false" in p for p in filtered), filtered
    asleep = problems(*vllm, "ppo.off_policy.max_staleness=1", "ppo.rollout.vllm.sleep=true")
    assert any("ppo.rollout.vllm.sleep=false" in p for p in asleep), asleep
    assert any("must be >= 0" in p for p in problems(*vllm, "ppo.off_policy.max_staleness=-1"))
    # multi-turn rollouts with tools are requested ahead (on vLLM); environments' instances cannot be
    tools = ["ppo.tools=[tests.dist.workers.tools:add]"]
    assert not problems(*vllm, *tools, "ppo.off_policy.max_staleness=1")
    assert not problems(*vllm, *tools)
    cfg = compose_config([*GRPO, *vllm, "ppo.off_policy.max_staleness=1"])
    with open_dict(cfg), read_write(cfg):
        cfg.ppo.environment = "my_envs:Env"
    assert any("ppo.environment's instances hold the state" in p and "use ppo.tools" in p
               for p in off_policy_problems(cfg.ppo))
