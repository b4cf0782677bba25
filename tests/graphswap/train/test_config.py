"""TrainerConfig and the strict YAML resolver: nothing the user writes is dropped."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from graphswap.planning._budget import read_memory_budget
from graphswap.train.config import ConfigError, TrainerConfig, check_finite_positive, resolve_config

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train.yaml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(text)
    return path


def test_default_activation_swap_is_none() -> None:
    assert TrainerConfig().activation_swap == "none"
    assert resolve_config({}).activation_swap == "none"
    assert resolve_config(None).activation_swap == "none"


@pytest.mark.parametrize("value", ["none", "attention", "layer", "auto"])
def test_yaml_values_accepted(tmp_path: Path, value: str) -> None:
    path = _write(tmp_path, f"activation_swap: {value}\n")
    assert resolve_config(path).activation_swap == value


def test_example_lists_every_key_with_defaults() -> None:
    import yaml

    data = yaml.safe_load(EXAMPLE.read_text())
    assert list(data) != [] and set(data) == set(TrainerConfig.keys())
    assert resolve_config(EXAMPLE) == TrainerConfig()
    assert "activation_swap: none  # none, attention, layer, auto, budget" in EXAMPLE.read_text()


def test_illegal_value_lists_allowed_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(_write(tmp_path, "activation_swap: attn\n"))
    assert str(info.value) == (
        "activation_swap: got 'attn'; allowed values: 'none', 'attention', 'layer', 'auto',"
        " 'budget'"
    )
    assert info.value.key == "activation_swap"


@pytest.mark.parametrize("text", ["activation_swap: null\n", "activation_swap: ~\n"])
def test_yaml_null_is_not_none(tmp_path: Path, text: str) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^activation_swap: got null; allowed values: "
        r"'none', 'attention', 'layer', 'auto', 'budget' \(YAML null means no value",
    ):
        resolve_config(_write(tmp_path, text))


def test_unknown_key_suggests_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(_write(tmp_path, "activation_swp: attention\n"))
    assert str(info.value).startswith(
        "activation_swp: unknown key; did you mean 'activation_swap'? valid keys: "
    )


def test_unknown_key_without_close_match() -> None:
    with pytest.raises(ConfigError, match=r"^zzz: unknown key; valid keys: activation_swap, "):
        resolve_config({"zzz": 1})


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"tp_size": "two"}, "tp_size: expected an integer, got str 'two'"),
        ({"tp_size": 2.0}, "tp_size: expected an integer, got float 2.0"),
        ({"tp_size": True}, "tp_size: expected an integer, got bool True"),
        ({"compile": 1}, "compile: expected true or false, got int 1"),
        ({"compile": "yes please"}, "compile: expected true or false, got str 'yes please'"),
        ({"lr": "fast"}, "lr: expected a number, got str 'fast'"),
        ({"output_dir": 3}, "output_dir: expected a string, got int 3"),
        ({"num_layers": "4"}, "num_layers: expected an integer, got str '4'"),
        ({"activation_swap": True}, "activation_swap: got True; allowed values: "),
        ({"dtype": "fp16"}, "dtype: got 'fp16'; allowed values: 'float32', 'bfloat16'"),
        (
            {"swap_bandwidth_gbps": "fast"},
            "swap_bandwidth_gbps: expected a number or 'measure', got str 'fast'",
        ),
        ({"swap_tflops": "lots"}, "swap_tflops: expected a number, got str 'lots'"),
    ],
)
def test_wrong_type_names_the_key(mapping: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(mapping)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"tp_size": 0}, "tp_size: must be >= 1, got 0"),
        ({"pp_size": -2}, "pp_size: must be >= 1, got -2"),
        ({"seq_len": 0}, "seq_len: must be >= 2, got 0"),
        ({"swap_prefetch_depth": 0}, "swap_prefetch_depth: must be >= 1, got 0"),
        ({"swap_prefetch_depth": 2}, "swap_prefetch_depth: is 2 but activation_swap: none"),
        ({"num_layers": 0}, "num_layers: must be >= 1, got 0"),
        ({"rope_factor": 1}, "rope_factor: must be a finite number > 1"),
        ({"rope_factor": float("inf")}, "rope_factor: must be a finite number > 1"),
        ({"seed": -1}, "seed: must be >= 0, got -1"),
        ({"lr": 0}, "lr: must be a finite number > 0, got 0.0"),
        ({"lr": float("inf")}, "lr: must be a finite number > 0, got inf"),
        ({"lr": float("nan")}, "lr: must be a finite number > 0, got nan"),
        (
            {"model_path": "ckpt", "model": "qwen3-30b-a3b"},
            "model_path: is set, so the preset model: qwen3-30b-a3b would be ignored;",
        ),
        ({"model": "qwen9"}, "model: unknown preset 'qwen9'; allowed values: "),
        ({"output_dir": ""}, "output_dir: must not be empty"),
        (
            {"activation_swap": "auto", "swap_bandwidth_gbps": 0},
            "swap_bandwidth_gbps: must be a finite number of GB/s > 0 or measure, got 0.0",
        ),
        (
            {"activation_swap": "auto", "swap_bandwidth_gbps": -5},
            "swap_bandwidth_gbps: must be a finite number of GB/s > 0 or measure, got -5.0",
        ),
        (
            {"activation_swap": "auto", "swap_tflops": -1},
            "swap_tflops: must be a finite number of TFLOP/s > 0, got -1.0",
        ),
        (
            {"activation_swap": "auto", "swap_tflops": float("inf")},
            "swap_tflops: must be a finite number of TFLOP/s > 0, got inf",
        ),
        ({"activation_swap": "auto", "swap_hide_margin": 1}, "swap_hide_margin: must be in [0, 1)"),
        (
            {"activation_swap": "auto", "swap_hide_margin": -0.1},
            "swap_hide_margin: must be in [0, 1)",
        ),
        (
            {"activation_swap": "layer", "swap_tflops": 100},
            "swap_tflops: is 100.0 but activation_swap: layer, so it would change nothing",
        ),
        (
            {"swap_bandwidth_gbps": "measure"},
            "swap_bandwidth_gbps: is measure but activation_swap: none, so it would change",
        ),
    ],
)
def test_value_checks_name_the_key(mapping: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(mapping)
    assert str(info.value).startswith(message)


def test_auto_settings_read_numbers_and_measure(tmp_path: Path) -> None:
    auto = resolve_config(
        _write(tmp_path, "activation_swap: auto\nswap_bandwidth_gbps: 1e3\nswap_hide_margin: 0\n")
    )
    # swap_tflops left out: the device profile's figure (None here).
    assert (auto.swap_bandwidth_gbps, auto.swap_tflops, auto.swap_hide_margin) == (
        1000.0,
        None,
        0.0,
    )
    measured = resolve_config({"activation_swap": "auto"}, ["swap_bandwidth_gbps=measure"])
    assert measured.swap_bandwidth_gbps == "measure"


def test_auto_plans_on_the_device_profile_unless_told_otherwise() -> None:
    """No link or compute figure set: auto plans with the profile of the device it runs
    on (the simulated one's here); a figure set replaces the profile's."""
    from graphswap.planning._settings import DEFAULT_HIDE_MARGIN
    from graphswap.train.build import build

    config = TrainerConfig()
    assert (config.swap_bandwidth_gbps, config.swap_tflops, config.swap_hide_margin) == (
        None,
        None,
        DEFAULT_HIDE_MARGIN,
    )
    small = {"activation_swap": "auto", "num_layers": 2, "seq_len": 16, "batch_size": 1}
    profiles = []
    for extra in ({}, {"swap_tflops": 7.0}):
        sim = TrainerConfig(**small, device="sim:h100,link_gbps=10", **extra)
        auto = build(sim).plan_executor
        assert auto is not None
        profiles.append(auto.plan.profile)
    assert [(p.d2h_gbps, p.tflops) for p in profiles] == [(10.0, 400.0), (10.0, 7.0)]


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"^activation_swap: got 'yes'"):
        TrainerConfig(activation_swap="yes")  # type: ignore[arg-type]
    assert isinstance(TrainerConfig(lr=1).lr, float)


def test_yaml_11_float_text_is_a_float(tmp_path: Path) -> None:
    assert resolve_config(_write(tmp_path, "lr: 1e-3\n")).lr == pytest.approx(1e-3)
    assert resolve_config({}, ["lr=3e-4"]).lr == pytest.approx(3e-4)


def test_overrides_win_and_are_validated(tmp_path: Path) -> None:
    path = _write(tmp_path, "activation_swap: none\ntp_size: 2\n")
    config = resolve_config(path, ["activation_swap=attention", "tp_size=4", "data=/x/y.txt"])
    assert (config.activation_swap, config.tp_size, config.data) == ("attention", 4, "/x/y.txt")
    assert resolve_config(path, ["model_path=null"]).model_path is None
    with pytest.raises(ConfigError, match=r"^activation_swap: got null"):
        resolve_config(path, ["activation_swap=null"])
    with pytest.raises(ConfigError, match=r"^tp_sise: unknown key; did you mean 'tp_size'"):
        resolve_config(path, ["tp_sise=2"])
    with pytest.raises(ConfigError, match=r"^fsdp: expected true or false"):
        resolve_config(path, ["fsdp=maybe"])
    with pytest.raises(ConfigError, match=r"^fsdp: override 'fsdp' must look like key=value"):
        resolve_config(path, ["fsdp"])


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^<file>: cannot read"):
        resolve_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"^<root>: expected a mapping"):
        resolve_config(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"^<file>: .* is not valid YAML"):
        resolve_config(_write(tmp_path, "a: [\n"))
    assert resolve_config(_write(tmp_path, "")) == TrainerConfig()


def test_inf_override_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^lr: must be a finite number"):
        resolve_config({}, ["lr=.inf"])


def test_model_path_with_the_default_model_is_accepted() -> None:
    """The example YAML lists model: tiny; a model_path override must still work."""
    assert resolve_config(EXAMPLE, ["model_path=ckpt"]).model_path == "ckpt"


def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, "lr: 1.0e-3\nsteps: 2\nlr: 3.0e-4\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(path)
    assert str(info.value) == (
        f"lr: given twice in {str(path)!r} (lines 1 and 3); keep one of them"
    )


def test_a_binary_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes([0x80, 0xFF, 0x00, 0xC3]) * 16)
    with pytest.raises(ConfigError, match=r"^<file>: .*weights\.bin' is not a UTF-8 text file"):
        resolve_config(path)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainerConfig().tp_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "text",
    [
        "pass_order: [swap, fsdp]\n",
        "pass_order:\n  - swap\n  - fsdp\n",
        "pass_order: swap,fsdp\n",
        "pass_order: swap, fsdp\n",
    ],
)
def test_pass_order_reads_a_yaml_list_or_names_with_commas(tmp_path: Path, text: str) -> None:
    assert resolve_config(_write(tmp_path, text)).pass_order == ("swap", "fsdp")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("pass_order=swap,tensor_parallel", ("swap", "tensor_parallel")),
        ("pass_order=[swap, tensor_parallel]", ("swap", "tensor_parallel")),
        ("pass_order=swap", ("swap",)),
        ("pass_order=[]", ()),
        ("pass_order=null", None),
    ],
)
def test_pass_order_override(override: str, expected: tuple[str, ...] | None) -> None:
    assert resolve_config(None, [override]).pass_order == expected


def test_pass_order_is_immutable_and_checked_for_type() -> None:
    assert TrainerConfig(pass_order=["swap"]).pass_order == ("swap",)  # type: ignore[arg-type]
    assert TrainerConfig().pass_order is None
    for bad in ({"pass_order": 3}, {"pass_order": [1, "swap"]}, {"pass_order": {"a": 1}}):
        with pytest.raises(ConfigError, match=r"^pass_order: expected a list of names") as info:
            resolve_config(bad)
        assert info.value.key == "pass_order"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "pass_order=",
            "pass_order: override 'pass_order=' has no value; give one, or pass_order=null"
            " to leave it at its default",
        ),
        ("activation_swap=", "activation_swap: override 'activation_swap=' has no value; give one"),
        ("lr= ", "lr: override 'lr= ' has no value; give one"),
    ],
)
def test_an_override_without_a_value_is_an_error(override: str, message: str) -> None:
    """YAML reads empty text as null: ``pass_order=`` would run the canonical order."""
    with pytest.raises(ConfigError) as info:
        resolve_config({}, [override])
    assert str(info.value) == message
    assert resolve_config({}, ["pass_order=null"]).pass_order is None


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("-inf"), float("nan")])
def test_the_finite_positive_rule_is_one_function(value: float) -> None:
    """What train refuses for its rates, plan-memory's flags refuse through the same call."""
    with pytest.raises(ConfigError) as info:
        check_finite_positive("--bandwidth", value, "GB/s")
    assert str(info.value) == f"--bandwidth: must be a finite number of GB/s > 0, got {value!r}"
    assert info.value.detail == f"must be a finite number of GB/s > 0, got {value!r}"
    assert check_finite_positive("--bandwidth", 25.0, "GB/s") == 25.0


@pytest.mark.parametrize(
    ("override", "read"), [('"0.85"', 0.85), ("0.85", 0.85), ("2e7", 20_000_000)]
)
def test_a_budget_reads_as_the_docs_say_however_it_is_spelled(override: str, read: float) -> None:
    """Up to 1 a fraction of the device's memory (quoted too), above 1 bytes (2e7 was
    refused as a fraction, naming 8e10 as an example)."""
    config = resolve_config(
        None, ["activation_swap=budget", f"activation_memory_budget={override}"]
    )
    assert read_memory_budget(config.activation_memory_budget) == read


def test_an_infinite_budget_is_refused_by_its_key() -> None:
    with pytest.raises(ConfigError, match=r"^activation_memory_budget: is not a finite"):
        resolve_config(None, ["activation_swap=budget", "activation_memory_budget=1e400"])
