"""Run ``graphswap`` commands in this process, through the entry point the console
script calls; each command's module keeps one subprocess test of the script itself,
started in the background when the module's tests begin (:func:`console_run`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
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


class ConsoleRun:
    """``python -m graphswap.train.cli ARGV`` in ``cwd``, running in the background."""

    def __init__(self, argv: Sequence[str], cwd: Path) -> None:
        self.cwd = cwd
        self._process = subprocess.Popen(
            [sys.executable, "-m", "graphswap.train.cli", *argv],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def done(self, timeout: float = 300) -> Done:
        """Wait for the command to end; what it left."""
        out, err = self._process.communicate(timeout=timeout)
        return Done(self._process.returncode, out, err)

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.communicate()


@pytest.fixture(scope="module", autouse=True)
def console(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConsoleRun | None]:
    """The console-script run of a module that names one: ``CONSOLE_ARGV``, which its test
    ``CONSOLE_TEST`` checks. Started as the module's first test begins, when that test is
    selected: a new interpreter spends seconds importing torch and transformers, and
    begun early it does so on the core the in-process tests leave idle."""
    test = getattr(request.module, "CONSOLE_TEST", None)
    selected = test is not None and any(
        item.module is request.module and item.originalname == test
        for item in request.session.items
        if isinstance(item, pytest.Function)
    )
    if not selected:
        yield None
        return
    run = ConsoleRun(request.module.CONSOLE_ARGV, tmp_path_factory.mktemp("console"))
    try:
        yield run
    finally:
        run.stop()
