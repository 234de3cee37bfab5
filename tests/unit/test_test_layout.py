"""The layout of tests/ itself: tests share helpers through conftest.py fixtures and plain helper modules
(tests/helpers.py, tests/e2e/notebooks.py), never by importing another test module or a conftest module; whatever
torchrun or a subprocess runs as a script is a worker under a tests/<folder>/workers/ package. Read with `ast`,
nothing is imported or run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]  # <repo>/tests
WORKERS = "workers"


def is_test_module(name: str) -> bool:
    """pytest's default python_files: test_*.py and *_test.py (here: the module's last dotted component)."""
    return name.startswith("test_") or name.endswith("_test")


def forbidden(module: str) -> bool:
    """A dotted module name that is a test module or a conftest module of the suite."""
    parts = module.split(".")
    if parts[0] != "tests" and len(parts) > 1:
        return False  # another package's module (torch.testing, _pytest.*): not ours
    return any(part == "conftest" or is_test_module(part) for part in parts)


def package_of(path: Path) -> list[str]:
    """The dotted package a file under tests/ is in: tests/dist/test_x.py -> ["tests", "dist"]."""
    return ["tests", *path.relative_to(TESTS).parent.parts]


def imported_modules(tree: ast.AST, path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every module an import statement may load, at any depth (inside functions too):
    `from M import n` names both M and M.n (n may be a submodule); relative imports resolved against `path`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of(path)[:len(package_of(path)) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def main_guards(tree: ast.AST) -> list[int]:
    """Lines of `if __name__ == "__main__":` (either operand order)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.comparators) == 1:
            operands = [node.test.left, node.test.comparators[0]]
            names = [o.id for o in operands if isinstance(o, ast.Name)]
            constants = [o.value for o in operands if isinstance(o, ast.Constant)]
            if names == ["__name__"] and constants == ["__main__"]:
                lines.append(node.lineno)
    return lines


def launched_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every `"-m", "tests.…"` pair in a list or tuple literal (a command line)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            items = node.elts
            for flag, target in zip(items, items[1:]):
                if (isinstance(flag, ast.Constant) and flag.value == "-m" and isinstance(target, ast.Constant)
                        and isinstance(target.value, str) and target.value.split(".")[0] == "tests"):
                    found.append((target.lineno, target.value))
    return found


def in_workers(path: Path) -> bool:
    return WORKERS in path.relative_to(TESTS).parts[:-1]


def module_file(module: str) -> Path | None:
    """The file a dotted tests.… module name is (a module or a package's __init__.py), or None."""
    relative = Path(*module.split(".")[1:])
    for candidate in (TESTS / relative.with_suffix(".py"), TESTS / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def layout_problems(path: Path, source: str) -> list[str]:
    """What in one file under tests/ breaks the layout: imports of a test or conftest module (any file), a
    `__main__` block outside a workers/ package, a `-m tests.…` launch of a module that is not a worker."""
    where = path.relative_to(TESTS.parent)
    tree = ast.parse(source, filename=str(path))
    bad_imports: list[tuple[int, str]] = []
    for line, module in imported_modules(tree, path):  # `from tests.conftest import X`: tests.conftest, not .X too
        if forbidden(module) and not any(line == seen and module.startswith(f"{name}.") for seen, name in bad_imports):
            bad_imports.append((line, module))
    problems = [f"{where}:{line}: imports {module} (a test module or a conftest): move what it shares into a "
                f"conftest.py fixture or a helper module" for line, module in bad_imports]
    if not in_workers(path):
        problems += [f"{where}:{line}: a `__main__` block outside a workers/ package: a script torchrun or a "
                     f"subprocess runs belongs in tests/<folder>/workers/" for line in main_guards(tree)]
    for line, module in launched_modules(tree):
        target = module_file(module)
        if WORKERS not in module.split(".")[:-1] or target is None or not in_workers(target):
            problems.append(f"{where}:{line}: launches `-m {module}`, which is not a module under a workers/ package")
    return problems


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_imports_a_test_module_or_a_conftest_and_scripts_live_in_workers():
    files = python_files()
    assert any(is_test_module(p.stem) for p in files) and any(in_workers(p) for p in files)  # the walk saw them
    problems = [problem for path in files for problem in layout_problems(path, path.read_text())]
    assert not problems, "\n".join(problems)


def test_executables_and_worker_packages():
    """Anything executable (a shebang or the exec bit: fake_slurm's srun, scontrol) is a worker too, and every
    workers/ folder holding Python is a package (`python -m tests.<folder>.workers.NAME`)."""
    executables = [p for p in TESTS.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                   and (p.stat().st_mode & 0o111 or p.read_bytes()[:2] == b"#!")]
    assert [str(p.relative_to(TESTS)) for p in executables if not in_workers(p)] == []
    for folder in {p.parent for p in python_files() if in_workers(p)}:
        top = next(parent for parent in [folder, *folder.parents] if parent.name == WORKERS)
        assert (top / "__init__.py").is_file(), f"{top} has no __init__.py"


BAD = '''
from tests.dist.test_ddp import assert_close_series
import tests.conftest
from tests.dist import test_preference
from . import conftest


def test_x():
    from tests.conftest import REPO
    cmd = ["python", "-m", "torch.distributed.run", "-m", "tests.dist.test_fsdp2", "init"]


if __name__ == "__main__":
    pass
'''
GOOD = '''
from tests.helpers import REPO, run_cli
from tests.dist.workers.fsdp2_checks import TINY
from torch.testing import assert_close
import unittest.mock

cmd = ["python", "-m", "torch.distributed.run", "-m", "tests.dist.workers.fsdp2_checks", "init"]
'''


@pytest.mark.parametrize("source,expected", [
    (BAD, [":2: imports tests.dist.test_ddp ", ":3: imports tests.conftest ",
           ":4: imports tests.dist.test_preference ", ":5: imports tests.dist.conftest ", ":9: imports tests.conftest ",
           ":10: launches `-m tests.dist.test_fsdp2`", ":13: a `__main__` block outside a workers/ package"]),
    (GOOD, []),
], ids=["bad", "good"])
def test_the_check_sees_what_it_should(source, expected):
    """The checker on a made-up tests/dist/test_example.py: every kind of break found, at its line, and nothing in
    what the layout allows."""
    problems = layout_problems(TESTS / "dist" / "test_example.py", source)
    for needle in expected:
        assert sum(needle in p for p in problems) == 1, (needle, problems)
    assert len(problems) == len(expected), problems
    assert all(re.match(r"tests/dist/test_example\.py:\d+: ", p) for p in problems)
