"""What ``pip install graphswap`` puts into a user's environment: the pass plan under
``graphswap.passes``, and no top-level ``passes`` (nor ``tests`` or ``tools``), which
would shadow or be shadowed by a user's own package of that name."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_graphswap_alone(tmp_path: Path) -> None:
    """Built from a copy of what the wheel is made of (no build/ left in the checkout),
    with this environment's setuptools (no download)."""
    source = tmp_path / "source"
    for folder in ("graphswap", "passes"):  # graphswap/passes links to passes/
        shutil.copytree(
            ROOT / folder,
            source / folder,
            symlinks=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / file, source)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*pip_wheel, "-q", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("graphswap-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"graphswap"}
    passes = {name.removeprefix("graphswap/passes/") for name in names if "/passes/" in name}
    assert {"__init__.py", "pass_plan.py", "specs.py", "errors.py", "swap.py"} <= passes
    assert passes == {path.name for path in (ROOT / "passes").glob("*.py")}
