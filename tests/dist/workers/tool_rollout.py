"""Run under torchrun by tests/dist/test_ppo_tools.py: GRPO with a calculator tool (ppo.tools) on 2 ranks.

1. One multi-turn rollout of this rank's prompt: every row's tokens, attention and action (model's own) masks.
2. Its experience (the whole global batch) and the policy loss's gradient with respect to each action's log-prob:
   what weight each token has in the loss.
3. Two GRPO iterations through the stage's train_step (tool metrics, first ratio), and the greedy held-out eval.
Writes one JSON per rank to OUT/rank<r>.json.

usage: torchrun ... -m tests.dist.workers.tool_rollout MODEL_DIR OUT
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
from llmtrain.trainer import Updater
from llmtrain.validation import validate
from tests.dist.workers.ppo_probe import stage_and_engines
from tests.dist.workers.tools import conversations

OVERRIDES = ["recipe=grpo_tiny", "backend=ddp", "ppo.tools=[tests.dist.workers.tools:add]",
             "ppo.reward.function=tests.dist.workers.tools:exact", "ppo.rollout.prompts_per_step=2",
             "ppo.rollout.n_samples_per_prompt=4", "ppo.mini_batch_size=8", "ppo.epochs=2",
             "ppo.rollout.max_new_tokens=144", "ppo.max_tool_calling_iterations=2", "data.max_seq_len=512",
             "trainer.micro_batch_size=4", "ppo.kl.coef=0.01", "optim.lr=1e-4"]


def main(model_dir: str, out: Path) -> None:
    cfg = compose_config([*OVERRIDES, f"model.name_or_path={model_dir}", f"output_dir={out}"])
    ctx = init_distributed("cpu", 120)
    try:
        validate(cfg, world_size=ctx.world_size)
        tokenizer, stage, engines = stage_and_engines(cfg, model_dir, out, ctx)
        actor = engines["actor"]
        conversation = conversations()[ctx.rank]  # rank r asks the r-th question
        batch = PromptBatch(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long),
                            [conversation[:1]], {"response": [conversation[-1]["content"]]},
                            torch.ones(1, dtype=torch.bool))
        stage.iteration = 1
        rollout = stage.rollout_engine.generate(actor, batch, stage.sampling, pad_token_id=tokenizer.pad_token_id,
                                                eos_ids=stage.eos_ids, seed=7, group=actor.dp_group)
        scores = stage.raw_scores(rollout, engines)[0]
        exp = gather_rollout(rollout, scores, actor.dp_group)
        layouts = stage._layouts(exp.sequences.shape[0], actor)
        first_epoch = [rows for mini_batch in layouts[0] for rows in mini_batch]
        exp = make_experience(exp, engines, first_epoch, 0.01, stage.experience, group=actor.dp_group)
        logps = exp.old_logps.clone().requires_grad_(True)  # (B, A): the loss's own function of the log-probs
        weights, _ = stage._aggregation(exp)
        loss = stage._loss_terms(logps, torch.zeros_like(logps), exp.old_logps.detach() - 0.1, exp.advantages,
                                 exp.action_mask, exp.ref_logps, weights)[0]
        loss.backward()
        updater = Updater(ctx.device, skip_nonfinite=False)
        steps = []
        for step in (1, 2):
            updater.step = step
            steps.append(stage.train_step([batch], engines, updater))
        evaluation = stage.evaluate([batch], engines)
        record = {"sequences": rollout.sequences.tolist(), "attention_mask": rollout.attention_mask.tolist(),
                  "action_mask": rollout.action_mask.tolist(), "ended": rollout.ended.tolist(),
                  "texts": rollout.texts, "metrics": rollout.metrics, "scores": scores.tolist(),
                  "exp_action_mask": exp.action_mask.tolist(), "advantages": exp.advantages.tolist(),
                  "kl": exp.kl.tolist(), "grad": logps.grad.tolist(),
                  "steps": [{k: float(v) for k, v in m.items() if isinstance(v, (int, float))} for m in steps],
                  "eval": evaluation}
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(record))
        quiesce()
    finally:
        shutdown()


if __name__ == "__main__":
    from llmtrain.distributed import exit_process

    main(sys.argv[1], Path(sys.argv[2]))
    exit_process(0)
