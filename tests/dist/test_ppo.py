"""PPO and GRPO under torchrun (gloo, 2 CPU ranks): every backend generates, scores and updates; the updates of
ZeRO-2, ZeRO-3 and FSDP2 equal DDP's; the first ratio of every iteration is exactly 1; resume is bitwise.

Every run starts from the tiny SFT base (`${base:sft_tiny}`), trains 4 iterations of 8 prompts (8 new tokens at
most; PPO 1 sample per prompt, GRPO 4) in mini-batches of 4 sequences, 2 epochs, micro-batches of 2, fp32, and
saves at iteration 2. The sampling RNG is seeded from (seed, step, dp rank), so every backend draws the same tokens
as long as its logits agree. Every run of the module (RUNS) runs first, one after the other in one 2-rank process
(tests/dist/workers/batched_runs.py: the start-up is paid once), then the resumed runs (RESUMED) in a second one, so
resume starts in fresh processes as a user's does; each run serves several tests. Three runs pack their experience
and update forwards (ppo.packing, PACKED): PPO on ZeRO-2 (actor, reference and critic) and GRPO on ZeRO-2 and FSDP2,
so the parity tests compare packed forwards on one backend with DDP's padded ones, and the first-ratio and resume
tests hold for packed rows too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from tests.helpers import REPO, BatchedRuns, read_metrics

pytestmark = pytest.mark.dist

DATA = REPO / "llmtrain" / "assets" / "data"
SHORT = ["trainer.max_steps=4", "trainer.save_every_n_steps=2", "trainer.keep_last_k=3", "trainer.eval_every_n_steps=4",
         "trainer.eval_batch_size=8", "trainer.log_every_n_steps=0", "trainer.micro_batch_size=2",
         "ppo.rollout.max_new_tokens=8", "ppo.rollout.eval_max_new_tokens=8", "ppo.mini_batch_size=4", "ppo.epochs=2"]
# PPO with the adaptive KL controller: its coefficient changes every iteration and must come back on resume
STAGES = {"ppo": ["recipe=ppo_tiny", "ppo.rollout.prompts_per_step=8", "ppo.kl.target=0.02", "ppo.kl.horizon=64"],
          "grpo": ["recipe=grpo_tiny", "ppo.rollout.prompts_per_step=2", "ppo.rollout.n_samples_per_prompt=4"]}
BACKENDS = {"ddp": [], "zero2": ["backend=zero2"], "zero3": ["backend=zero3"], "fsdp2": ["backend=fsdp2"]}
PACKED = ("ppo_zero2", "grpo_zero2", "grpo_fsdp2")  # runs (and their resumed runs) with ppo.packing=true
COMPARED = ("score", "reward", "kl", "policy_loss", "grad_norm", "approx_kl", "entropy")

# every odd-length target's group scores 0 throughout (no eos penalty): dynamic sampling drops it and draws again
FILTERED = ["ppo.filter_groups=true", "ppo.filter_max_rounds=3", "ppo.reward.missing_eos_penalty=null",
            "ppo.reward.function=tests.dist.workers.rewards:even_targets_only"]
# name -> (stage, backend, overrides after the backend's)
RUNS = {**{f"{stage}_{backend}": (stage, backend, []) for stage in STAGES for backend in BACKENDS},
        "grpo_zero3_fused": ("grpo", "zero3", ["model.fused_loss=chunked"]),
        **{f"{stage}_{backend}_lora": (stage, backend, ["peft=lora"])
           for stage in STAGES for backend in ("ddp", "fsdp2")},
        "grpo_ddp_filter": ("grpo", "ddp", FILTERED)}
RESUMED = ("ppo_ddp", "ppo_zero3", "ppo_fsdp2", "grpo_zero2", "ppo_fsdp2_lora", "grpo_ddp_filter")  # NAME_resumed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs RUNS in one 2-rank launch, then RESUMED (each from its run's iteration-2 checkpoint) in a second; ->
    `runs(name)`: that finished run's folder."""
    root = tmp_path_factory.mktemp("ppo")
    eval_file = root / "eval.jsonl"
    eval_file.write_text("".join((DATA / "reverse_eval.jsonl").read_text().splitlines(True)[:16]))

    def args(name: str) -> list[str]:
        stage, backend, extra = RUNS[name]
        return [*STAGES[stage], *SHORT, f"data.eval_files=[{eval_file}]", *BACKENDS[backend],
                *(["ppo.packing=true"] if name in PACKED else []), *extra]

    batched = BatchedRuns(root, [(2, [(name, args(name)) for name in RUNS]),
                                 (2, [(f"{name}_resumed", [*args(name), f"resume={root / name}/checkpoints/step_2"])
                                      for name in RESUMED])])

    def get(name: str) -> Path:
        out = batched(name)
        if name.removesuffix("_resumed") in PACKED:  # the override reached the run's resolved config
            assert OmegaConf.load(out / "config.yaml").ppo.packing is True
        return out

    return get


