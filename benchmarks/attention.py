"""Packed attention, one batch: forward and forward+backward time per attention implementation.

    python benchmarks/attention.py                       # CPU, fp32, ~2 min on 2 busy cores (compiles ~30 s cold)
    python benchmarks/attention.py --device cuda         # GPU, bf16 (+ flash_attention_2 when installed)

One packed batch (default 4 rows x 512 tokens, the benchmark data's variable-length samples packed
best-fit: 18 samples, width 505) run through (a) the tiny Llama of common.py (4 layers, h=128, 4 heads, 2 kv-heads)
and (b) one attention op alone (that model's first attention module, q (B, 4, T, 32), k/v (B, 2, T, 32)):
- sdpa_segments: causal sdpa per packed sample, launched from Python (llmtrain's default off flash-attention);
- sdpa: one sdpa over the rows with the dense (B, 1, T, T) float block mask;
- flex_segments eager / compiled: FlexAttention with the batch's document BlockMask, plain or
  `torch.compile(flex_attention)` (LLMTRAIN_FLEX_COMPILE=0/1; on CUDA compiled is flex_segments' default);
- flash_attention_2 (CUDA, 16-bit, when flash-attn is installed; model only).
torch 2.13 refuses FlexAttention's backward on the CPU up front (NotImplementedError, eager and compiled); the
flex rows' forward+backward on the CPU lift that refusal: the eager reference backward then runs (what a CPU
could do at best), the compiled one records the error inductor gives. "prep" is `Batch.for_attention` (the
mask or BlockMask construction), once per batch.

Timing: `--warmup` untimed calls (the first one, compile included, is reported as "first call"), then
`--repeats` timed calls, for each contender in turn, `--rounds` rounds in a rotated order; the median and
the min wall time and the median process CPU time over all timed calls (one thread on a shared machine: CPU
time is the steadier figure, and the CPU table's ratios use it). The load average before and after each
contender goes into the JSON and the table.
Writes results/attention[-cuda].json (raw) and results/attention[-cuda].md (the table).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import common as C  # noqa: E402


def packed_batch(rows: int, width: int, vocab: int):
    """`rows` packed rows of up to `width` tokens from the benchmark's sample lengths, as llmtrain collates them."""
    import torch

    from llmtrain.data.collate import collate
    from llmtrain.data.packing import merge_packed, pack_best_fit

    lengths = C.sample_lengths(C.DATA["num_samples"], C.DATA["seed"])
    groups = pack_best_fit(lengths[: rows * 6], width)[:rows]  # ~4 samples a row at median 100: 6 a row is plenty
    generator = torch.Generator().manual_seed(0)
    examples = [merge_packed([{"input_ids": ids, "labels": ids} for ids in
                              (torch.randint(3, vocab, (lengths[i],), generator=generator).tolist() for i in group)])
                for group in groups]
    return collate(examples, pad_token_id=0, pad_to_multiple_of=None)


def build_model(attn: str, device, dtype):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.models.attention import register_segment_attention
    from llmtrain.models.flex import register_flex_attention

    register_segment_attention()
    register_flex_attention()
    fields = dict(C.MODEL)
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=263, **fields)
    torch.manual_seed(C.INIT_SEED)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).to(device).train()


@contextlib.contextmanager
def flex_setting(compiled: bool | None, lift_cpu_refusal: bool):
    """LLMTRAIN_FLEX_COMPILE for the contender; optionally lift torch's up-front refusal of CPU backward."""
    import torch.nn.attention.flex_attention as flex

    from llmtrain.models.flex import COMPILE_ENV
    saved_env, saved_check = os.environ.get(COMPILE_ENV), flex._validate_device
    if compiled is not None:
        os.environ[COMPILE_ENV] = "1" if compiled else "0"
    if lift_cpu_refusal:
        flex._validate_device = lambda query, key, value: None
    try:
        yield
    finally:
        flex._validate_device = saved_check
        if saved_env is None:
            os.environ.pop(COMPILE_ENV, None)
        else:
            os.environ[COMPILE_ENV] = saved_env


