"""Config dataclasses reject wrong types and out-of-range values where they are written."""
import pytest

import spear_compile as spear
from spear_compile import CompileConfig, ECConfig, QuantConfig
from spear_compile.compensators.calibrate import CalibConfig
from spear_compile.compensators.spear import SpearConfig, parse_overrides


@pytest.mark.parametrize("make,match", [
    (lambda: CalibConfig(lr_ab="1e-3"), r"CalibConfig.lr_ab='1e-3': expected a finite number"),
    (lambda: CalibConfig(lr_ab=float("nan")), "CalibConfig.lr_ab=nan: expected a finite number"),
    (lambda: CalibConfig(steps=100.0), "CalibConfig.steps=100.0: expected an integer"),
    (lambda: CalibConfig(steps=True), "CalibConfig.steps=True: expected an integer"),
    (lambda: CalibConfig(train_ab="false"), "CalibConfig.train_ab='false': expected True or False"),
    (lambda: CalibConfig(lr=-1.0), r"CalibConfig.lr=-1.0: must be >= 0"),
    (lambda: CalibConfig(temperature=0), "CalibConfig.temperature=0: must be > 0"),
    (lambda: SpearConfig(min_rank=10, max_rank=4), "min_rank=10 exceeds max_rank=4"),
    (lambda: SpearConfig(max_rank=2.5), "SpearConfig.max_rank=2.5: expected an integer"),
    (lambda: SpearConfig(gate_init_bias=-100), "SpearConfig.gate_init_bias=-100: expected >= -10.0"),
    (lambda: SpearConfig(calib={"steps": 2}), "expected a CalibConfig"),
    (lambda: ECConfig(rank=2.5), "ECConfig.rank=2.5: expected an integer"),
    (lambda: ECConfig(gate_init_bias=40), "ECConfig.gate_init_bias=40: expected <= 30.0"),
    (lambda: QuantConfig(group_size=0.0), r"QuantConfig.group_size=0.0: expected an integer or None"),
    (lambda: ECConfig(gate_init_bias=float("nan")), "ECConfig.gate_init_bias=nan: expected a finite number"),
    (lambda: CompileConfig(crossover_m="32"), "CompileConfig.crossover_m='32': expected an integer or None"),
    (lambda: CompileConfig(fuse_shared_input="no"), "CompileConfig.fuse_shared_input='no': expected True or False"),
    (lambda: CompileConfig(default_crossover_m=None), "CompileConfig.default_crossover_m=None: expected an integer"),
    (lambda: QuantConfig(group_size=32.0), r"QuantConfig.group_size=32.0: expected an integer or None"),
    (lambda: QuantConfig(symmetric="no"), "QuantConfig.symmetric='no': expected True or False"),
])
def test_wrong_types_and_ranges_fail_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_numpy_scalars_are_accepted_as_python_numbers():
    import numpy as np

    c = CalibConfig(steps=np.int64(5), lr=np.float32(0.5))
    assert type(c.steps) is int and c.steps == 5 and type(c.lr) is float and c.lr == 0.5
    with pytest.raises(ValueError, match=r"CalibConfig.steps=.*5\.5.*: expected an integer"):
        CalibConfig(steps=np.float64(5.5))


def test_valid_values_still_pass():
    assert QuantConfig(group_size=0).group_size is None  # 0 means per-channel
    assert CalibConfig(lr=0, random_first=0).lr == 0  # frozen gates; ints where floats are expected
    assert SpearConfig(gate_init_bias=0, min_rank=2, max_rank=2).max_rank == 2
    assert CompileConfig(crossover_m=None, default_crossover_m=32).default_crossover_m == 32


def test_overrides_parse_floats_json_does_not_and_report_the_rest():
    assert parse_overrides("lr_ab=.001,lr=1.e-3,steps=5,select=all") == {
        "lr_ab": 0.001, "lr": 0.001, "steps": 5, "select": "all"}
    with pytest.raises(ValueError, match="SPEAR setting lr_ab='abc': expected a number"):
        parse_overrides("lr_ab=abc")
    with pytest.raises(ValueError, match="CalibConfig.steps=100.0: expected an integer"):
        SpearConfig().replace(**parse_overrides("steps=1e2"))


def test_compile_config_context_wants_a_compile_config():
    with pytest.raises(TypeError, match=r"expected a CompileConfig, got dict \(CompileConfig\(\*\*"):
        with spear.compile_config({"crossover_m": 32}):
            pass
