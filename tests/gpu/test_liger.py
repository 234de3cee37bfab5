"""model.fused_loss=liger on ONE GPU: Liger Kernel's fused linear cross-entropy against the chunked fused head
(models/fused_head.py) on the same tiny models, the causal-LM sum of a padded batch with -100 labels: the loss and
every parameter's gradient, in fp32 and under bf16 autocast; Gemma 2's final-logit softcap with tied embeddings too.
`auto` picks Liger there for SFT and the chunked path for DPO (per-token log-probs).

Skipped without CUDA, and without liger_kernel (`pip install 'llmtrain[liger]'`); the reason is printed. The
selection and the refusals are tested on the CPU (tests/unit/test_liger_selection.py).
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: Liger's kernels need one", allow_module_level=True)
pytest.importorskip("liger_kernel", reason="liger_kernel is not installed: pip install 'llmtrain[liger]'")

from llmtrain.losses.lm import IGNORE_INDEX  # noqa: E402
from llmtrain.models.fused_head import HeadQuery, asking, negative_log_likelihood, shifted_targets  # noqa: E402
from llmtrain.models.load import build_model, load_tokenizer  # noqa: E402
from tests.helpers import PYTHON, REPO, TOKENIZER_DIR, assert_ok, cli_env, read_metrics  # noqa: E402

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
GEMMA2 = {**TINY, "model_type": "gemma2", "head_dim": 16, "tie_word_embeddings": True}
# fp32: both paths sum the same fp32 terms in other orders; bf16: each matmul rounds to 8 bits of mantissa
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 5e-2)}  # (loss, gradient) relative


def loss_and_grads(kernel: str, config: dict, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokenizer = load_tokenizer(str(TOKENIZER_DIR), trust_remote_code=False)
    model = build_model(name_or_path=None, from_config=config, config_path=None, tokenizer=tokenizer,
                        attn_implementation="eager", dropout=0.0, activation_checkpointing=False,
                        trust_remote_code=False, seed=0, fused_head_chunk=16, fused_head_kernel=kernel).cuda()
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, len(tokenizer), (4, 40), generator=g).cuda()  # (B, T)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 30:] = 0  # a padded row
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, :10] = IGNORE_INDEX  # the prompt
    query = HeadQuery(shifted_targets(labels), token_loss=negative_log_likelihood)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), asking(model, query) as ask:
        out = model(input_ids=input_ids, attention_mask=attention_mask, **ask.kwargs)
        loss = ask.read(out.logits).loss_sum  # −Σ log p over the targets
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [TINY, GEMMA2], ids=["llama", "gemma2_softcap_tied"])
def test_liger_equals_the_chunked_head(config, dtype):
    loss_rel, grad_rel = TOLERANCE[dtype]
    liger_loss, liger_grads = loss_and_grads("liger", config, dtype)
    chunked_loss, chunked_grads = loss_and_grads("chunked", config, dtype)
    assert abs(liger_loss - chunked_loss) <= loss_rel * chunked_loss.abs(), (liger_loss, chunked_loss)
    assert liger_grads.keys() == chunked_grads.keys()
    for name, grad in chunked_grads.items():
        error = (liger_grads[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert error <= grad_rel, (name, error.item())


@pytest.mark.parametrize("recipe,kernel", [("sft_tiny", "liger"), ("dpo_tiny", "chunked")])
def test_auto_picks_liger_for_sft_and_chunked_for_dpo(tmp_path, recipe, kernel):
    """Two bf16 steps of each recipe under model.fused_loss=auto, with Liger's fused linear cross-entropy wrapped to
    record its calls (tests/gpu/workers/count_liger.py): SFT's training loss ran through it on the GPU, over the
    model's whole vocabulary, at least once a step; DPO never called it. The log names the same kernel."""
    calls_file = tmp_path / "liger_calls.json"
    args = [f"recipe={recipe}", "device=cuda", "precision=bf16", "trainer.max_steps=2", "trainer.eval_every_n_steps=0",
            "trainer.save_every_n_steps=0", "model.fused_loss=auto", f"output_dir={tmp_path / 'run'}"]
    result = subprocess.run([PYTHON, "-m", "tests.gpu.workers.count_liger", str(calls_file), *args], env=cli_env(),
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert_ok(result)
    calls = json.loads(calls_file.read_text())
    if kernel == "liger":
        vocab = len(load_tokenizer(str(TOKENIZER_DIR), trust_remote_code=False))
        assert len(calls) >= 2, calls  # one call or more per optimizer step
        assert all(c["device"] == "cuda" and c["vocab"] == vocab and c["tokens"] > 0 for c in calls), calls
        assert all(math.isfinite(c["loss"]) and c["loss"] > 0 for c in calls), calls
    else:
        assert calls == []  # per-token log-probs: the chunked head only
    assert f"summed loss: {kernel} (model.fused_loss=auto" in result.stdout + result.stderr
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in read_metrics(tmp_path / "run")[0])
