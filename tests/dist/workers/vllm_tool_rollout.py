"""Run under torchrun by tests/dist/test_ppo_tools.py: GRPO with a calculator tool (ppo.tools) through the session's
vLLM server, on 2 ranks.

1. On-policy: the policy's weights pushed to the server, one multi-turn rollout of this rank's prompt (every row's
   tokens, masks and the engine's log-probs) and its experience (the trainer's log-probs of the same tokens).
2. ppo.off_policy.max_staleness=1: two GRPO iterations through the stage's train_step (iteration 1 requests rollouts
   1 and 2, iteration 2 trains on rollout 2 while rollout 3 is in flight); the queue's state saved after iteration 1
   (JSON, as a checkpoint's stage.json) and loaded into a fresh stage, whose first rollout is iteration 2's.
Writes one JSON per rank to OUT/rank<r>.json.

usage: torchrun ... -m tests.dist.workers.vllm_tool_rollout MODEL_DIR URL OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from llmtrain.compose import compose_config
from llmtrain.data.prompts import PromptBatch
from llmtrain.distributed import init_distributed, quiesce, shutdown
from llmtrain.stages.ppo.experience import gather_rollout, make_experience
from llmtrain.stages.registry import build_stage
from llmtrain.trainer import Updater
from llmtrain.validation import validate
from tests.dist.workers.ppo_probe import stage_and_engines
from tests.dist.workers.tool_rollout import OVERRIDES
from tests.dist.workers.tools import conversations


def rollout_record(rollout) -> dict:
    return {"sequences": rollout.sequences.tolist(), "attention_mask": rollout.attention_mask.tolist(),
            "action_mask": rollout.action_mask.tolist(), "engine_logps": rollout.engine_logps.tolist(),
            "ended": rollout.ended.tolist(), "texts": rollout.texts, "prompts": rollout.prompts,
            "metrics": rollout.metrics}


def on_policy(stage, actor, batch, tokenizer, engines) -> dict:
    stage.rollout_engine.start(actor)
    stage.iteration = 1
    synced = stage._synced(actor, 0)
    rollout = stage.rollout_engine.generate(actor, batch, stage.sampling, pad_token_id=tokenizer.pad_token_id,
                                            eos_ids=stage.eos_ids, seed=7, group=actor.dp_group)
    exp = gather_rollout(rollout, stage.raw_scores(rollout, engines)[0], actor.dp_group)
    layouts = stage._layouts(exp.sequences.shape[0], actor)
    exp = make_experience(exp, engines, [rows for mini_batch in layouts[0] for rows in mini_batch], 0.01,
                          stage.experience, group=actor.dp_group)
    return {**rollout_record(rollout), "sync_max_abs": synced["sync_max_abs"], "old_logps": exp.old_logps.tolist(),
            "exp_action_mask": exp.action_mask.tolist(), "engine_version": stage.rollout_engine.weight_version}


def async_stage(cfg, tokenizer, actor, batch):
    stage = build_stage(cfg, tokenizer, "sdpa")
    stage.fetch_more = lambda: batch  # the trainer's prompt stream: this rank's one prompt, every iteration
    stage.rollout_engine.start(actor)
    return stage


def off_policy(cfg, tokenizer, engines, batch, ctx) -> dict:
    actor = engines["actor"]
    stage = async_stage(cfg, tokenizer, actor, batch)
    generated, generate = [], stage._generate
    stage._generate = lambda *args: generated.append(generate(*args)) or generated[-1]  # what each iteration trains
    updater = Updater(ctx.device, skip_nonfinite=False)
    steps = []
    for step in (1, 2):
        updater.step = step
        steps.append(stage.train_step([batch], engines, updater))
        if step == 1:
            saved = json.loads(json.dumps(stage.off_policy.state_dict()))  # rollout 2, in flight, answered
    stage.off_policy.state_dict()  # rollout 3's loop done before another engine pushes weights
    resumed = async_stage(cfg, tokenizer, actor, batch)
    resumed.off_policy.load_state_dict(saved)
    resumed.iteration = 2
    again = resumed._generate(actor, batch, 0)
    resumed.off_policy.state_dict()
    return {"steps": [{k: float(v) for k, v in m.items() if isinstance(v, (int, float))} for m in steps],
            "saved_iterations": [e["iteration"] for e in saved["ranks"][ctx.rank]],
            "straight": rollout_record(generated[1]), "resumed": rollout_record(again)}


def main(model_dir: str, url: str, out: Path) -> None:
    engine = ["ppo.rollout.engine=vllm", f"ppo.rollout.vllm.urls=[{url}]", f"model.name_or_path={model_dir}",
              f"output_dir={out}"]
    cfg = compose_config([*OVERRIDES, *engine])
    ctx = init_distributed("cpu", 120)
    try:
        validate(cfg, world_size=ctx.world_size)
        tokenizer, stage, engines = stage_and_engines(cfg, model_dir, out, ctx)
        conversation = conversations()[ctx.rank]  # rank r asks the r-th question
        batch = PromptBatch(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long),
                            [conversation[:1]], {"response": [conversation[-1]["content"]]},
                            torch.ones(1, dtype=torch.bool))
        record = {"on_policy": on_policy(stage, engines["actor"], batch, tokenizer, engines)}
        async_cfg = compose_config([*OVERRIDES, *engine, "ppo.off_policy.max_staleness=1"])
        validate(async_cfg, world_size=ctx.world_size)
        record["off_policy"] = off_policy(async_cfg, tokenizer, engines, batch, ctx)
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(record))
        quiesce()
    finally:
        shutdown()


if __name__ == "__main__":
    from llmtrain.distributed import exit_process

    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
    exit_process(0)
