"""Run ``graphswap`` commands in this process, through the entry point the console
script calls; each command's module keeps one subprocess test of the script itself
(``CONSOLE_TEST`` and ``CONSOLE_ARGV``: the ``console`` fixture of tests/conftest.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from graphswap.train.cli import main


@pytest.fixture
def graphswap_cmd(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``graphswap_cmd(*argv, cwd=None)``: ``graphswap ARGV`` in process; argparse's and
    the commands' exits through ``SystemExit`` become the return code, and what it
    printed the process's output, as if the console script had run."""

    def run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(argv), code, out, err)

    return run