def test_reward_function_means_are_global(runs):
    """GRPO's one reward function (llmtrain.rewards.reversal:score, weight 1, never None): its logged mean is the
    step's global score over both ranks' responses, `score` (reduce_sums; the scores are fp32: 1e-6), not rank 0's
    own mean (0.854 against 0.927 at step 1)."""
    records = read_metrics(runs("grpo_ddp"))[0]
    assert len(records) == 4 and any(0 < r["score"] < 1 for r in records), records  # partial credit: ranks differ
    for r in records:
        assert r["score_fn_score"] == pytest.approx(r["score"], rel=1e-6), r


def test_the_fused_grpo_loss_equals_full_logits_under_zero3(runs, assert_close_series):
    """GRPO's update loss computed per token inside the fused head (gradient in the forward, ZeRO-3's gathered head
    weight; model.fused_loss=chunked) against full logits (auto's choice at V 263) on the same backend: the same
    rollouts, losses and grad norms."""
    fused = read_metrics(runs("grpo_zero3_fused"))[0]
    full = read_metrics(runs("grpo_zero3"))[0]  # model.fused_loss=auto: full logits at the tiny vocabulary
    for key in COMPARED:
        assert_close_series(fused, full, key, 1e-5, 1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["zero2", "zero3", "fsdp2"])
def test_ppo_update_parity_with_ddp(runs, backend, assert_close_series):
    """Same prompts, same seeds: the rollouts, scores, KL and the actor's and critic's updates agree with DDP."""
    ours, reference = read_metrics(runs(f"ppo_{backend}"))[0], read_metrics(runs("ppo_ddp"))[0]
    assert [r["samples"] for r in ours] == [8] * 4
    for key in (*COMPARED, "value_loss"):
        assert_close_series(ours, reference, key, 1e-4, 1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["zero3", "fsdp2"])
def test_grpo_update_parity_with_ddp(runs, backend, assert_close_series):
    ours, reference = read_metrics(runs(f"grpo_{backend}"))[0], read_metrics(runs("grpo_ddp"))[0]
    assert [r["samples"] for r in ours] == [8] * 4
    for key in (*COMPARED, "kl_loss"):
        assert_close_series(ours, reference, key, 1e-4, 1e-4, atol=1e-6)


@pytest.mark.parametrize("stage,backend", [("ppo", "ddp"), ("ppo", "zero3"), ("ppo", "fsdp2"), ("grpo", "ddp"),
                                           ("ppo", "zero2"), ("grpo", "fsdp2")])
def test_first_ratio_of_every_iteration_is_exactly_one(runs, stage, backend):
    """The experience's log-probs come from the same micro-batches the first mini-batch trains on (ppo_zero2 and
    grpo_fsdp2: packed the same way too)."""
    train = read_metrics(runs(f"{stage}_{backend}"))[0]
    assert [r["first_ratio_dev"] for r in train] == [0.0] * 4
    assert train[0]["kl"] == 0.0  # the reference is the initial actor


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_lora_on_fsdp2_matches_lora_on_ddp(runs, stage, assert_close_series):
    """peft=lora: the reference is the actor with adapters off, and generation runs peft's generate() below the
    FSDP2 root (which once left the root uninitialised: the next forward failed). The updates equal DDP's and the
    first ratio of every iteration is exactly 1."""
    ours = read_metrics(runs(f"{stage}_fsdp2_lora"))[0]
    reference = read_metrics(runs(f"{stage}_ddp_lora"))[0]
    assert [r["first_ratio_dev"] for r in ours] == [0.0] * 4
    for key in COMPARED:
        assert_close_series(ours, reference, key, 1e-4, 1e-4, atol=1e-6)


