"""docs/formulas.md is in the repository, every reference points to it, and the code it names exists and
computes what it says."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

DOC = REPO / "docs/formulas.md"


def tracked_text_files():
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / n for n in names if n.endswith((".md", ".py", ".yaml", ".toml", ".ipynb", ".sh", ".sbatch"))]


def test_every_reference_to_formulas_md_is_the_repository_copy():
    assert DOC.is_file()
    for path in tracked_text_files():
        for line in path.read_text(errors="replace").splitlines():
            for mention in re.findall(r"[\w./-]*formulas\.md", line):
                target = (path.parent / mention).resolve() if mention.startswith(".") else REPO / mention
                assert target == DOC, f"{path.relative_to(REPO)}: {mention} (use docs/formulas.md)"


def named_functions() -> list[tuple[str, str]]:
    text = DOC.read_text()
    dotted = re.findall(r"`(llmtrain(?:\.\w+)+)`", text)
    pairs = [(d.rsplit(".", 1)[0], d.rsplit(".", 1)[1]) for d in dotted]
    pairs += re.findall(r"`(benchmarks/\w+)\.py: (\w+)`", text)
    return sorted(set(pairs))


@pytest.mark.parametrize("module,name", named_functions())
def test_the_code_it_names_exists(module, name, monkeypatch):
    if module.startswith("benchmarks/"):
        monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
        module = module.split("/", 1)[1]
    try:
        target = importlib.import_module(module)
    except ModuleNotFoundError:  # `llmtrain.x.Class.method` or a module-level attribute path
        parent, attr = module.rsplit(".", 1)
        target = getattr(importlib.import_module(parent), attr)
    assert hasattr(target, name) or importlib.util.find_spec(f"{module}.{name}") is not None, f"{module}.{name}"


def test_its_examples_are_what_the_code_computes():
    from llmtrain.backends.deepspeed_config import DeepSpeedSettings, model_sized
    from llmtrain.metrics.flops import training_flops_per_token
    from llmtrain.metrics.memory import formula_16m, planned_model_state_bytes

    m7b = 6_738_415_616
    assert round(training_flops_per_token(m7b, 32, 4096, 2048) / 1e9, 1) == 43.7
    assert round(planned_model_state_bytes(num_params=m7b, stage=3, dp=8, mixed_precision=True) / 2**30, 1) == 12.6
    m, n = 1000, 4
    assert [formula_16m(num_params=m, stage=s, dp=n) for s in range(4)] == [16 * m, 8 * m + 8 * m / n,
                                                                          4 * m + 12 * m / n, 16 * m / n]
    assert [planned_model_state_bytes(num_params=m, stage=s, dp=n, mixed_precision=True) for s in range(4)] == \
        [16 * m, 4 * m + 12 * m / n, 2 * m + 14 * m / n, 16 * m / n]
    auto = model_sized(DeepSpeedSettings(zero_stage=3, micro_batch_size=1, grad_accum_steps=1), 100)
    assert auto == {"reduce_bucket_size": 100 ** 2, "stage3_prefetch_bucket_size": 9000,
                    "stage3_param_persistence_threshold": 1000}
    assert sys.modules["llmtrain.metrics.flops"].__doc__.count("docs/formulas.md") == 1
    from llmtrain.backends import BACKENDS
    from llmtrain.metrics.cost import Layout, RoleParams, state_bytes  # "The planner": 7B ZeRO-3 bf16 on 8 ranks

    z3 = state_bytes(RoleParams(trainable=m7b, persistent=65 * 4096), Layout("zero3", BACKENDS["deepspeed"], 3, 8),
                     "bf16")
    assert round((z3.held - z3.gathered) / 2**30, 1) == 14.1
