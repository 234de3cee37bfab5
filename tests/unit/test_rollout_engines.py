"""The rollout engines' pure parts: what ppo.rollout.engine and its fields refuse, the server's command line (llmtrain's
settings, never vLLM's defaults), a choice's tokens and log-probs, and the behaviour log-probs of the hf sampler
against the trainer's forward (the mismatch the metrics measure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmtrain.compose import compose_config
from llmtrain.stages.ppo.build import importance_mode, old_logps_from_update
from llmtrain.stages.ppo.checks import ppo_problems
from llmtrain.stages.ppo.engines.vllm_choices import tokens_and_logps
from llmtrain.stages.ppo.engines.vllm_server import ServerSettings, server_command
from llmtrain.stages.ppo.rollout import up_to_first_eos
from llmtrain.validation import stage_problems


def problems(*overrides: str) -> list[str]:
    cfg = compose_config(["recipe=grpo_tiny", *overrides])
    return ppo_problems(cfg, "grpo", 1)


def test_engine_fields_are_checked_naming_the_field_and_the_fix():
    assert not problems("ppo.rollout.engine=vllm", "ppo.rollout.vllm.urls=[http://127.0.0.1:8000]")
    assert any("exactly one of ppo.rollout.vllm.urls" in p for p in problems("ppo.rollout.engine=vllm"))
    both = problems("ppo.rollout.engine=vllm", "ppo.rollout.vllm.urls=[http://a:1]", "ppo.rollout.vllm.python=/x")
    assert any("exactly one of" in p for p in both)
    assert any("must start with http://" in p
               for p in problems("ppo.rollout.engine=vllm", "ppo.rollout.vllm.urls=[127.0.0.1:8000]"))
    assert "ppo.rollout.engine='sglang' is not one of hf, vllm" in problems("ppo.rollout.engine=sglang")
    assert any("set ppo.rollout.engine=vllm" in p for p in problems("ppo.rollout.vllm.urls=[http://a:1]"))
    assert any("generation_batch_size apply to the hf engine" in p for p in problems(
        "ppo.rollout.engine=vllm", "ppo.rollout.vllm.urls=[http://a:1]", "ppo.rollout.generation_batch_size=4"))
    assert any("importance_sampling.mode=token_mask weighs" in p for p in problems(
        "ppo.old_logprobs=engine", "ppo.importance_sampling.mode=token_mask"))
    assert any("clip_min=3.0 must be below" in p for p in problems("ppo.importance_sampling.clip_min=3.0"))


def test_a_stage_that_samples_nothing_refuses_the_engine():
    cfg = compose_config(["recipe=sft_tiny", "ppo.rollout.engine=vllm"])
    assert any(p.startswith("ppo.rollout.engine is set but stage=sft does not read it") for p in stage_problems(cfg))
    assert not stage_problems(compose_config(["recipe=sft_tiny"]))


def test_importance_sampling_auto_follows_the_engine_and_costs_the_shortcut():
    on_policy = ["ppo.epochs=1", "ppo.mini_batch_size=128"]  # grpo_tiny: 32 prompts × 4 samples in one update
    hf = compose_config(["recipe=grpo_tiny", *on_policy]).ppo
    vllm = compose_config(["recipe=grpo_tiny", *on_policy, "ppo.rollout.engine=vllm"]).ppo
    engine_old = compose_config(["recipe=grpo_tiny", *on_policy, "ppo.rollout.engine=vllm",
                                 "ppo.old_logprobs=engine"]).ppo
    assert importance_mode(hf) is None and old_logps_from_update(hf)
    assert importance_mode(vllm) == "sequence_mask" and not old_logps_from_update(vllm)  # π_old before the update
    assert importance_mode(engine_old) is None and not old_logps_from_update(engine_old)


def test_the_server_runs_with_llmtrains_settings():
    settings = ServerSettings(python="/env/bin/python", precision="fp32", max_model_len=64, args=("-tp", "2"))
    command = server_command(settings, Path("/w"), 1234, gpu=False)
    flag = {name: command[command.index(name) + 1] for name in ("--dtype", "--generation-config", "--logprobs-mode",
                                                                "--max-model-len", "--host")}
    assert flag == {"--dtype": "float32", "--generation-config": "vllm", "--logprobs-mode": "processed_logprobs",
                    "--max-model-len": "64", "--host": "127.0.0.1"}
    assert {"--skip-tokenizer-init", "--enable-scale-out", "--enforce-eager"} <= set(command)
    assert command[-2:] == ["-tp", "2"]
    gpu = server_command(ServerSettings(python="p", precision="bf16", max_model_len=8), Path("/w"), 1, gpu=True)
    assert gpu[gpu.index("--dtype") + 1] == "bfloat16" and "--enforce-eager" not in gpu


def _choice(tokens, logps, finish="length", stop=None) -> dict:
    return {"token_ids": tokens, "finish_reason": finish, "stop_reason": stop,
            "logprobs": {"content": [{"logprob": v} for v in logps]}}


def test_a_choice_keeps_the_stop_token_it_ended_at():
    tokens, logps = tokens_and_logps(_choice([5, 6], [-0.5, -0.25]))
    assert tokens == [5, 6] and logps.tolist() == [-0.5, -0.25]
    tokens, logps = tokens_and_logps(_choice([5, 6], [-0.5, -0.25], "stop", 257))  # the engine left it out
    assert tokens == [5, 6, 257] and logps.tolist() == [-0.5, -0.25, 0.0]
    tokens, _ = tokens_and_logps(_choice([5, 257], [-0.5, -0.1], "stop", 257))  # already in
    assert tokens == [5, 257]


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5), (0.0, 0)])
def test_the_hf_sampler_returns_what_it_drew_from(temperature, top_k, tiny_llama):
    """The lean loop's behaviour log-probs equal the log-softmax of the processed logits the trainer would take for
    those tokens (full softmax at that temperature without top-k; greedy: the full distribution)."""
    from llmtrain.stages.ppo import sampler

    model = tiny_llama(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1).eval()
    ids, mask = torch.randint(3, 50, (3, 4)), torch.ones(3, 4, dtype=torch.long)
    drawn = []
    out = sampler.sample(model, ids, mask, max_new_tokens=5, temperature=temperature, top_k=top_k, top_p=1.0,
                         pad_token_id=0, eos_ids=[1], logps=drawn)
    with torch.no_grad():
        logits = model(out).logits[:, 3:-1].float()  # (B, a, V): the positions that predicted each drawn token
    if temperature > 0:
        logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    expected = torch.log_softmax(logits, -1).gather(2, out[:, 4:, None]).squeeze(2)
    actions = up_to_first_eos(out[:, 4:], torch.tensor([1]))  # after its EOS a row draws pad, not what it scored
    assert drawn[0].shape == expected.shape and actions.sum() > 5
    assert torch.allclose(drawn[0][actions], expected[actions], atol=1e-5)
