"""The documentation (README.md, docs/, mkdocs.yml) in the normal test environment: the configuration reference is
what the code generates and describes every field; every `python -m llmtrain ...` / `torchrun ... -m llmtrain ...`
/ `llmtrain-plan ...` command written in the README and the docs composes and validates (as `dry_run=true` would:
no weights, no data); every relative link between the pages lands on a file and a heading that exist; every
benchmark result is on the benchmarks page. With the `docs` extra installed, the site also builds in strict mode."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from functools import cache
from pathlib import Path

import pytest

from tests.helpers import REPO

DOCS = REPO / "docs"
SNIPPET = re.compile(r'^--8<-- "([^"]+)"\s*$', re.M)


@cache
def config_reference():
    """tools/config_reference.py, imported from its path (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def expanded(path: Path) -> str:
    """The page as the site shows it: `--8<-- "file"` and `--8<-- "file:section"` lines replaced by what they
    include (pymdownx.snippets, paths from the repository root)."""
    def include(match: re.Match) -> str:
        name, _, section = match.group(1).partition(":")
        text = (REPO / name).read_text()
        if section:
            start, end = f"<!-- --8<-- [start:{section}] -->", f"<!-- --8<-- [end:{section}] -->"
            assert start in text and end in text, f"{path.relative_to(REPO)}: no section {section!r} in {name}"
            text = text.split(start, 1)[1].split(end, 1)[0]
        return text
    return SNIPPET.sub(include, path.read_text())


# ---- the generated configuration reference -----------------------------------------------------------------------

def test_the_configuration_reference_is_generated_and_describes_every_field():
    page, problems = config_reference().render()
    assert problems == [], "fields without a description (a comment beside the field in its dataclass):\n  " + \
        "\n  ".join(problems)
    committed = (DOCS / "reference" / "config.md").read_text()
    assert committed == page, "docs/reference/config.md is out of date: run `python tools/config_reference.py`"


def test_field_comments_are_read_beside_and_above_each_field():
    source = '''
from dataclasses import dataclass

@dataclass
class Example:
    """A docstring."""
    beside: int = 1  # said beside
    # continued below it
    plain: int = 2  # its own
    # said above a field with nothing beside it
    above: int = 3
    nothing: int = 4
'''
    namespace: dict = {}
    path = REPO / ".cache" / "docs_test_example.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(source)
    try:
        spec = importlib.util.spec_from_file_location("docs_test_example", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["docs_test_example"] = module
        spec.loader.exec_module(module)
        namespace = config_reference().field_comments(module.Example)
    finally:
        sys.modules.pop("docs_test_example", None)
        path.unlink()
    assert namespace == {"beside": "said beside continued below it", "plain": "its own",
                         "above": "said above a field with nothing beside it", "nothing": ""}


# ---- the commands ------------------------------------------------------------------------------------------------

def placeholder(arg: str) -> bool:
    """recipe=NAME, FIELD=VALUE, trainer.seed=S, key=value ..., $NPROC, <rank>, /path/to/...: a pattern, not a value."""
    return bool(re.search(r"\.\.\.|\$|<|/path/to", arg) or re.fullmatch(r"[\w.+~]*=[A-Z][A-Z_]*", arg)
                or re.fullmatch(r"[A-Z][A-Z_]*(=.*)?", arg))
RUN, PLAN = "run", "plan"


def shell_words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    return list(lexer)


def commands_in(text: str) -> list[tuple[int, str]]:
    """(line, command) of every llmtrain command: the lines of fenced shell blocks (continuations joined, each
    `&&` / `;` / `|` part on its own) and inline code spans that start with one."""
    found = []
    lines = text.splitlines()
    fence, start = None, 0
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip() or "text"
            continue
        if fence in ("bash", "sh", "shell", "console"):
            found.append((number, stripped))
        elif fence is None:
            found += [(number, span) for span in re.findall(r"`([^`]+)`", line)]
    joined, carry = [], ""
    for number, line in found:
        carry = f"{carry} {line}" if carry else line
        if carry.endswith("\\"):
            carry = carry[:-1]
            start = start or number
            continue
        joined.append((start or number, carry))
        carry, start = "", 0
    commands = []
    for number, line in joined:
        try:
            words = shell_words(line)
        except ValueError:  # an inline span that is not shell (a lone quote)
            continue
        part: list[str] = []
        for word in [*words, ";"]:
            if word in ("&&", ";", "|", "||", "&"):
                if part:
                    commands.append((number, part))
                part = []
            else:
                part.append(word)
    return [(n, shlex.join(c)) for n, c in commands if llmtrain_command(c) is not None]


def llmtrain_command(words: list[str]) -> tuple[str, int | None, list[str]] | None:
    """(kind, world size or None when it cannot be told, overrides) of an llmtrain command, else None."""
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if words[:1] == ["torchrun"]:
        nproc, nnodes, rest = "1", "1", words[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            option, _, value = rest[0].partition("=")
            if not value and len(rest) > 1 and option not in ("--standalone",):
                value, rest = rest[1], rest[1:]
            nproc = value if option in ("--nproc_per_node", "--nproc-per-node") else nproc
            nnodes = value if option == "--nnodes" else nnodes
            rest = rest[1:]
        if rest[:2] != ["-m", "llmtrain"]:
            return None
        world = int(nproc) * int(nnodes) if nproc.isdigit() and nnodes.isdigit() else None
        return RUN, world, rest[2:]
    if words[:1] and words[0] in ("python", "python3") and words[1:2] == ["-m"] and len(words) > 2:
        module, args = words[2], words[3:]
    elif words[:1] and words[0] in ("llmtrain", "llmtrain-plan"):
        module, args = {"llmtrain": "llmtrain", "llmtrain-plan": "llmtrain.plan"}[words[0]], words[1:]
    else:
        return None
    if module == "llmtrain":
        return RUN, 1, args
    if module == "llmtrain.plan":
        return PLAN, 1, args
    return None


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) of every llmtrain command in README.md and docs/ (snippets included)."""
    return [(f"{path.relative_to(REPO)}:{number}", command) for path in markdown_files()
            for number, command in commands_in(expanded(path))]


def checkable(command: str) -> tuple[str, int, list[str]] | None:
    kind, world, args = llmtrain_command(shlex.split(command))
    if world is None or not args or any(a in ("-h", "--help") or placeholder(a) for a in args):
        return None  # a pattern (recipe=NAME, key=value ..., $NPROC), not a command to run as written
    return kind, world, args


def test_the_docs_have_commands_and_most_are_checked():
    commands = documented_commands()
    checked = [c for _, c in commands if checkable(c) is not None]
    assert len(checked) >= 20, f"only {len(checked)} of {len(commands)} documented commands are checkable"


@pytest.mark.uses_base  # documented commands name recipes that start from a trained base
def test_every_documented_command_validates():
    """Composes and validates each command as `dry_run=true` would, with the world it names (torchrun's
    --nproc_per_node × --nnodes; the planner's plan.world_size): a renamed field or group breaks this test, not the
    user. All in one test: the composition of a recipe dominates, a few seconds in all."""
    from llmtrain.compose import compose_config
    from llmtrain.validation import validate

    failures, seen = [], set()
    for where, command in documented_commands():
        parsed = checkable(command)
        if parsed is None or (parsed[0], parsed[1], tuple(parsed[2])) in seen:
            continue
        kind, world, args = parsed
        seen.add((kind, world, tuple(args)))
        try:
            cfg = compose_config([*args, "dry_run=true"] if kind == RUN else list(args))
            validate(cfg, (cfg.plan.world_size or world) if kind == PLAN else world)
        except Exception as error:  # every failure is reported together
            failures.append(f"{where}: {command}\n    {type(error).__name__}: {error}")
    assert not failures, "documented commands that do not validate:\n" + "\n".join(failures)


def test_command_extraction():
    text = ("```bash\n"
            "python -m llmtrain recipe=sft_tiny  # a comment\n"
            "torchrun --nproc_per_node 2 --nnodes=2 -m llmtrain recipe=sft_tiny \\\n"
            "  backend=zero2\n"
            "pip install x && PYTHONPATH=. python -m llmtrain.plan recipe=sft_7b plan.world_size=8\n"
            "```\n"
            "Inline: `llmtrain-plan recipe=sft_7b` and `python -m llmtrain recipe=NAME`, `ls`.\n")
    commands = [c for _, c in commands_in(text)]
    assert commands == ["python -m llmtrain recipe=sft_tiny",
                        "torchrun --nproc_per_node 2 --nnodes=2 -m llmtrain recipe=sft_tiny backend=zero2",
                        "PYTHONPATH=. python -m llmtrain.plan recipe=sft_7b plan.world_size=8",
                        "llmtrain-plan recipe=sft_7b", "python -m llmtrain recipe=NAME"]
    assert [checkable(c) for c in commands] == [
        (RUN, 1, ["recipe=sft_tiny"]), (RUN, 4, ["recipe=sft_tiny", "backend=zero2"]),
        (PLAN, 1, ["recipe=sft_7b", "plan.world_size=8"]), (PLAN, 1, ["recipe=sft_7b"]), None]


# ---- links -------------------------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def heading_ids(text: str) -> set[str]:
    """The ids MkDocs gives the headings of a page (Python-Markdown's toc slugify), outside code blocks."""
    ids, fence = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            title = re.sub(r"`|\*\*", "", line.lstrip("#").strip())
            title = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
            title = re.sub(r"[^\w\s-]", "", title).strip().lower()
            ids.add(re.sub(r"[-\s]+", "-", title))
    return ids


def test_every_relative_link_lands():
    """Links between the pages (and from README.md into docs/) point at files and headings that exist; links
    out of the repository are left to the strict site build. Plain Python: this runs without mkdocs."""
    broken = []
    for path in markdown_files():
        text = expanded(path)
        for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            destination = Path(os.path.normpath(path.parent / file)) if file else path  # symlinks kept
            if not destination.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in heading_ids(expanded(destination)):
                broken.append(f"{path.relative_to(REPO)}: {target} (no heading #{anchor})")
            elif path.is_relative_to(DOCS) and not destination.is_relative_to(DOCS):
                broken.append(f"{path.relative_to(REPO)}: {target} (outside docs/: the site cannot link it)")
    assert not broken, "\n".join(broken)


def test_every_page_llmtrain_names_exists():
    """`llmtrain.paths.docs_page("...")` in a message or in --help names a page that exists."""
    named = {page for path in (REPO / "llmtrain").rglob("*.py")
             for page in re.findall(r"""docs_page\(\s*["']([^"']+)["']""", path.read_text())}
    assert "reference/config.md" in named  # --help
    assert sorted(page for page in named if not (DOCS / page).is_file()) == []


def test_a_refused_config_links_the_reference_sections_of_the_fields_it_names():
    """validate()'s error ends with the configuration reference and the section of each group it names, and those
    sections exist in the generated page."""
    import pytest

    from llmtrain.compose import compose_config
    from llmtrain.config import ConfigError
    from llmtrain.validation import validate

    cfg = compose_config(["recipe=sft_tiny", "backend=zero3", "trainer.micro_batch_size=0", "optim.lr=-1"])
    with pytest.raises(ConfigError) as error:
        validate(cfg, 1)
    last = str(error.value).splitlines()[-1]
    assert last.startswith("every field and its values: docs/reference/config.md (")
    anchors = re.findall(r"#([\w-]+)", last)
    assert {"trainer", "optim"} <= set(anchors), last
    assert set(anchors) <= heading_ids((REPO / "docs" / "reference" / "config.md").read_text()), last


def test_every_page_is_in_the_navigation_and_every_result_on_the_benchmarks_page():
    nav = (REPO / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    pages = {p.relative_to(DOCS).as_posix() for p in [*DOCS.rglob("*.md"), *DOCS.rglob("*.ipynb")]}
    assert {p for p in pages if p not in nav} == set()
    benchmarks = (DOCS / "benchmarks.md").read_text()
    results = sorted(p.name for p in (REPO / "benchmarks" / "results").glob("*.md"))
    assert [r for r in results if f'--8<-- "benchmarks/results/{r}"' not in benchmarks] == []


def test_the_readme_is_short_and_keeps_its_two_commands():
    readme = (REPO / "README.md").read_text()
    prose = [line for line in re.sub(r"```.*?```", "", readme, flags=re.S).splitlines() if not line.startswith("|")]
    assert len(readme.splitlines()) <= 180
    assert [line for line in prose if len(line) > 120] == []
    assert "## Set up and run (two commands)" in readme


# ---- the site ----------------------------------------------------------------------------------------------------

def test_the_site_builds_in_strict_mode(tmp_path):
    """The `dev` extra brings the `docs` one: the site builds wherever the tests run."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
