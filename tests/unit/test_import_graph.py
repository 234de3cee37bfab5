"""The import graph of llmtrain/: no cycle and no upward import, counting imports inside functions too (moving an
import into a function hides it from Python's import order, not from the design)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llmtrain"

# Floors, lowest first: a module may import its own floor or lower ones, never a higher floor. A module is placed by
# the longest prefix listed. Within a floor, the graph must still be acyclic.
FLOORS = (
    ("llmtrain.config", "llmtrain.paths", "llmtrain.data.errors", "llmtrain.faults", "llmtrain.distributed",
     "llmtrain.run_metadata", "llmtrain.optim.spec", "llmtrain.user_code"),
    ("llmtrain.losses", "llmtrain.data", "llmtrain.metrics", "llmtrain.models", "llmtrain.rewards", "llmtrain.tasks",
     "llmtrain.optim", "llmtrain.doctor", "llmtrain.checkpoint_async"),
    ("llmtrain.backends", "llmtrain.stages", "llmtrain.roles", "llmtrain.trainer", "llmtrain.checkpoint",
     "llmtrain.parallel", "llmtrain.spikes"),
    ("llmtrain.schema", "llmtrain.validation", "llmtrain.plan.rl", "llmtrain.plan.pp", "llmtrain.finished_run",
     "llmtrain.sequence_parallel"),
    ("llmtrain.plan.setting", "llmtrain.plan.core", "llmtrain.plan.figures", "llmtrain.plan", "llmtrain.plan.fit",
     "llmtrain.run", "llmtrain.bases", "llmtrain.compose", "llmtrain.__main__"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The llmtrain modules `path` imports anywhere in its body (a `from pkg import sub` names the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return {name for name in found if name in modules}


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def floor_of(module: str) -> int | None:
    best = None
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (level, len(prefix))
    return None if best is None else best[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_floor():
    assert [m for m in all_modules() if m != "llmtrain" and floor_of(m) is None] == []


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_no_upward_import():
    upward = [f"{source} (floor {floor_of(source)}) imports {target} (floor {floor_of(target)})"
              for source, targets in graph().items() if source != "llmtrain"
              for target in sorted(targets) if floor_of(target) > floor_of(source)]
    assert upward == []


def test_the_checker_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from llmtrain.config import ConfigError\n    import llmtrain.plan\n")
    assert imports_of(module, all_modules()) == {"llmtrain.config", "llmtrain.plan"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The same word in another registry: GRPO's advantage estimator is named like the stage that presets it.
OTHER_REGISTRIES = {("losses/advantages.py", "grpo"), ("losses/kto.py", "kto")}  # kto: TRL's loss_type name


def string_constants(path: Path) -> set[str]:
    """The string literals of a module's code, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


def test_no_module_outside_stages_names_a_stage():
    """Stage names live in stages/ (their specs) and nowhere else in llmtrain/: the rest asks the registry."""
    from llmtrain.stages.registry import stage_names

    named = [(str(path.relative_to(PACKAGE)), name) for path in sorted(PACKAGE.rglob("*.py"))
             if "stages" not in path.relative_to(PACKAGE).parts
             for name in sorted(set(stage_names()) & string_constants(path))]
    assert [pair for pair in named if pair not in OTHER_REGISTRIES] == []
