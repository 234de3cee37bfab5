"""Summaries (median and spread over rounds), the targets of issue 5, the formulas, and markdown tables."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

import common as C

TARGETS = {"unpacked_vs_plain": 0.97, "packed_vs_trl_default": 1.3, "packed_vs_best_trl_packing": 1.0}
TRL_PACKING = ("TRL padding_free", "TRL packing bfd", "TRL packing wrapped")


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def per_contender(runs: list[dict], done_key: str, summarise_one) -> dict:
    """{contender: summarise_one(its rounds whose result has `done_key`) + failed_runs}, or the first round's error
    for a contender with no such round."""
    by_name = defaultdict(list)
    for run in runs:
        by_name[run["contender"]].append(run)
    summary = {}
    for name, rs in by_name.items():
        ok = [r for r in rs if done_key in r["result"]]
        summary[name] = ({**summarise_one(ok), "failed_runs": len(rs) - len(ok)} if ok
                         else {"error": rs[0].get("error", "failed")})
    return summary


def summarise_runs(runs: list[dict]) -> dict:
    """Per contender: medians and spread over rounds; losses, target tokens per step and the packing check
    from its round-0 run."""
    def one(ok: list[dict]) -> dict:
        first = next((r["result"] for r in ok if r["round"] == 0), ok[0]["result"])
        return {
            "tokens_per_s": spread([r["result"]["tokens_per_s"] for r in ok]),
            "tokens_per_cpu_s": spread([r["result"]["tokens_per_cpu_s"] for r in ok]),
            "peak_rss_mb": spread([r["peak_rss_mb"] for r in ok]),
            "target_tokens_per_step": first["target_tokens_per_step"],
            "first_loss": first.get("first_loss"), "last_loss": first.get("last_loss"),
            "isolation": first.get("isolation"),
            "self_reported_tokens_per_s": first.get("self_reported_tokens_per_s_median"),
            "llmtrain_file": first.get("llmtrain_file"),
            "others_load_cores": statistics.mean(r["foreign_load_cores"] for r in ok)}

    return per_contender(runs, "tokens_per_s", one)


def summarise_cpu(runs: list[dict]) -> dict:
    summary = summarise_runs(runs)
    summary["_targets"] = targets(summary)
    return summary


def baseline_name(rev: str, layout: str) -> str:
    """--suite compare: the contender running llmtrain at `rev`; its counterpart is `llmtrain <layout>`."""
    return f"llmtrain@{rev} {layout}"


def summarise_compare(runs: list[dict]) -> dict:
    """llmtrain now against llmtrain at the baseline, same layout: gains by the median and by the best round
    (others' load only ever slows a run down) of wall-clock tok/s, and by the median of tok/CPU-s."""
    summary = summarise_runs(runs)
    for name, entry in summary.items():
        if not name.startswith("llmtrain@"):
            continue
        current = summary.get("llmtrain " + name.split(" ", 1)[1], {})
        for key, stat in (("tokens_per_s", "median"), ("tokens_per_s", "max"), ("tokens_per_cpu_s", "median")):
            if key in entry and key in current:
                label = f"gain_{key}" + ("_best_round" if stat == "max" else "")
                entry[label] = 1.0
                current[label] = current[key][stat] / entry[key][stat]
        if "tokens_per_s" in current:
            current["baseline"] = name
    return summary


def _median(summary: dict, name: str, key: str) -> float | None:
    entry = summary.get(name) or {}
    return entry[key]["median"] if key in entry else None


def targets(summary: dict) -> dict:
    """Each target on three estimators: median wall-clock tok/s, best round's wall-clock tok/s (the load of
    others only ever slows a run down, so the best round is the least disturbed one), median tok/CPU-s."""
    out = {}
    for key, stat in (("tokens_per_s", "median"), ("tokens_per_s", "max"), ("tokens_per_cpu_s", "median")):
        m = lambda name: (summary.get(name) or {}).get(key, {}).get(stat)  # noqa: E731
        correct = {n: m(n) for n in TRL_PACKING if m(n) and (summary[n].get("isolation") or {}).get("isolated")}
        best = max(correct, key=correct.get) if correct else None
        checks = {}
        if m("llmtrain unpacked") and m("plain loop"):
            checks["unpacked_vs_plain"] = m("llmtrain unpacked") / m("plain loop")
        if m("llmtrain packed") and m("TRL default"):
            checks["packed_vs_trl_default"] = m("llmtrain packed") / m("TRL default")
        if m("llmtrain packed") and best:
            checks["packed_vs_best_trl_packing"] = m("llmtrain packed") / correct[best]
        label = f"{key} ({'best round' if stat == 'max' else stat})"
        out[label] = {k: {"ratio": v, "target": TARGETS[k], "met": v >= TARGETS[k]} for k, v in checks.items()}
        out[label]["best_trl_packing_option (samples isolated)"] = best
    return out


# ---- backends: formulas (fp32 Adam: weights 4M, grads 4M, moments 8M; M parameters, N ranks) ----------------

def tp_sharded_params() -> int:
    """Parameters tensor parallelism splits: q/k/v/o, gate/up/down of every block, and the untied LM head, split over
    the vocabulary under the fused loss (the default; llmtrain/models/vocab_parallel.py)."""
    h, i, L = C.MODEL["hidden_size"], C.MODEL["intermediate_size"], C.MODEL["num_hidden_layers"]
    kv = C.MODEL["num_key_value_heads"] * h // C.MODEL["num_attention_heads"]
    head = 0 if C.MODEL.get("tie_word_embeddings", True) else len(C.tokenizer()) * h
    return L * (2 * h * h + 2 * h * kv + 3 * h * i) + head


def base_backend(name: str) -> str:
    return name.split(" ")[0]


def formula_state_bytes(backend: str, m: int, n: int) -> tuple[float, str]:
    backend = base_backend(backend)
    table = {"ddp": (16 * m, "16M"), "zero1": (8 * m + 8 * m / n, "4M + 4M + 8M/N"),
             "zero2": (4 * m + 12 * m / n, "4M + 12M/N"), "zero3": (16 * m / n, "16M/N"),
             "zero3_offload": (16 * m / n, "16M/N, all of it in host memory"), "fsdp2": (16 * m / n, "16M/N")}
    if backend == "fsdp2_tp":
        s = tp_sharded_params()
        return 16 * (s / n + (m - s)), "16·(M_tp/t + M_rest), t=N (dp=1)"
    return table[backend]


def formula_comm_bytes(backend: str, m: int, tokens_per_rank: float) -> tuple[float, str]:
    # tokens_per_rank: tokens the rank runs through the model in the counted step, padding included
    backend = base_backend(backend)
    """Payload bytes per step per rank (the full tensor of each collective), fp32."""
    table = {"ddp": (4 * m, "all-reduce grads 4M"),
             "zero1": (8 * m, "reduce grads 4M + all-gather params 4M"),
             "zero2": (8 * m, "reduce-scatter grads 4M + all-gather params 4M"),
             "zero3": (12 * m, "all-gather fwd 4M + bwd 4M + reduce-scatter 4M"),
             "zero3_offload": (12 * m, "all-gather fwd 4M + bwd 4M + reduce-scatter 4M"),
             "fsdp2": (12 * m, "all-gather fwd 4M + bwd 4M + reduce-scatter 4M (root kept unsharded: less)")}
    if backend == "fsdp2_tp":
        h, L = C.MODEL["hidden_size"], C.MODEL["num_hidden_layers"]
        return 4 * L * tokens_per_rank * h * 4, ("TP (Megatron): 4 all-reduces of the (b·s·h) fp32 activations "
                                                 "per block, 2 fwd + 2 bwd (dp=1)")
    return table[backend]


def summarise_backends(runs: list[dict], m: int, n: int, counted_step_tokens: int) -> dict:
    """counted_step_tokens: tokens (padding included) of the whole global batch in the counted step."""
    summary = {}
    for run in runs:
        name, res = run["contender"], run["result"]
        if "tokens_per_s" not in res:
            summary.setdefault(name, {"skipped": run.get("error", "failed")})
            continue
        ranks = [res] + run["other_ranks"]
        entry = summary.setdefault(name, {"tokens_per_s": [], "tokens_per_cpu_s": [], "ranks": []})
        entry.pop("skipped", None)
        entry["tokens_per_s"].append(res["tokens_per_s"])
        entry["tokens_per_cpu_s"].append(res["tokens_per_cpu_s"])
        logged = res.get("logged_memory", {})
        entry["ranks"] = [{
            "peak_rss_mb": r.get("peak_rss_self_mb"),
            "logged_model_state_bytes": {k.split("_", 2)[2]: v for k, v in logged.items()
                                         if k.startswith(f"memory_r{r.get('rank', i)}_")} or None,
            "live_tensor_bytes_before_update": sum((r.get("live_tensor_bytes_before_update") or {}).values()),
            "comm_calls": r.get("comm_calls"), "comm_bytes": r.get("comm_bytes"),
            "comm_bytes_total": sum((r.get("comm_bytes") or {}).values()),
        } for i, r in enumerate(ranks)]
        tokens_per_rank = counted_step_tokens / max(1, n // (2 if base_backend(name) == "fsdp2_tp" else 1))
        entry["formula_state_bytes"], entry["formula_state"] = formula_state_bytes(name, m, n)
        entry["formula_comm_bytes"], entry["formula_comm"] = formula_comm_bytes(name, m, tokens_per_rank)
    for entry in summary.values():
        if "tokens_per_s" in entry:
            entry["tokens_per_s"] = spread(entry["tokens_per_s"])
            entry["tokens_per_cpu_s"] = spread(entry["tokens_per_cpu_s"])
    return summary


# ---- tables ------------------------------------------------------------------------------------------

def _mb(x) -> str:
    return "–" if x is None else f"{x / 2**20:.2f}"


def table(result: dict) -> str:
    return {"cpu-small": cpu_table, "compare": compare_table, "backends": backends_table,
            "gpu": gpu_table, "preference": preference_table, "ppo": _ppo_table,
            "lora": _lora_table}[result["suite"]](result)


def _ppo_table(result: dict) -> str:
    import ppo  # benchmarks/ is on sys.path wherever report is imported
    return ppo.table(result)


def _lora_table(result: dict) -> str:
    import lora
    return lora.table(result)


def _header(*columns: str) -> list[str]:
    """A markdown table's first two lines; a column named with a trailing ':' is right-aligned."""
    names = [c.rstrip(":") for c in columns]
    return ["| " + " | ".join(names) + " |",
            "|" + "|".join("---:" if c.endswith(":") else "---" for c in columns) + "|"]


def _failed_row(name: str, why: str, columns: int) -> str:
    return f"| {name} | {why} |" + " |" * (columns - 2)


def _isolation_text(iso: dict | None) -> str:
    if not iso:
        return "n/a (unpacked)"
    return (f"{'yes' if iso['isolated'] else '**NO**'} ({iso['packed_loss'] - iso['unpacked_loss']:+.1e}; "
            f"{iso['max_abs_logit_diff']:.1e})")


COMPARE_COLUMNS = ("contender", "llmtrain imported from", "target tok/s (median):", "min–max:", "gain (median):",
                   "gain (best round):", "target tok/CPU-s (median):", "gain:", "peak RSS MB:", "target tok/step:",
                   "first / last loss", "samples isolated? (packed − unpacked loss; max Δlogit)")


def compare_table(result: dict) -> str:
    base = result["baseline"]
    lines = [f"Baseline: llmtrain at `{base['rev']}` ({base['commit'][:12]}); current: the working tree at "
             f"{result['machine']['commit'][:12]} (uncommitted llmtrain/ changes: "
             f"{result['machine']['uncommitted_llmtrain_changes'] or 'none'}). Gains: current over baseline, "
             "same layout.", "",
             *_header(*COMPARE_COLUMNS)]
    for name, e in result["summary"].items():
        if "error" in e:
            lines.append(_failed_row(name, f"failed: {e['error'][:80]}", len(COMPARE_COLUMNS)))
            continue
        t, c = e["tokens_per_s"], e["tokens_per_cpu_s"]
        gain = lambda key: f"{e[key]:.2f}×" if key in e else "–"  # noqa: E731
        source = str(Path(e["llmtrain_file"]).parent.parent) if e.get("llmtrain_file") else "?"
        lines.append(f"| {name} | {source} | {t['median']:,.0f} | {t['min']:,.0f}–{t['max']:,.0f} "
                     f"| {gain('gain_tokens_per_s')} | {gain('gain_tokens_per_s_best_round')} | {c['median']:,.0f} "
                     f"| {gain('gain_tokens_per_cpu_s')} | {e['peak_rss_mb']['median']:,.0f} "
                     f"| {e['target_tokens_per_step']:,.0f} | {e['first_loss']:.6f} / {e['last_loss']:.6f} "
                     f"| {_isolation_text(e.get('isolation'))} |")
    lines += ["", "- every run imported llmtrain from the directory its contender names (checked): " +
              "; ".join(f"{name}: {where}" for name, where in base["imports"].items())]
    return "\n".join(lines)


def gpu_table(result: dict) -> str:
    g = result["gpu"]
    peak = f"{g['peak_bf16_flops'] / 1e12:.0f} TFLOP/s" if g["peak_bf16_flops"] else "unknown (pass --peak-tflops)"
    lines = [f"{g['name']}: {g['parameters']:,} parameters, bf16 peak {peak}; MFU = {g['mfu_convention']}",
             "", "| contender | target tok/s | min–max | model TFLOP/s | MFU | peak RSS MB |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, e in result["summary"].items():
        if name.startswith("_") or "tokens_per_s" not in e:
            continue
        t = e["tokens_per_s"]
        mfu = f"{100 * e['mfu']:.1f} %" if e.get("mfu") else "–"
        lines.append(f"| {name} | {t['median']:,.0f} | {t['min']:,.0f}–{t['max']:,.0f} "
                     f"| {e['model_tflops']:.1f} | {mfu} "
                     f"| {e['peak_rss_mb']['median']:,.0f} |")
    return "\n".join(lines)


CPU_COLUMNS = ("contender", "target tok/s (median):", "min–max:", "× plain:", "target tok/CPU-s:", "× plain:",
               "peak RSS MB:", "target tok/step:", "samples isolated? (packed − unpacked loss; max Δlogit)")


def cpu_table(result: dict) -> str:
    s = result["summary"]
    base = _median(s, "plain loop", "tokens_per_s")
    base_cpu = _median(s, "plain loop", "tokens_per_cpu_s")
    lines = _header(*CPU_COLUMNS)
    for name, e in s.items():
        if name.startswith("_"):
            continue
        if "error" in e:
            lines.append(_failed_row(name, f"failed: {e['error'][:80]}", len(CPU_COLUMNS)))
            continue
        t, c = e["tokens_per_s"], e["tokens_per_cpu_s"]
        lines.append(f"| {name} | {t['median']:,.0f} | {t['min']:,.0f}–{t['max']:,.0f} | "
                     f"{t['median'] / base:.2f} | {c['median']:,.0f} | {c['median'] / base_cpu:.2f} | "
                     f"{e['peak_rss_mb']['median']:,.0f} | {e['target_tokens_per_step']:,.0f} | "
                     f"{_isolation_text(e.get('isolation'))} |"
                     if base and base_cpu else f"| {name} | {t['median']:,.0f} |" + " |" * (len(CPU_COLUMNS) - 2))
    lines.append("")
    for key, checks in s["_targets"].items():
        for name, v in checks.items():
            if isinstance(v, dict):
                lines.append(f"- target {name} ({key}): {v['ratio']:.2f}× vs ≥ {v['target']}× → "
                             f"{'met' if v['met'] else 'NOT met'}")
        lines.append(f"- best TRL packing option with isolated samples ({key}): "
                     f"{checks.get('best_trl_packing_option (samples isolated)')}")
    return "\n".join(lines)


STATE_ROLES = ("params", "master", "grads", "optim", "optimizer")


def _logged_text(logged: dict | None) -> str:
    """The roles a backend logs (DeepSpeed: params/master/grads/optim; FSDP2: params/grads/optimizer)."""
    if not logged:
        return "not logged"
    roles = {k.removesuffix("_bytes"): v for k, v in logged.items()
             if k.removesuffix("_bytes") in STATE_ROLES and isinstance(v, (int, float))}
    parts = [f"{k} {_mb(v)}" for k, v in roles.items() if v]
    return f"{_mb(sum(roles.values()))} ({', '.join(parts)})"


BACKEND_COLUMNS = ("backend", "target tok/s:", "tok/CPU-s (rank 0):", "peak RSS MB r0 / r1:",
                   "model-state bytes per rank, logged by llmtrain (MiB)", "live tensors before update r0 / r1 (MiB):",
                   "formula (MiB)", "collectives counted per step per rank (MiB payload)", "formula (MiB)")


def backends_table(result: dict) -> str:
    lines = _header(*BACKEND_COLUMNS)
    for name, e in result["summary"].items():
        if "skipped" in e:
            lines.append(_failed_row(name, f"skipped: {e['skipped'][:120]}", len(BACKEND_COLUMNS)))
            continue
        ranks = e["ranks"]
        rss = " / ".join(f"{r['peak_rss_mb']:,.0f}" for r in ranks)
        logged_text = " / ".join(_logged_text(r["logged_model_state_bytes"]) for r in ranks)
        live = " / ".join(_mb(r["live_tensor_bytes_before_update"]) for r in ranks)
        comm = "; ".join(f"r{i}: " + ", ".join(f"{k} {r['comm_calls'][k]}× {_mb(v)}" for k, v in
                                               sorted((r["comm_bytes"] or {}).items())) for i, r in enumerate(ranks))
        lines.append(f"| {name} | {e['tokens_per_s']['median']:,.0f} | {e['tokens_per_cpu_s']['median']:,.0f} | {rss} "
                     f"| {logged_text} | {live} | {_mb(e['formula_state_bytes'])} = {e['formula_state']} "
                     f"| {comm} | {_mb(e['formula_comm_bytes'])} = {e['formula_comm']} |")
    return "\n".join(lines)


# ---- preference: reward model and DPO against TRL, in pairs per second ---------------------------------------

PAIR_TARGETS = {"reward model": ("llmtrain reward", "TRL RewardTrainer", 1.3),
                "DPO": ("llmtrain dpo", "TRL DPOTrainer", 1.0)}


def summarise_preference(runs: list[dict]) -> dict:
    """Per contender: medians and spread over rounds of pairs/s, pairs/CPU-s, peak RSS; losses from round 0;
    then llmtrain / TRL on three estimators (median, best round, median per CPU-second) against the goals."""
    def one(ok: list[dict]) -> dict:
        first = next((r["result"] for r in ok if r["round"] == 0), ok[0]["result"])
        return {
            "pairs_per_s": spread([r["result"]["pairs_per_s"] for r in ok]),
            "pairs_per_cpu_s": spread([r["result"]["pairs_per_cpu_s"] for r in ok]),
            "peak_rss_mb": spread([r["peak_rss_mb"] for r in ok]),
            "median_step_s": spread([r["result"]["median_step_s"] for r in ok]),
            "pairs_per_step": first["pairs_per_step"], "first_loss": first.get("first_loss"),
            "last_loss": first.get("last_loss"), "losses": first.get("losses"), "pooling": first.get("pooling"),
            "others_load_cores": spread([r["foreign_load_cores"] for r in ok])}

    summary = per_contender(runs, "pairs_per_s", one)
    goals = {}
    for label, (ours, theirs, goal) in PAIR_TARGETS.items():
        a, b = summary.get(ours, {}), summary.get(theirs, {})
        if "pairs_per_s" not in a or "pairs_per_s" not in b:
            continue
        ratios = {"median": a["pairs_per_s"]["median"] / b["pairs_per_s"]["median"],
                  "best round": a["pairs_per_s"]["max"] / b["pairs_per_s"]["max"],
                  "per CPU-s (median)": a["pairs_per_cpu_s"]["median"] / b["pairs_per_cpu_s"]["median"]}
        loss_gap = (abs(a["first_loss"] - b["first_loss"]) if a.get("first_loss") is not None
                    and b.get("first_loss") is not None else None)
        goals[label] = {"llmtrain": ours, "trl": theirs, "goal": goal, "ratios": ratios,
                        "met": ratios["median"] >= goal, "first_loss_abs_diff": loss_gap}
    summary["_goals"] = goals
    return summary


PREFERENCE_COLUMNS = ("contender", "pairs/s (median):", "min–max:", "× TRL:", "pairs/CPU-s:", "× TRL:",
                      "median step s:", "peak RSS MB:", "first-step loss:", "last loss:", "others' load, cores:")


def _trl_of(name: str) -> str | None:
    return next((theirs for ours, theirs, _ in PAIR_TARGETS.values() if name == ours), None)


def preference_table(result: dict) -> str:
    s, p = result["summary"], result["preference"]
    d = p["pairs"]
    lines = [f"{p['pairs_per_step']} pairs per step ({2 * p['pairs_per_step']} rows in one forward), "
             f"{d['pairs']} pairs; sequence length mean {d['mean_tokens']:.0f}, p50 {d['p50']}, p90 {d['p90']}, "
             f"max {d['max']} tokens; per step {d['real_tokens_per_step_mean']:,.0f} real tokens in "
             f"{d['padded_tokens_per_step_mean']:,.0f} padded (mean over the {d['steps_counted']} steps run). "
             f"DPO β = {p['dpo_beta']}, sigmoid; the reference computed in the step.", "",
             *_header(*PREFERENCE_COLUMNS)]
    for name, e in s.items():
        if name.startswith("_"):
            continue
        if "error" in e:
            lines.append(_failed_row(name, f"failed: {e['error'][:80]}", len(PREFERENCE_COLUMNS)))
            continue
        t, c, trl = e["pairs_per_s"], e["pairs_per_cpu_s"], s.get(_trl_of(name) or "", {})
        vs = lambda key: f"**{e[key]['median'] / trl[key]['median']:.2f}×**" if key in trl else "–"  # noqa: E731
        lines.append(f"| {name} | {t['median']:.2f} | {t['min']:.2f}–{t['max']:.2f} | {vs('pairs_per_s')} "
                     f"| {c['median']:.2f} | {vs('pairs_per_cpu_s')} | {e['median_step_s']['median']:.3f} "
                     f"| {e['peak_rss_mb']['median']:,.0f} | {e['first_loss']:.6f} | {e['last_loss']:.6f} "
                     f"| {e['others_load_cores']['median']:.2f} |")
    lines.append("")
    for label, g in s["_goals"].items():
        r = g["ratios"]
        gap = ("" if g["first_loss_abs_diff"] is None
               else f"; first-step losses differ by {g['first_loss_abs_diff']:.1e}")
        lines.append(f"- {label}: {g['llmtrain']} / {g['trl']} = {r['median']:.2f}× by the median (best round "
                     f"{r['best round']:.2f}×, per CPU-second {r['per CPU-s (median)']:.2f}×) vs goal ≥ {g['goal']}× → "
                     f"{'met' if g['met'] else '**NOT met**'}{gap}")
    for name, e in s.items():
        pool = e.get("pooling") if isinstance(e, dict) else None
        if pool:
            lines.append(f"- {name}: pad id {pool['pad_token_id']}; transformers pools {pool['at_eos']} of "
                         f"{pool['rows']} rows of its first batch at the EOS, {pool['before_eos']} at the token before "
                         "(llmtrain: every row at the EOS)")
    return "\n".join(lines)
