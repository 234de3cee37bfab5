"""The planner: what a run costs per rank, before it runs (`python -m llmtrain.plan`, `dry_run=true`).

setting.py reads the config and the model's facts into a Setting, core.py computes a row's figures from it (weights,
gradients, optimizer state, activations, communication, time), figures.py what the live cost compares a run with,
pp.py the pipeline's per-rank figures, rl.py an RL iteration and its inference engine, fit.py whether a run fits
before it loads, report.py lays them out. docs/formulas.md, "The planner", has every formula.
"""


def main(argv: list[str] | None = None) -> int:
    """`llmtrain-plan` (the console script); imported here lazily so that importing a planner module (validation
    reads plan/rl.py) does not load the report and everything it imports."""
    from llmtrain.plan.report import main as report_main

    return report_main(argv)