def contenders(device_type: str, dtype_name: str) -> list[dict]:
    import importlib.util
    rows = [dict(name="sdpa_segments", attn="sdpa_segments", compiled=None),
            dict(name="sdpa (dense block mask)", attn="sdpa", compiled=None),
            dict(name="flex_segments eager", attn="flex_segments", compiled=False),
            dict(name="flex_segments compiled", attn="flex_segments", compiled=True)]
    if device_type == "cuda" and dtype_name != "fp32" and importlib.util.find_spec("flash_attn"):
        rows.append(dict(name="flash_attention_2", attn="flash_attention_2", compiled=None, model_only=True))
    return rows


def timed(fn, warmup: int, repeats: int, sync) -> dict:
    start = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        fn()
    sync()
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return {"first_call_s": first, "times_s": times, "cpu_times_s": cpu_times}


def model_step(model, batch, backward: bool):
    import torch

    from llmtrain.losses.lm import lm_loss_sum

    def run():
        if not backward:
            with torch.no_grad():
                model(**batch.model_inputs())
            return
        model.zero_grad(set_to_none=True)
        loss = lm_loss_sum(model(**batch.model_inputs()).logits.float(), batch.labels) / batch.num_targets
        loss.backward()
    return run


def op_step(attn: str, module, batch, qkv, backward: bool):
    """One attention call as the model makes it, on fixed q/k/v: the implementation alone."""
    import torch
    from transformers import AttentionInterface

    function = AttentionInterface()[attn]
    inputs = batch.model_inputs()
    mask, extra = inputs.get("attention_mask"), {k: v for k, v in inputs.items() if k == "segment_lengths"}
    query, key, value = qkv if backward else [x.detach() for x in qkv]  # FlexAttention checks requires_grad

    def run():
        with torch.set_grad_enabled(backward):
            out, _ = function(module, query, key, value, mask, dropout=0.0, scaling=module.scaling, **extra)
        if backward:
            torch.autograd.grad(out.float().square().sum(), (query, key, value))
    return run


