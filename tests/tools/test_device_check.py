"""``tools/device_check.sh`` refuses what would waste a GPU session, before anything runs.

Its steps themselves run in CI as ``make device-dry-run``, in the GPU image's packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "device_check.sh"


def check(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHON": python, "CUDA_VISIBLE_DEVICES": ""},
    )


def test_usage_is_out_dir_and_an_optional_dry_run() -> None:
    for args in ((), ("out", "--fast"), ("out", "--dry-run", "extra")):
        done = check(*args)
        assert done.returncode == 2
        assert "usage: tools/device_check.sh OUT_DIR [--dry-run]" in done.stderr


def test_a_missing_package_stops_it_before_any_step(tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text("import sys\nsys.modules['transformers'] = None\n")
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\nPYTHONPATH="{blocked}:$PYTHONPATH" exec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    out = tmp_path / "out"
    done = check(str(out), "--dry-run", python=str(python))
    assert done.returncode == 2
    assert "error: missing packages: transformers" in (out / "environment.txt").read_text()
    assert not (out / "cuda-tests.log").exists()
