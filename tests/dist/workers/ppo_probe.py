"""Run under torchrun by tests/dist/test_ppo_probe.py: PPO's pieces on fixed inputs, on any backend and world size.

1. Generation with a different number of new tokens on each rank (rank r: 3 + 9·r), greedy: ranks finish at
   different times; with the actor gathered/unsharded once, no rank waits for another inside `generate`.
2. One PPO iteration's experience and update on FIXED global rollouts (the same 8 sequences whatever the world
   size; rank r holds rows r·8/world ..): the update is the same on 1 rank and on 2.
Writes one JSON per rank to OUT/rank<r>.json.

usage: torchrun ... -m tests.dist.workers.ppo_probe MODEL_DIR BACKEND OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from llmtrain.backends import build_backend
from llmtrain.compose import compose_config
from llmtrain.data.prompts import PromptBatch
from llmtrain.distributed import init_distributed, quiesce, shutdown
from llmtrain.models.load import load_tokenizer
from llmtrain.roles import ModelOptions, build_engines
from llmtrain.run import backend_options, optimizer_spec
from llmtrain.stages.ppo.experience import gather_rollout, make_experience
from llmtrain.stages.ppo.rollout import Rollout, SamplingSettings, generate
from llmtrain.stages.registry import build_stage
from llmtrain.trainer import Updater

GLOBAL_ROWS, PROMPT, ACTIONS = 8, 5, 6


def fixed_rollouts(vocab: int, eos: int, pad: int) -> tuple[Rollout, torch.Tensor]:
    """8 sequences: left-padded prompts of 2..5 tokens, responses of 1..6 actions, some ending in EOS."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (GLOBAL_ROWS, PROMPT + ACTIONS), generator=g)
    prompt_len = torch.tensor([5, 2, 3, 4, 5, 3, 2, 4])
    action_len = torch.tensor([6, 1, 3, 2, 5, 6, 4, 2])
    columns = torch.arange(PROMPT + ACTIONS)
    prompt_mask = columns[:PROMPT] >= PROMPT - prompt_len[:, None]
    action_mask = columns[:ACTIONS] < action_len[:, None]
    ends = torch.tensor([True, False, True, True, False, False, True, True])
    last = action_len - 1
    tokens[torch.arange(GLOBAL_ROWS)[ends], PROMPT + last[ends]] = eos
    mask = torch.cat([prompt_mask, action_mask], 1)
    tokens[~mask] = pad
    scores = torch.linspace(-1.0, 1.0, GLOBAL_ROWS)
    rollout = Rollout(tokens, mask.long(), action_mask, ends, [""] * GLOBAL_ROWS, {},
                      torch.ones(GLOBAL_ROWS, dtype=torch.bool))
    return rollout, scores


def local_rows(rollout: Rollout, scores: torch.Tensor, rank: int, world: int) -> tuple[Rollout, torch.Tensor]:
    rows = slice(rank * GLOBAL_ROWS // world, (rank + 1) * GLOBAL_ROWS // world)
    return Rollout(rollout.sequences[rows], rollout.attention_mask[rows], rollout.action_mask[rows],
                   rollout.ended[rows], rollout.prompts[rows], {}, rollout.real[rows]), scores[rows]


def stage_and_engines(cfg, model_dir: str, out: Path, ctx) -> tuple:
    """(tokenizer, stage, engines) of the config's stage on this process group as a run builds them: fp32, sdpa,
    seed 1234, the model and tokenizer of `model_dir`."""
    tokenizer = load_tokenizer(model_dir, False)
    stage = build_stage(cfg, tokenizer, "sdpa")
    backend = build_backend(cfg.backend.name, ctx, "fp32", backend_options(cfg, out))
    engines = build_engines(stage.roles, backend, tokenizer, ModelOptions("sdpa", 0.0, False), 1234,
                            optimizer_spec(cfg, stage.optimizer_steps_per_step()))
    return tokenizer, stage, engines


def main(model_dir: str, backend_name: str, out: Path) -> None:
    cfg = compose_config(["recipe=ppo_tiny", f"model.name_or_path={model_dir}", f"backend={backend_name}",
                          "ppo.rollout.prompts_per_step=2", "ppo.mini_batch_size=4", "ppo.epochs=2",
                          "trainer.micro_batch_size=2", "ppo.rollout.max_new_tokens=12", f"output_dir={out}"])
    ctx = init_distributed("cpu", 120)
    try:
        tokenizer, stage, engines = stage_and_engines(cfg, model_dir, out, ctx)
        actor = engines["actor"]
        prompt = torch.tensor([[tokenizer.bos_token_id, 40, 41, 42 + ctx.rank]])
        batch = PromptBatch(prompt, torch.ones_like(prompt), [""], {}, torch.ones(1, dtype=torch.bool))
        greedy = SamplingSettings(max_new_tokens=3 + 9 * ctx.rank, temperature=0.0)
        never = len(tokenizer) + 1  # an id no model emits: every rank runs to its own max_new_tokens
        generated = generate(actor, batch, greedy, pad_token_id=tokenizer.pad_token_id, eos_ids=[never], seed=0,
                             group=actor.dp_group)
        rollout, scores = fixed_rollouts(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        rollout, scores = local_rows(rollout, scores, actor.dp_rank, actor.dp_size)
        stage.iteration = 1
        exp = gather_rollout(rollout, scores, actor.dp_group)
        layouts = stage._layouts(exp.sequences.shape[0], actor)
        first_epoch = [rows for mini_batch in layouts[0] for rows in mini_batch]
        exp = make_experience(exp, engines, first_epoch, 0.05, stage.experience, group=actor.dp_group)
        updater = Updater(ctx.device, skip_nonfinite=False)
        updater.step = 1
        metrics = stage._update(exp, engines, updater, layouts)
        record = {"generated": generated.responses[0][generated.action_mask[0]].tolist(),
                  "advantages": exp.advantages.tolist(), "old_logps": exp.old_logps.tolist(), **metrics}
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(record))
        quiesce()  # before the engines go (llmtrain.distributed.quiesce)
    finally:
        shutdown()


if __name__ == "__main__":
    from llmtrain.distributed import exit_process

    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
    exit_process(0)
