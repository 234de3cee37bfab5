"""Shared pieces of the benchmarks: the fixed model, the generated SFT data, token counting, the
throughput window, per-process peak RSS, collective-byte counting and per-rank tensor bytes.

Every contender imports this file, so the model, the data and the figure of merit cannot drift apart.
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import resource
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "llmtrain" / "assets" / "tokenizer"
IGNORE_INDEX = -100

# ---- the model: a tiny Llama, the same for every contender ---------------------------------------
MODEL = dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             tie_word_embeddings=False, use_cache=False)
INIT_SEED = 1234

# ---- the data: variable-length SFT samples ---------------------------------------------------------
# Total tokens per sample (bos + prompt + response + eos, one byte = one token) are log-normal with
# median 100 and sigma 0.7, clipped to [16, 512]; the prompt (with its bos) is a third of the sample.
DATA = dict(num_samples=1024, median=100, sigma=0.7, min_len=16, max_len=512, prompt_fraction=1 / 3, seed=0)
MAX_SEQ_LEN = 512
ALPHABET = "abcdefghijklmnopqrstuvwxyz     "  # ~1 space in 6: word-like text, all one byte each

# ---- optimisation: identical for every contender -----------------------------------------------------
OPTIM = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, max_grad_norm=1.0)  # AdamW, constant lr
GLOBAL_BATCH_SAMPLES = 16  # unpacked contenders: samples per optimizer step
GLOBAL_BATCH_ROWS_PACKED = 4  # packed contenders: rows of MAX_SEQ_LEN (~16 samples) per step


def sample_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lo, hi = DATA["min_len"], DATA["max_len"]
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(DATA["median"]), DATA["sigma"])))) for _ in range(n)]


def generate_samples(n: int = DATA["num_samples"], seed: int = DATA["seed"]) -> list[dict]:
    """Deterministic prompt/response texts whose token counts follow the DATA distribution.

    Each sample tokenises (llmtrain's prompt_response format) to [bos] prompt response [eos]: the text
    lengths are chosen so that the total is the drawn length and bos+prompt is a third of it.
    """
    rng = random.Random(seed + 1)
    samples = []
    for length in sample_lengths(n, seed):
        prompt_bytes = max(1, round(length * DATA["prompt_fraction"]) - 1)
        response_bytes = length - 2 - prompt_bytes
        text = lambda k: "".join(rng.choice(ALPHABET) for _ in range(k))  # noqa: E731
        samples.append({"prompt": text(prompt_bytes), "response": text(response_bytes), "length": length})
    return samples


def encode(sample: dict, bos: int, eos: int) -> tuple[list[int], list[int]]:
    """input_ids and aligned labels exactly as llmtrain's prompt_response format builds them (byte tokens)."""
    prompt = [bos] + list(_bytes_to_ids(sample["prompt"]))
    response = list(_bytes_to_ids(sample["response"])) + [eos]
    return prompt + response, [IGNORE_INDEX] * len(prompt) + response


_TOKENIZER = None


def tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer
        _TOKENIZER = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
        _TOKENIZER.pad_token = _TOKENIZER.eos_token  # what llmtrain's loader does
    return _TOKENIZER


def _bytes_to_ids(text: str) -> list[int]:
    return tokenizer()(text, add_special_tokens=False)["input_ids"]


def data_stats(samples: list[dict]) -> dict:
    lengths = sorted(s["length"] for s in samples)
    targets = [len(s["response"]) + 1 for s in samples]  # response + eos
    q = lambda p: lengths[min(len(lengths) - 1, int(p * len(lengths)))]  # noqa: E731
    return {"samples": len(lengths), "mean_tokens": sum(lengths) / len(lengths), "p10": q(0.1), "p50": q(0.5),
            "p90": q(0.9), "p99": q(0.99), "max": lengths[-1], "min": lengths[0],
            "target_fraction": sum(targets) / sum(lengths)}


def padded_tokens_of_step(step: int, batch: int) -> int:
    """Tokens, padding included, of 0-based unpacked step `step` (every contender reads samples in order)."""
    lengths = [s["length"] for s in generate_samples()[step * batch:(step + 1) * batch]]
    return batch * max(lengths)


def llmtrain_permutation(n: int, seed: int) -> list[int]:
    """The order llmtrain's StepBatchSampler visits n examples in epoch 0 (randperm seeded with `seed`)."""
    import torch
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def write_llmtrain_jsonl(samples: list[dict], path: Path, seed: int) -> None:
    """Rows placed so that llmtrain's shuffled epoch 0 visits them in `samples` order: unpacked llmtrain
    then trains on exactly the same batches as the plain loop and HF (file row perm[j] = sample j)."""
    perm = llmtrain_permutation(len(samples), seed)
    rows = [None] * len(samples)
    for j, row_index in enumerate(perm):
        rows[row_index] = samples[j]
    with open(path, "w") as f:
        for s in rows:
            f.write(json.dumps({"prompt": s["prompt"], "response": s["response"]}) + "\n")


def save_model(directory: Path, model_fields: dict | None = None) -> int:
    """The tiny Llama, randomly initialised with INIT_SEED, saved once: every contender loads these weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(model_fields or MODEL)
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=len(tokenizer()), **fields)
    config.pad_token_id = tokenizer().pad_token_id
    torch.manual_seed(INIT_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer().save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def load_model(directory: Path):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")


def count_targets(labels) -> int:
    """Target tokens of a (B, T) label tensor, aligned with input_ids: labels[:, 1:] != -100."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def window_throughput(step_end_times: list[float], step_tokens: list[int], warmup: int,
                      step_end_cpu: list[float] | None = None) -> dict:
    """Target tokens/s over the steps after `warmup`, wall clock from the end of the last warm-up step
    to the end of the last step: data loading, collation, logging and the step itself all count.
    With `step_end_cpu` (process CPU time, all threads) also target tokens per CPU-second over the same
    window: on a shared machine that one moves much less with the neighbours' load than wall time."""
    if len(step_end_times) <= warmup or warmup < 1:
        raise ValueError(f"need more than {warmup} steps (got {len(step_end_times)}), warmup >= 1")
    elapsed = step_end_times[-1] - step_end_times[warmup - 1]
    tokens = sum(step_tokens[warmup:])
    periods = [b - a for a, b in zip(step_end_times[warmup - 1:], step_end_times[warmup:])]
    result = {"tokens_per_s": tokens / elapsed, "measured_steps": len(periods), "measured_s": elapsed,
              "target_tokens_per_step": tokens / len(periods), "median_step_s": sorted(periods)[len(periods) // 2]}
    if step_end_cpu:
        result["tokens_per_cpu_s"] = tokens / (step_end_cpu[len(periods) + warmup - 1] - step_end_cpu[warmup - 1])
    return result


PAIR_KEYS = {"tokens_per_s": "pairs_per_s", "tokens_per_cpu_s": "pairs_per_cpu_s",
             "target_tokens_per_step": "pairs_per_step"}


def in_pairs(window: dict) -> dict:
    """A `window_throughput` result whose counts were preference pairs (reward model, DPO): keys renamed."""
    return {PAIR_KEYS.get(k, k): v for k, v in window.items()}


def peak_rss_self_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def write_result(path: str | None, result: dict) -> None:
    result = dict(result, peak_rss_self_mb=peak_rss_self_mb())
    if path:
        Path(path).write_text(json.dumps(result, indent=1))
    else:
        print(json.dumps(result, indent=1))


def set_threads() -> None:
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))


