"""Checks of the live cost a 2-rank run logs on its first steps (llmtrain/metrics/live.py, comm.py) against the
planner's figures in the same records. Used by the backend tests on runs they make anyway."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import read_metrics


def model_states(record: dict, rank: int) -> float:
    """The ledger's per-rank model states after the first step: DeepSpeed's has a total, the others name the parts."""
    total = record.get(f"memory_r{rank}_total_bytes")
    return total if total is not None else sum(record[f"memory_r{rank}_{k}"] for k in ("params", "grads", "optimizer"))


def live_errors(run_dir: Path, ranks: int = 2) -> dict[str, float]:
    """Relative error (measured / planned - 1) of the model states (step 1), step 2's activations and counted
    communication, worst rank. Step 2: the first step may run one-time collectives (DeepSpeed's first ZeRO-3 trace)."""
    first, second = read_metrics(run_dir)[0][:2]
    assert second["step"] == 2
    errors = {"states": max((model_states(first, r) / first["plan_memory_state"] - 1 for r in range(ranks)), key=abs)}
    for key in ("activations", "payload", "wire"):  # activations: each rank's plan is at its own batch shape
        pairs = [(second[f"memory_r{r}_activations"], second[f"memory_r{r}_plan_activations"]) if key == "activations"
                 else (second[f"comm_r{r}_{key}"], second[f"plan_comm_{key}"]) for r in range(ranks)]
        assert all(m > 0 and p > 0 for m, p in pairs), (key, pairs)
        errors[key] = max((m / p - 1 for m, p in pairs), key=abs)
    for key in second:  # every kind the plan has was counted, within 5 % per kind on every rank
        if key.startswith("plan_comm_") and key.count("_") > 3:
            kind_key = key[len("plan_comm_"):]
            for rank in range(ranks):
                measured = second[f"comm_r{rank}_{kind_key}"]
                assert abs(measured - second[key]) <= 0.05 * second[key], f"rank {rank} {kind_key}: {measured} vs {second[key]}"
    third = read_metrics(run_dir)[0][2]
    assert not any(k.startswith(("comm_", "plan_comm", "plan_memory")) for k in third)  # counting is off after 2
    return errors


def assert_live_cost_matches_the_plan(run_dir: Path, ranks: int = 2, states: bool = True) -> dict[str, float]:
    """`states=False` where the ledger (read after the optimizer step) and the plan (the peak between micro-batches)
    hold different things: FSDP2 with accumulation keeps whole gradients between micro-batches, sharded after."""
    errors = live_errors(run_dir, ranks)
    assert not states or abs(errors["states"]) <= 0.05, errors
    assert abs(errors["activations"]) <= 0.25, errors
    assert abs(errors["payload"]) <= 0.05 and abs(errors["wire"]) <= 0.05, errors
    print(f"{run_dir.name}: " + ", ".join(f"{k} {v:+.2%}" for k, v in errors.items()))
    return errors
