"""pyproject's dependency floors: the versions the tests run on satisfy every range, and the floors of what the
code relies on are the versions it was tested with."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO

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
        assert requirement.specifier.contains(Version(installed).base_version, prereleases=True), \
            f"{requirement} but {installed} is installed"
