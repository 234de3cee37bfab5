"""PPO's pieces on fixed inputs under torchrun (the worker tests/dist/workers/ppo_probe.py): generation that stops
at a different length on each rank under ZeRO-3 and FSDP2 (no hang, the plain HF loop's greedy tokens, a training
step after it), and one PPO iteration on fixed global rollouts equal on 2 ranks and on 1."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import PYTHON, REPO, assert_ok, cli_env

pytestmark = pytest.mark.dist

UPDATE_METRICS = ("policy_loss", "value_loss", "grad_norm", "clip_frac", "approx_kl", "entropy", "explained_var")


@pytest.fixture(scope="module")
def probes(tiny_model_dir, tmp_path_factory):
    results = {}

    def run(backend: str, nproc: int) -> list[dict]:
        key = (backend, nproc)
        if key not in results:
            out = tmp_path_factory.mktemp(f"probe_{backend}_{nproc}")
            cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
                   "-m", "tests.dist.workers.ppo_probe", str(tiny_model_dir), backend, str(out)]
            import subprocess

            # the probe's collectives time out after 120 s: a hang fails the test instead of blocking CI
            assert_ok(subprocess.run(cmd, env=cli_env(PYTHONPATH=str(REPO)), capture_output=True, text=True,
                                     timeout=400, cwd=REPO))
            results[key] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
        return results[key]

    return run


def plain_greedy(model_dir, prompt: list[int], new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        for _ in range(new_tokens):  # no KV cache, no generate(): the plain loop
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", ["zero3", "fsdp2"])
def test_generation_stops_at_different_lengths_per_rank_without_hanging(probes, backend, tiny_model_dir):
    from transformers import AutoTokenizer

    bos = AutoTokenizer.from_pretrained(tiny_model_dir).bos_token_id
    ranks = probes(backend, 2)
    for rank, record in enumerate(ranks):
        assert len(record["generated"]) == 3 + 9 * rank
        assert record["generated"] == plain_greedy(tiny_model_dir, [bos, 40, 41, 42 + rank], 3 + 9 * rank)
    assert all(math.isfinite(record["grad_norm"]) for record in ranks)  # a training step after generation


@pytest.mark.parametrize("backend", ["ddp", "zero3", "fsdp2"])
def test_update_on_two_ranks_equals_one_rank(probes, backend):
    """The same 8 fixed rollouts, rows split over 2 ranks or all on 1: the same experience and the same update."""
    single, = probes("ddp", 1)
    for record in probes(backend, 2):
        assert torch.allclose(torch.tensor(record["old_logps"]), torch.tensor(single["old_logps"]), atol=1e-6)
        assert torch.allclose(torch.tensor(record["advantages"]), torch.tensor(single["advantages"]), atol=1e-5)
        for key in UPDATE_METRICS:
            assert record[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), key
        assert record["first_ratio_dev"] == 0.0
