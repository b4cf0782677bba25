"""0.1.0's command line until 0.3 (``graphswap._compat._cli``): its flags, hidden
aliases that warn on stderr naming the flag now and then act as it, and ``graphswap
plan``, which runs ``graphswap passes`` with a warning. Scripts written against 0.1.0
keep running and print the same output."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest

from graphswap._compat._cli import FLAGS
from graphswap.train.cli import build_parser, main

pytestmark = pytest.mark.compat

Command = Callable[..., subprocess.CompletedProcess[str]]


@pytest.mark.parametrize(
    ("command", "old", "new"),
    [(command, old, new) for command, flags in FLAGS.items() for old, new in flags.items()],
)
def test_every_old_flag_is_unlisted_and_stands_for_its_new_one(
    command: str, old: str, new: str
) -> None:
    """Each old flag sets its new flag's setting, read with its type (the new flag's
    checks apply), and ``--help`` lists the new one only."""
    (subparsers,) = [a for a in build_parser()._actions if a.choices and command in a.choices]
    parser = subparsers.choices[command]
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    assert actions[old].dest == actions[new].dest
    assert actions[old].type is actions[new].type
    usage = parser.format_help()
    assert new in usage and f"{old} " not in usage and f"{old}\n" not in usage


def test_the_old_layers_flag_warns_and_writes_the_same_graph(
    graphswap_cmd: Command,
) -> None:
    """0.1.0's ``--layers`` is ``--num-layers``, the trainer config's key, until 0.3."""
    new = graphswap_cmd("graph", "--format", "json", "--num-layers", "3")
    old = graphswap_cmd("graph", "--format", "json", "--layers", "3")
    assert old.returncode == new.returncode == 0, old.stderr
    assert old.stdout == new.stdout and "deprecated" not in new.stderr
    assert "--layers is deprecated and will be removed; use --num-layers 3" in old.stderr


def test_the_last_releases_policy_flag_still_plans_and_names_its_successor(
    graphswap_cmd: Command,
) -> None:
    done = graphswap_cmd("plan-memory", "--preset", "tiny", "--seq-len", "64", "--policy", "layer")
    assert done.returncode == 0, done.stderr
    assert "activation_swap=layer" in done.stdout
    assert done.stderr == (
        "graphswap plan-memory: warning: --policy is deprecated and will be removed; use"
        " --activation-swap layer\n"
    )
    both = ("--policy", "layer", "--activation-swap", "attention")
    done = graphswap_cmd("plan-memory", "--preset", "tiny", "--seq-len", "64", *both)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "graphswap plan-memory: error: --activation-swap attention: given twice (first"
        " layer); give it once"
    )


def test_the_old_flags_warn_and_plan_the_same(graphswap_cmd: Command) -> None:
    argv = (
        "plan-memory",
        "--preset",
        "tiny",
        "--num-layers",
        "2",
        "--device",
        "cpu",
        "--format",
        "json",
    )
    old = graphswap_cmd(*argv, "--seq", "64", "--batch", "2", "--tp", "2")
    new = graphswap_cmd(*argv, "--seq-len", "64", "--batch-size", "2", "--tp-size", "2")
    assert old.returncode == new.returncode == 0
    assert "--seq is deprecated and will be removed; use --seq-len 64" in old.stderr
    assert "--tp is deprecated" in old.stderr and not new.stderr
    assert old.stdout == new.stdout


def test_the_old_budget_and_layers_flags_warn_and_plan_the_same(graphswap_cmd: Command) -> None:
    """0.1.0's ``--budget`` and ``--layers`` are the config keys' flags now."""
    argv = ("plan-memory", "--preset", "tiny", "--seq-len", "256", "--device", "cpu")
    old = graphswap_cmd(*argv, "--layers", "2", "--budget", "100GiB")
    new = graphswap_cmd(*argv, "--num-layers", "2", "--activation-memory-budget", "100GiB")
    assert old.returncode == new.returncode == 0, old.stderr
    assert "--budget is deprecated and will be removed; use --activation-memory-budget" in (
        old.stderr
    )
    assert "--layers is deprecated and will be removed; use --num-layers 2" in old.stderr
    assert not new.stderr and old.stdout == new.stdout and "budget" in new.stdout


def test_the_0_1_name_plan_runs_the_command_with_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``graphswap plan`` until 0.3: the same output, a warning naming ``graphswap passes``
    first on stderr, and errors under the name typed; unlisted in ``graphswap --help``."""
    argv = ["--format", "json", "activation_swap=attention", "tp_size=2"]
    assert main(["passes", *argv]) == 0
    new = capsys.readouterr()
    assert main(["plan", *argv]) == 0
    old = capsys.readouterr()
    assert old.out == new.out
    warning = (
        "graphswap plan: warning: graphswap plan is deprecated and will be removed in 0.3;"
        " use graphswap passes\n"
    )
    assert old.err == warning + new.err.replace("graphswap passes:", "graphswap plan:")
    assert main(["plan", "activation_swap=attention", "compile=true"]) == 2
    assert capsys.readouterr().err.startswith(f"{warning}graphswap plan: error: activation_swap")
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out
    assert "    passes " in listed and "    plan " not in listed
