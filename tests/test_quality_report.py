"""benchmarks/quality.py: the table and plot are built from the saved run JSONs."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("quality", os.path.join(ROOT, "benchmarks", "quality.py"))
quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality)


def _run(method, budget, gap, quant="rtn", group=0):
    return {"quant": quant, "group_size": group, "method": method, "budget": budget, "ppl_ref": 36.0,
            "ppl_quant": 60.0, "ppl_method": 60.0 - 24.0 * gap, "gap_recovered": gap, "memory_overhead": budget * 0.9,
            "calibration_seconds": 1.0, "texts": ["hamlet_gut"], "tokens": 2048}


def test_aggregate_writes_table_json_and_one_plot_per_base(tmp_path):
    runs = [_run("qera", 0.005, 0.5), _run("qera", 0.01, 0.6), _run("spear", 0.01, 0.8),
            _run("lqer", 0.01, 0.4, quant="gptq")]
    for r in runs:
        with open(tmp_path / (quality.tag(r["quant"], r["group_size"], r["method"], r["budget"]) + ".json"), "w") as f:
            json.dump(r, f)
    res = quality.aggregate(str(tmp_path))
    assert res["runs"] == 4
    md = (tmp_path / "quality.md").read_text()
    assert "| RTN per-channel (36.00 -> 60.00) | spear | - | 80.0% (0.90%, ppl 40.80) |" in md
    assert "| RTN per-channel (36.00 -> 60.00) | qera | 50.0% (0.45%, ppl 48.00) | 60.0% (0.90%, ppl 45.60) |" in md
    assert "GPTQ per-channel" in md and md.count("\n") == 2 + 3
    assert len(json.load(open(tmp_path / "quality.json"))) == 4
    svg = (tmp_path / "quality_rtn_gch.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and svg.count("<circle") == 3
    assert (tmp_path / "quality_gptq_gch.svg").exists()


def test_table_skips_foreign_json(tmp_path):
    (tmp_path / "notes.json").write_text('{"hello": 1}')
    (tmp_path / "device_quality.json").write_text('[{"method": "qera"}]')  # another aggregate: a list
    assert quality.load_runs(str(tmp_path)) == []
    with pytest.raises(SystemExit):
        quality.main(["--bogus"])


def test_a_run_kept_as_its_summary_reports_its_own_module_count(tmp_path):
    full = dict(_run("spear", 0.01, 0.8), modules=[{"name": "a", "rank": 4}, {"name": "b", "rank": 8}])
    summary = dict(_run("qera", 0.01, 0.6), n_modules=210, ranks=[2], note="summary only")
    for r in (full, summary):
        with open(tmp_path / (quality.tag(r["quant"], 0, r["method"], r["budget"]) + ".json"), "w") as f:
            json.dump(r, f)
    quality.aggregate(str(tmp_path))
    rows = {r["method"]: r for r in json.load(open(tmp_path / "quality.json"))}
    assert (rows["spear"]["n_modules"], rows["spear"]["ranks"]) == (2, [4, 8])
    assert (rows["qera"]["n_modules"], rows["qera"]["ranks"]) == (210, [2])


def test_spear_with_trained_scales_gets_its_own_row(tmp_path):
    """A SPEAR run that also trained the base's scales and zeros (``train_quant``) changed the base,
    so the table must not put it in SPEAR's row."""
    plain = dict(_run("spear", 0.01, 0.8), calibration={"train_quant": False})
    tuned = dict(_run("spear", 0.01, 0.9), calibration={"train_quant": True})
    for i, r in enumerate((plain, tuned)):
        with open(tmp_path / f"run{i}.json", "w") as f:
            json.dump(r, f)
    md = quality.aggregate(str(tmp_path))["table"]
    assert "| spear | 80.0%" in md and "| spear+scales | 90.0%" in md
