"""The README and the documentation stay true to the code: the README is short, its
quickstart is the two commands that work on a fresh machine, its Python examples run
as written and print what their comments say, its links lead somewhere, and every public
name has an API page entry. `make docs` (mkdocs --strict) checks the site's own links
and that every name an API page cites exists; these checks need no docs packages."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path
from typing import Any

import pytest
import tomllib

from graphswap.rewriting import rules

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250
PUBLIC_MODULES = (
    "graphswap",
    "graphswap.runtime",
    "graphswap.runtime.sim",
    "graphswap.planning",
    "graphswap.planning.trace",
    "graphswap.train.budget",
)


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.M | re.S)


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_the_quickstart_is_two_make_targets() -> None:
    """Exactly ``make train`` and ``make test``: CI runs the second, and both create the
    virtual environment they need on a fresh machine."""
    (block,) = fenced_blocks(section(README.read_text(), "Quickstart"), "sh")
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert [c for c in commands if c] == ["make train", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    for rule in ("train: $(STAMP)", "test: lint", "lint: $(STAMP)"):
        assert f"\n{rule}\n" in makefile, f"the Makefile no longer says {rule!r}"


def test_the_readme_links_lead_somewhere() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, missing


def test_the_readme_examples_run_and_print_what_they_say(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python blocks in order, in one namespace, as a reader would paste them; the
    rule the README registers goes into a copy of the registry."""
    monkeypatch.setattr(rules, "_REGISTRY", dict(rules._REGISTRY))
    blocks = fenced_blocks(README.read_text(), "python")
    assert len(blocks) >= 3
    namespace: dict[str, Any] = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)
    said = re.findall(r"^print\(.*\)\s+# (.*)$", "\n".join(blocks), re.M)
    assert said and printed.getvalue().splitlines() == said


def documented_objects() -> list[Any]:
    """Every object a ``:::`` line of ``docs/api/`` names, resolved as mkdocstrings
    resolves it: the longest importable module, then attributes."""
    found = []
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        for path in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.M):
            parts = path.split(".")
            for split in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:split]))
                except ImportError:
                    continue
                for attr in parts[split:]:
                    obj = getattr(obj, attr)
                found.append(obj)
                break
    return found


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_has_an_api_entry(module: str) -> None:
    documented = documented_objects()
    public = importlib.import_module(module)
    missing = [
        name
        for name in public.__all__
        if not any(getattr(public, name) is obj for obj in documented)
    ]
    assert not missing, f"add a ':::' line to a page of docs/api/ for {module}: {missing}"


def test_the_changelogs_latest_release_is_the_packages_version() -> None:
    """Each release has its section, headed by its version and date, under an
    ``Unreleased`` section for what comes next; the package says the same version."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings[0] == "Unreleased"
    released = [h for h in headings[1:] if re.fullmatch(r"\d+\.\d+\.\d+ — \d{4}-\d\d-\d\d", h)]
    assert released and released[0].startswith(f"{version} — "), (version, headings)
