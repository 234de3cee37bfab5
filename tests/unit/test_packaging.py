"""pyproject's dependency floors: the versions the tests run on satisfy every range, and the floors of what the
code relies on are the versions it was tested with. Its console scripts resolve to callables."""

from __future__ import annotations

import importlib
import inspect
import sys
from importlib.metadata import PackageNotFoundError, entry_points, version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helpers import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # requires-python >= 3.10; the dev extra installs tomli there
    import tomli as tomllib

# package -> the lowest version llmtrain was tested with, for what the code relies on (pyproject's comment says what)
RELIED_ON = {"torch": "2.13", "transformers": "5.24", "deepspeed": "0.19.8", "peft": "0.21", "trl": "1.16"}


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {Requirement(r).name.lower(): Requirement(r) for r in listed}


def floor(requirement: Requirement) -> Version | None:
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    return max(floors) if floors else None


@pytest.mark.parametrize("name", sorted(RELIED_ON))
def test_floors_of_what_the_code_relies_on_are_the_tested_versions(name):
    requirement = requirements()[name]
    assert floor(requirement) is not None and floor(requirement) >= Version(RELIED_ON[name]), str(requirement)


def test_trl_is_a_dev_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(Requirement(r).name == "trl" for r in project["optional-dependencies"]["dev"])


def test_installed_versions_satisfy_every_range():
    for name, requirement in requirements().items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue  # an extra this environment did not install
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue  # not meant for this interpreter (tomli below 3.11)
        assert requirement.specifier.contains(Version(installed).base_version, prereleases=True), \
            f"{requirement} but {installed} is installed"


# console command -> "module:function" (README: "Command line", "Plan before you run")
SCRIPTS = {"llmtrain": "llmtrain.__main__:main", "llmtrain-plan": "llmtrain.plan:main"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_is_declared_and_resolves_to_a_callable(name):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts.get(name) == SCRIPTS[name], scripts
    module, _, attribute = scripts[name].partition(":")
    main = getattr(importlib.import_module(module), attribute)
    assert callable(main)
    # the generated script calls main() with no arguments and passes its return value to sys.exit
    unbound = [p for p in inspect.signature(main).parameters.values()
               if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not unbound, f"{scripts[name]} needs {unbound}: a console script passes no arguments"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_installed_console_script_matches_pyproject(name):
    installed = [e for e in entry_points(group="console_scripts", name=name) if e.dist and e.dist.name == "llmtrain"]
    if not installed:
        try:
            version("llmtrain")
        except PackageNotFoundError:
            pytest.skip("llmtrain is not installed (tests run from a bare checkout)")
        pytest.fail(f"the installed llmtrain has no {name!r} command: reinstall (pip install -e .)")
    assert installed[0].value == SCRIPTS[name]


def test_every_package_of_the_source_tree_ships():
    """pyproject lists its packages by hand: a new subpackage left out installs without its modules (a wheel that
    fails on import, where the repo's editable install works)."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    source = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "llmtrain").rglob("__init__.py")}
    assert sorted(source - listed) == []
