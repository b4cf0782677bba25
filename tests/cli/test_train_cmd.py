import json
import subprocess
import sys


def run_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "graphswap.cli", "train", "--no-progress", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_train_embedded_default_runs(tmp_path) -> None:
    done = run_cli("steps=2", "num_layers=2", f"output_dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "activation_swap" in done.stdout and "attention" in done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[0]["swap"]["offloaded_bytes"] > 0


def test_train_compare_prints_both_rows_with_equal_losses(tmp_path) -> None:
    done = run_cli("--compare", "steps=2", "num_layers=2", f"output_dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    first = next(line for line in done.stdout.splitlines() if line.startswith("loss first"))
    values = first.split()[2:]
    assert len(values) == 2 and values[0] == values[1]


def test_train_rejects_bad_setting_with_key_in_message(tmp_path) -> None:
    done = run_cli("activation_swap=all", cwd=tmp_path)
    assert done.returncode == 2
    assert "activation_swap" in done.stderr and "attention" in done.stderr


def test_train_rejects_swap_with_compile(tmp_path) -> None:
    done = run_cli("compile=true", cwd=tmp_path)
    assert done.returncode == 2
    assert "compile" in done.stderr and "activation_swap" in done.stderr