def now() -> float:
    return time.perf_counter()


# ---- collectives: counted from the real calls ----------------------------------------------------------

def _tensor_bytes(x) -> int:
    import torch
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def comm_counter():
    """A TorchDispatchMode that counts every c10d / functional collective dispatched while it is active
    (DDP's reducer, FSDP2, DeepSpeed and DTensor all go through these ops), with its payload size:
    the full (unsharded) tensor for all-gather and reduce-scatter, the tensor for all-reduce/broadcast."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CommCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls, self.bytes = Counter(), Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
            if "c10d" in name and not any(k in name for k in ("wait", "barrier", "monitored", "_wrap_tensor")):
                kind = _collective_kind(name)
                if name.startswith("_c10d_functional") or name.startswith("c10d_functional"):
                    payload = _tensor_bytes(args[0])
                    if "all_gather" in name:
                        payload *= int(args[1])  # group size: the gathered tensor
                else:
                    tensor_args = [a for a in args if _tensor_bytes(a)]
                    payload = max((_tensor_bytes(a) for a in tensor_args), default=0)
                self.calls[kind] += 1
                self.bytes[kind] += payload
            return func(*args, **(kwargs or {}))

    return CommCounter()


def _collective_kind(name: str) -> str:
    for key, kind in (("reduce_scatter", "reduce_scatter"), ("allgather", "all_gather"),
                      ("all_gather", "all_gather"), ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
                      ("broadcast", "broadcast"), ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"),
                      ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"), ("send", "p2p"),
                      ("recv", "p2p")):
        if key in name:
            return kind
    return name


def live_tensor_bytes() -> dict:
    """Bytes of every distinct tensor storage reachable from Python objects (gc), by device; after an
    optimizer step (activations freed) this is the rank's model states: weights, grads (when kept),
    optimizer moments, ZeRO/FSDP flat buffers, plus a few KiB of batch and rotary tables."""
    import torch
    seen, total = set(), Counter()
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.is_meta:
                continue
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), obj.device.type)
            if storage.data_ptr() == 0 or key in seen:
                continue
            seen.add(key)
            total[obj.device.type] += storage.nbytes()
        except Exception:  # wrapper subclasses (DTensor) have no storage: their local shard is found itself
            continue
    return dict(total)
