"""The house plan as a checked contract: imports point down (application -> passes ->
core), every module has a place, and the contract really fails on an upward import."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def contract_layers() -> list[set[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = config["tool"]["importlinter"]["contracts"]
    return [set(re.split(r"\s*[:|]\s*", layer.strip())) for layer in contract["layers"]]


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_module_is_placed_in_a_layer() -> None:
    """A new module must be put in a layer: unplaced, the contract would not see it."""
    placed = set().union(*contract_layers())
    modules = {
        f"graphswap.{path.stem if path.is_file() else path.name}"
        for path in (ROOT / "graphswap").iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").is_file()
    }
    assert modules - placed == set(), "place these modules in pyproject.toml's layers contract"
    assert placed - modules == set(), "the contract names modules that do not exist"


def test_the_tree_keeps_the_contract() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "upward"),
    [
        ("graphswap/rewriting/rules.py", "graphswap.passes"),
        ("graphswap/passes/pass_plan.py", "graphswap.train.trainer"),
        ("graphswap/runtime/_manager.py", "graphswap.planning"),
    ],
)
def test_an_upward_import_breaks_the_contract(tmp_path: Path, module: str, upward: str) -> None:
    """On a copy of the tree, one upward import added: the contract must fail and name it."""
    for package in ("graphswap", "passes"):  # graphswap/passes links to passes/
        shutil.copytree(
            ROOT / package,
            tmp_path / package,
            symlinks=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    source = tmp_path / module
    source.write_text(source.read_text() + f"\nimport {upward}  # noqa\n")
    result = lint_imports(tmp_path)
    importer = module.removesuffix(".py").replace("/", ".")
    assert result.returncode != 0, result.stdout
    assert "0 kept, 1 broken" in result.stdout
    assert f"{importer} -> {upward}" in result.stdout
