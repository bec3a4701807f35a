"""benchmarks/decode_ec_ranks.py: the per-rank route choice written into the tuned table."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # the script imports kernels.py beside it
try:
    spec = importlib.util.spec_from_file_location("decode_ec_ranks", os.path.join(ROOT, "benchmarks", "decode_ec_ranks.py"))
    ranks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ranks)
finally:  # benchmarks/kernels.py must not shadow the `kernels` package transformers probes for
    sys.path.remove(os.path.join(ROOT, "benchmarks"))
    sys.modules.pop("kernels", None)

GENERIC = ["tma", 4, 2, 2, 2, 2]


def _row(**us):
    return {"us": dict(us), "err": {k: 3e-3 for k in us}}


def test_one_launch_written_where_it_wins_by_the_margin():
    assert ranks.rank_choice(_row(one_launch_tma=12.8, tma_pair=13.6, pdl_pair=14.9), GENERIC, True, 0.3) == GENERIC


def test_pair_written_where_the_dispatchs_pair_wins():
    assert ranks.rank_choice(_row(one_launch_tma=15.1, tma_pair=13.8, pdl_pair=14.8), GENERIC, True, 0.3) == ["pair"]


def test_the_pair_compared_is_the_one_the_dispatch_takes():
    # the TMA pair is fastest, but the table sends this shape to the CUDA-core pair (tma_ec_measured_ok False)
    row = _row(one_launch_tma=14.4, tma_pair=13.0, pdl_pair=15.2)
    assert ranks.rank_choice(row, GENERIC, False, 0.3) == GENERIC
    assert ranks.rank_choice(row, GENERIC, True, 0.3) == ["pair"]


def test_near_ties_and_bad_routes_write_nothing():
    assert ranks.rank_choice(_row(one_launch_tma=14.9, pdl_pair=14.8), GENERIC, False, 0.3) is None
    row = _row(one_launch_tma=12.0, pdl_pair=14.8)
    row["err"]["one_launch_tma"] = 0.5  # wrong answers never win
    assert ranks.rank_choice(row, GENERIC, False, 0.3) is None
    row["err"]["one_launch_tma"] = "RuntimeError: ..."  # a route that raised
    assert ranks.rank_choice(row, GENERIC, False, 0.3) is None
    assert ranks.rank_choice(_row(pdl_pair=14.8), GENERIC, False, 0.3) is None