@pytest.mark.parametrize("stage,backend", [("ppo", "ddp"), ("ppo", "zero3"), ("ppo", "fsdp2"), ("grpo", "zero3")])
def test_counted_communication_of_an_iteration_matches_the_plan(runs, stage, backend):
    """The planner's iteration (llmtrain/plan/rl.py: the actor gathered for generation, every role's experience
    forward, epochs × mini-batches of actor and critic updates) against the collectives counted on each rank in
    iteration 2: every kind of weight traffic within 5 % (payload and ring wire bytes)."""
    second = read_metrics(runs(f"{stage}_{backend}"))[0][1]
    assert second["step"] == 2
    kinds = [k[len("plan_comm_"):] for k in second if k.startswith("plan_comm_") and k.count("_") > 3]
    assert kinds, sorted(second)
    for kind in kinds:
        planned = second[f"plan_comm_{kind}"]
        for rank in range(2):
            counted = second[f"comm_r{rank}_{kind}"]
            assert abs(counted / planned - 1) <= 0.05, (f"rank {rank} {kind}: counted {counted:.0f}, "
                                                        f"planned {planned:.0f}")


def logged(record: dict) -> dict:
    """Everything but timings and the memory report (measured once per process)."""
    return {k: v for k, v in record.items() if not k.endswith("_s") and "memory" not in k
            and k not in ("samples_per_s", "generation_share")}


@pytest.mark.parametrize("stage,backend,lora", [("ppo", "ddp", False), ("ppo", "zero3", False), ("ppo", "fsdp2", False),
                                               ("grpo", "zero2", False), ("ppo", "fsdp2", True)])
def test_bitwise_resume(runs, stage, backend, lora):
    """4 iterations straight vs the iteration-2 checkpoint resumed in fresh processes: identical rollouts, scores,
    losses (actor, critic, their optimizers, the KL controller, RNG, the prompt position all come back; with LoRA
    the adapters and the critic's, over the base rebuilt from its source)."""
    name = f"{stage}_{backend}" + ("_lora" if lora else "")
    straight, resumed = runs(name), runs(f"{name}_resumed")
    reference, continued = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in continued[0]] == [3, 4]
    assert [logged(r) for r in continued[0]] == [logged(r) for r in reference[0][2:]]
    assert continued[1][-1]["eval_score"] == reference[1][-1]["eval_score"]
    stage_state = json.loads((straight / "checkpoints" / "step_2" / "stage.json").read_text())
    assert stage_state["kl_controller"]["value"] == reference[0][2]["kl_coef"]
    if stage == "ppo":  # adaptive: the coefficient moved
        assert len({r["kl_coef"] for r in reference[0]}) > 1



def test_dynamic_sampling_refills_from_the_next_prompts_and_resumes_bitwise(runs):
    """GRPO with ppo.filter_groups on 2 ranks (one prompt each per round): rounds go on until 2 groups vary (3 at
    most, then the earliest uniform groups top up), every iteration trains on 8 sequences, the prompt batches drawn
    are counted, and resuming at iteration 2 draws the same next prompts: the same records, bit for bit."""
    straight, resumed = runs("grpo_ddp_filter"), runs("grpo_ddp_filter_resumed")
    reference, continued = read_metrics(straight)[0], read_metrics(resumed)[0]
    assert [r["samples"] for r in reference] == [8] * 4
    assert any(r["filter_rounds"] > 1 for r in reference), reference
    drawn = 0
    for r in reference:
        groups = r["filter_varied_groups"] + r["filter_uniform_groups"]
        assert groups == 2 * r["filter_rounds"] and r["filter_rounds"] <= 3
        assert r["filter_rounds"] == 3 or r["filter_varied_groups"] >= 2  # stopped early only with enough
        assert r["filter_topped_up"] == max(0, 2 - r["filter_varied_groups"])
        drawn += r["filter_rounds"] - 1
        assert r["filter_prompt_batches"] == drawn
    stage_state = json.loads((straight / "checkpoints" / "step_2" / "stage.json").read_text())
    assert stage_state["extra_prompt_batches"] == reference[1]["filter_prompt_batches"]
    assert [logged(r) for r in continued] == [logged(r) for r in reference[2:]]


def test_checkpoints_and_exports_hold_each_role(runs):
    run = runs("ppo_zero3")
    engines = run / "checkpoints" / "step_4" / "engines"
    assert sorted(p.name for p in engines.iterdir()) == ["actor", "critic", "reference"]
    assert (engines / "reference" / "frozen.json").is_file()
    actor = AutoModelForCausalLM.from_pretrained(run / "hf")
    critic = AutoModelForSequenceClassification.from_pretrained(run / "critic_hf")
    assert actor.config.architectures[0].endswith("ForCausalLM") and critic.config.num_labels == 1
    evals = read_metrics(run)[1]
    assert [e["step"] for e in evals] == [0, 4] and evals[-1]["eval_samples"] == 16
    assert 0.0 <= evals[-1]["eval_exact_match"] <= 1.0
