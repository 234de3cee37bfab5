"""ppo.packing in one process: the experience and update forwards of real GRPO rollouts, padded and packed in turn.

    python benchmarks/ppo_packing.py [--repeats 30] [--out results/ppo-packing-forwards.json]

The `--suite ppo` runs compare whole iterations in separate processes, where the other jobs of a shared machine move
each contender's wall time by up to 2x; here both layouts run alternately on the same micro-batches in one process,
so the load hits both alike. The rollouts are the suite's: the sft_tiny base samples 4 responses (temperature 1, at
most 16 new tokens) to each of the first 8 prompts of reverse_train.jsonl, twice (64 sequences: 4 micro-batches of
16). Timed per micro-batch, median over repeats: the experience's forward (`policy_logps`, no grad) and the update's
(`PPOStage._policy_loss`, GRPO's clipped surrogate + k3 KL in the fused head, then backward) and a PPO critic's
(values of a sequence classifier from the same base, then backward), each padded (the trimmed (b, T) rows) and packed
(one row of the real tokens). Also the tokens each layout runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

PROMPTS, GROUP, MAX_NEW_TOKENS, MICRO, ROUNDS = 8, 4, 16, 16, 2


def rollouts(model, tokenizer):
    """(sequences (N, P + A), attention mask, action mask) as llmtrain's rollout lays them out."""
    import torch.nn.functional as F

    from llmtrain.data.prompts import encode_prompt
    from llmtrain.stages.ppo.rollout import up_to_first_eos

    rows = [json.loads(line) for line in (C.REPO / "llmtrain/assets/data/reverse_train.jsonl").read_text().splitlines()]
    ids = [encode_prompt(r["prompt"], tokenizer) for r in rows[:PROMPTS * ROUNDS]]
    width = max(map(len, ids))
    prompts = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids]).repeat_interleave(GROUP, 0)
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(i) for i in ids])[:, None]).long()
    mask = mask.repeat_interleave(GROUP, 0)
    torch.manual_seed(C.INIT_SEED)
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, use_cache=True)
    responses = F.pad(out[:, width:], (0, MAX_NEW_TOKENS - (out.shape[1] - width)), value=tokenizer.pad_token_id)
    actions = up_to_first_eos(responses, torch.tensor([tokenizer.eos_token_id]))
    sequences = torch.cat([prompts, responses.masked_fill(~actions, tokenizer.pad_token_id)], 1)
    return sequences, torch.cat([mask, actions.long()], 1), actions


def micro_batches(sequences, attention_mask, actions):
    from llmtrain.stages.ppo.experience import Experience
    from llmtrain.stages.ppo.rollout import Rollout

    n = sequences.shape[0]
    exp = Experience.of_rollout(Rollout(sequences, attention_mask, actions, actions.any(1), [""] * n, {},
                                        torch.ones(n, dtype=torch.bool)), torch.zeros(n))
    exp.advantages = torch.randn(actions.shape, generator=torch.Generator().manual_seed(0))
    return [exp.select(torch.arange(i, i + MICRO)).trimmed() for i in range(0, n, MICRO)]


def timed(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    C.set_threads()
    from llmtrain.compose import compose_config
    from llmtrain.models.attention import PACKABLE_SDPA
    from llmtrain.models.load import build_model, load_tokenizer
    from llmtrain.stages.ppo.experience import forward_rows, policy_logps, values_of
    from llmtrain.stages.registry import build_stage
    from ppo import sft_tiny_base

    base = sft_tiny_base()
    tokenizer = load_tokenizer(base, trust_remote_code=False)
    model = build_model(name_or_path=base, from_config=None, config_path=None, tokenizer=tokenizer,
                        attn_implementation=PACKABLE_SDPA, dropout=0.0, activation_checkpointing=False,
                        trust_remote_code=False, fused_head_chunk=0)
    stage = build_stage(compose_config(["recipe=grpo_tiny", "ppo.epochs=2"]), tokenizer, PACKABLE_SDPA)
    stage.kl_loss_coef = 0.04
    micro = micro_batches(*rollouts(model, tokenizer))

    class Engine:  # what policy_logps reads of an engine
        module = model

        @staticmethod
        def autocast():
            return torch.autocast("cpu", enabled=False)

    def experience(attention):
        return lambda: [policy_logps(Engine, mb, 1.0, forward_rows(mb, attention)) for mb in micro]

    def update(attention):
        def run():
            stage.experience = dataclasses.replace(stage.experience, packed_attention=attention)
            for mb in micro:
                stage._policy_loss(model, mb)[0].backward()
        return run

    critic = build_model(name_or_path=base, from_config=None, config_path=None, tokenizer=tokenizer,
                         attn_implementation=PACKABLE_SDPA, dropout=0.0, activation_checkpointing=False,
                         trust_remote_code=False, head="scalar")

    def critic_update(attention):
        return lambda: [values_of(critic, critic, mb, forward_rows(mb, attention)).sum().backward() for mb in micro]

    result = {"micro_batches": len(micro), "micro_batch": MICRO, "repeats": args.repeats,
              "padded_tokens": sum(mb.sequences.numel() for mb in micro),
              "real_tokens": sum(int(mb.attention_mask.sum()) for mb in micro)}
    for phase, make in (("experience", experience), ("update", update), ("critic_update", critic_update)):
        for _ in range(3):  # warm-up, alternating
            make(None)(), make(PACKABLE_SDPA)()
        padded, packed = [], []
        for _ in range(args.repeats):  # alternate, so the machine's load falls on both alike
            padded.append(timed(make(None), 1))
            packed.append(timed(make(PACKABLE_SDPA), 1))
        result[phase] = {"padded_s": statistics.median(padded), "packed_s": statistics.median(packed),
                         "packed_over_padded": statistics.median(packed) / statistics.median(padded)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
