"""Run ``graphswap`` commands in this process, through the entry point the console
script calls; each command's module keeps one subprocess test of the script itself
(``CONSOLE_TEST`` and ``CONSOLE_ARGV``: the ``console`` fixture of tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from graphswap.train.cli import main


@dataclass(frozen=True)
class Done:
    """What a finished command left: the names of ``subprocess.CompletedProcess``."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def graphswap_cmd(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Done]:
    """``graphswap_cmd(*argv, cwd=None)``: ``graphswap ARGV`` in process; argparse's and
    the commands' exits through ``SystemExit`` become the return code."""

    def run(*argv: str, cwd: Path | None = None) -> Done:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        out, err = capsys.readouterr()
        return Done(code, out, err)

    return run