def measure(args) -> dict:
    import torch

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.set_num_threads(args.threads)
    base = packed_batch(args.rows, args.width, 263)
    info = {"rows": args.rows, "width": base.width, "samples": sum(len(r) for r in base.seq_lens),
            "tokens": sum(map(sum, base.seq_lens)), "seq_lens": [list(r) for r in base.seq_lens],
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "device_type": device.type, "dtype": args.dtype, "threads": args.threads, "torch": torch.__version__,
            "timed_calls": args.rounds * args.repeats}
    models, results = {}, {}
    entries = [c for c in contenders(device.type, args.dtype)
               if not args.only or any(word in c["name"] for word in args.only)]
    for round_ in range(args.rounds):
        order = entries[round_ % len(entries):] + entries[:round_ % len(entries)]
        for c in order:
            attn = c["attn"]
            if attn not in models:
                models[attn] = build_model(attn, device, dtype)
            model = models[attn]
            start = time.perf_counter()
            batch = base.to(device).for_attention(attn, dtype)
            sync()
            prep = time.perf_counter() - start
            module = model.model.layers[0].self_attn
            gen = torch.Generator(device=device).manual_seed(1)
            heads, kv, hd = model.config.num_attention_heads, model.config.num_key_value_heads, module.head_dim
            qkv = [torch.randn(args.rows, h, batch.width, hd, device=device, dtype=dtype, generator=gen,
                               requires_grad=True) for h in (heads, kv, kv)]
            for level in ("model", "op"):
                if level == "op" and c.get("model_only"):
                    continue
                for backward in (False, True):
                    key = f"{c['name']}|{level}|{'fwd+bwd' if backward else 'fwd'}"
                    entry = results.setdefault(key, {"name": c["name"], "level": level, "backward": backward,
                                                     "times_s": [], "cpu_times_s": [], "first_call_s": [], "prep_s": [],
                                                     "load": []})
                    if entry.get("error"):
                        continue
                    lift = backward and device.type == "cpu" and attn == "flex_segments"
                    step = (model_step(model, batch, backward) if level == "model"
                            else op_step(attn, module, batch, qkv, backward))
                    load_before = os.getloadavg()[0]
                    try:
                        with flex_setting(c["compiled"], lift):
                            run = timed(step, args.warmup, args.repeats, sync)
                    except Exception as error:  # noqa: BLE001 - record why a contender cannot run here
                        entry["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
                        entry["traceback"] = traceback.format_exc()[-3000:]
                        print(f"{key}: {entry['error']}", flush=True)
                        continue
                    entry["lifted_cpu_refusal"] = lift
                    entry["times_s"] += run["times_s"]
                    entry["cpu_times_s"] += run["cpu_times_s"]
                    entry["first_call_s"].append(run["first_call_s"])
                    entry["prep_s"].append(prep)
                    entry["load"].append([load_before, os.getloadavg()[0]])
                    print(f"round {round_} {key}: median {statistics.median(run['times_s']) * 1e3:.1f} ms, "
                          f"first {run['first_call_s']:.2f} s, load {load_before:.2f}", flush=True)
    return {"info": info, "results": list(results.values())}


def table(data: dict) -> str:
    """One line per implementation, level and pass. On the CPU the ratio is of the median process CPU time per call
    (one thread: the work done, steadier than wall time on a shared machine); on a GPU of the median wall time."""
    info = data["info"]
    on_cpu = info["device_type"] == "cpu"
    basis = "cpu_times_s" if on_cpu else "times_s"
    loads = [x for r in data["results"] for pair in r["load"] for x in pair]
    lines = [f"{info['rows']} rows x {info['width']} tokens, {info['samples']} samples, {info['tokens']} real tokens; "
             f"{info['device']}, {info['dtype']}, {info['threads']} thread(s), torch {info['torch']}; load average "
             f"(1 min) {min(loads, default=0):.2f}-{max(loads, default=0):.2f} during the runs; "
             f"{info['timed_calls']} timed calls per line", "",
             f"| implementation | level | pass | median ms | min ms | median CPU ms | × sdpa_segments "
             f"({'CPU' if on_cpu else 'wall'} time) | first call s | prep ms |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    medians = {(r["name"], r["level"], r["backward"]): statistics.median(r[basis])
               for r in data["results"] if r["times_s"]}
    for r in data["results"]:
        pass_ = "fwd+bwd" if r["backward"] else "fwd"
        if r.get("error"):
            lines.append(f"| {r['name']} | {r['level']} | {pass_} | fails: {r['error'][:160]} | | | | | |")
            continue
        reference = medians.get(("sdpa_segments", r["level"], r["backward"]))
        ratio = reference / medians[(r["name"], r["level"], r["backward"])] if reference else float("nan")
        note = " (CPU refusal lifted)" if r.get("lifted_cpu_refusal") else ""
        lines.append(f"| {r['name']}{note} | {r['level']} | {pass_} | {statistics.median(r['times_s']) * 1e3:,.1f} "
                     f"| {min(r['times_s']) * 1e3:,.1f} | {statistics.median(r['cpu_times_s']) * 1e3:,.1f} "
                     f"| {ratio:.2f} | {max(r['first_call_s']):.2f} | {statistics.median(r['prep_s']) * 1e3:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="fp32 (CPU default) | bf16 (CUDA default) | fp16")
    parser.add_argument("--rows", type=int, default=C.GLOBAL_BATCH_ROWS_PACKED)
    parser.add_argument("--width", type=int, default=C.MAX_SEQ_LEN)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    parser.add_argument("--only", nargs="*", default=None, help="contenders whose name contains a word")
    parser.add_argument("--out", default=None, help="results/<name>.json and .md; default attention[-cuda]")
    args = parser.parse_args()
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    uptime_before = Path("/proc/loadavg").read_text().split()[:3]
    data = measure(args)
    data["info"]["loadavg_before_after"] = [uptime_before, Path("/proc/loadavg").read_text().split()[:3]]
    text = table(data)
    print(text)
    name = args.out or ("attention" if args.device == "cpu" else "attention-cuda")
    results = HERE / "results"
    (results / f"{name}.json").write_text(json.dumps(data, indent=1))
    before, after = data["info"]["loadavg_before_after"]
    (results / f"{name}.md").write_text(f"`python benchmarks/attention.py {' '.join(sys.argv[1:])}`; /proc/loadavg "
                                        f"{' '.join(before)} before, {' '.join(after)} after (2-core machine "
                                        f"shared with other test runs)\n\n{text}\n")


if __name__ == "__main__":
    main()
