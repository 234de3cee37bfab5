"""Where llmtrain's shipped files are: conf/, recipes/ and assets/ (the ground floor: no llmtrain import)."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS_DIR = PACKAGE_DIR / "assets"


def _shipped_dir(name: str) -> Path:
    """conf/ or recipes/: beside the package in a checkout, inside it (as _conf/_recipes) when installed."""
    for candidate in (PACKAGE_DIR.parent / name, PACKAGE_DIR / f"_{name}"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"llmtrain cannot find its {name}/ directory next to {PACKAGE_DIR}")


def conf_dir() -> Path:
    return _shipped_dir("conf")


def recipes_dir() -> Path:
    return _shipped_dir("recipes")


def available_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


# The documentation: the pages under docs/ (mkdocs.yml builds them into a site). Set DOCS_URL to the site's address
# once it is published, and every message that names a page names it there.
DOCS_URL: str | None = None


def docs_page(page: str) -> str:
    """A documentation page as a message names it; `page` is its path under docs/ ("reference/config.md").
    tests/unit/test_docs.py checks that every page llmtrain names exists."""
    if DOCS_URL:
        return f"{DOCS_URL.rstrip('/')}/{page.removesuffix('.md').removesuffix('index').rstrip('/')}/"
    return f"docs/{page}"
