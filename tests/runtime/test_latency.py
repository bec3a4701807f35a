"""The latency model: tables, the composition against a hand-computed case (the fits: test_fit)."""
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spear_compile.runtime.latency import AttentionCost, LatencyModel, LatencyTable, LinearTable, Overhead


def test_table_interpolates_and_extends_linearly():
    t = LatencyTable((1, 4, 8), (1.0, 2.5, 4.5))
    assert t(0) == 0.0
    assert t(1) == 1.0 and t(4) == 2.5 and t(8) == 4.5
    assert t(2) == pytest.approx(1.5)          # between 1 and 4
    assert t(6) == pytest.approx(3.5)          # between 4 and 8
    assert t(16) == pytest.approx(4.5 + 0.5 * 8)  # the last slope, 0.5 ms per row
    one = LatencyTable((4,), (2.0,))
    assert one(2) == 2.0 and one(8) == pytest.approx(4.0)  # one bucket: below holds, above proportional


@pytest.mark.parametrize("kw, field", [
    (dict(buckets=(), ms=()), "non-empty"),
    (dict(buckets=(1, 2), ms=(1.0,)), "as long"),
    (dict(buckets=(0, 2), ms=(1.0, 2.0)), "buckets[0]"),
    (dict(buckets=(2, 2), ms=(1.0, 2.0)), "strictly increasing"),
    (dict(buckets=(1, 2), ms=(1.0, -2.0)), "ms[1]"),
    (dict(buckets=(1, 2), ms=(2.0, 1.0)), "non-decreasing"),
    (dict(buckets=(1, 2), ms=(1.0, float("nan"))), "ms[1]"),
])
def test_table_rejects_bad_input_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        LatencyTable(**kw)


def test_monotone_takes_a_running_maximum():
    assert LatencyTable.monotone((1, 2, 4), (1.0, 0.8, 3.0)).ms == (1.0, 1.0, 3.0)


tables = st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(st.integers(1, 600), min_size=n, max_size=n, unique=True).map(sorted),
    st.lists(st.floats(0, 5), min_size=n, max_size=n))).map(
    lambda bm: LatencyTable.monotone(tuple(bm[0]), [sum(bm[1][: i + 1]) for i in range(len(bm[1]))]))


@settings(max_examples=60, deadline=None)
@given(tables, tables, st.integers(0, 2000))
def test_sum_of_tables_is_exact_and_segment_agrees(a, b, m):
    s = a + b
    assert s(m) == pytest.approx(a(m) + b(m), rel=1e-9, abs=1e-9)
    if m >= 1:
        start, v, slope = s.segment(m)
        assert v + slope * (m - start) == pytest.approx(s(m), rel=1e-9, abs=1e-9)


def hand_model(head_rows="last"):
    # two linears: "a" x 2 instances, "b" x 1; head; attention; overhead (numbers chosen to add up by hand)
    a = LatencyTable((1, 4), (1.0, 2.5))       # 0.5 ms per row between 1 and 4
    b = LatencyTable((1, 2, 8), (0.25, 0.5, 2.0))  # 0.25 ms per row throughout
    head = LatencyTable((1, 2), (0.5, 1.0))
    attn = AttentionCost(per_seq_ms=0.01, per_query_ms=0.02, per_key_ms=0.001, per_pair_ms=0.0001)
    return LatencyModel((LinearTable("a", 2, a), LinearTable("b", 1, b)), head, attn, n_layers=3,
                        overhead=Overhead(fixed_ms=0.3, per_token_ms=0.05, per_seq_ms=0.02), head_rows=head_rows)


def test_composition_against_a_hand_computed_case():
    m = hand_model()
    # one decode with 10 cached tokens + one prefill piece of 5 tokens after 2 cached: M = 6 rows, S = 2
    got = m.predict_step_ms([10], [(5, 2)])
    lin = 2 * (2.5 + 0.5 * 2) + (0.25 * 6)      # a(6) extends the 1->4 slope; b(6) = 1.5
    head = 1.0                                   # two rows (one per sequence)
    dec = 0.01 + 0.02 * 1 + 0.001 * 11 + 0.0001 * 11            # q=1, p=10: keys 11, pairs 11
    pre = 0.01 + 0.02 * 5 + 0.001 * 7 + 0.0001 * (5 * 2 + 15)    # q=5, p=2: keys 7, pairs 10 + 15
    over = 0.3 + 0.05 * 6 + 0.02 * 2
    assert got == pytest.approx(lin + head + 3 * (dec + pre) + over, rel=1e-12)
    # head on every row instead: head(6) = 1.0 + 0.5 * 4 = 3.0
    assert hand_model("all").predict_step_ms([10], [(5, 2)]) == pytest.approx(lin + 3.0 + 3 * (dec + pre) + over)
    assert m.predict_step_ms() == 0.0
    # a term per key of the longest decode (a kernel that does not split a sequence's keys): 2 decodes of 10 and
    # 40 add 40 of them, a prefill piece none
    lk = m.with_overhead(Overhead(0.3, 0.05, 0.02, per_longest_key_ms=0.002))
    assert lk.predict_step_ms([10, 40], [(5, 2)]) - m.predict_step_ms([10, 40], [(5, 2)]) == pytest.approx(0.002 * 40)
    assert lk.predict_step_ms([], [(5, 2)]) == m.predict_step_ms([], [(5, 2)])
    assert lk.decodes_attention_ms(2, 50, 40) == lk.decode_attention_ms([10, 40])


def test_piece_terms_match_the_prediction():
    m = hand_model()
    base_attn = m.decode_attention_ms([10, 40])
    base, k1, k2, per_m = m.piece_terms(2, 2, base_attn, 7)
    for c in (1, 3, 17, 100):
        assert base + k1 * c + k2 * c * c + per_m(2 + c) == pytest.approx(m.predict_step_ms([10, 40], [(c, 7)]))


def test_prediction_rejects_bad_pieces():
    m = hand_model()
    with pytest.raises(ValueError, match=r"decode_contexts\[1\]"):
        m.predict_step_ms([3, -1])
    with pytest.raises(ValueError, match=r"prefill_chunks\[0\]"):
        m.predict_step_ms([], [(0, 3)])


def test_model_round_trips_through_a_dict():
    m = hand_model()
    assert LatencyModel.from_dict(m.to_dict()) == m
    lk = m.with_overhead(Overhead(0.3, 0.05, 0.02, 0.002))
    assert LatencyModel.from_dict(lk.to_dict()) == lk
    old = m.to_dict()  # a model saved before the longest-decode term: the term is 0
    del old["overhead"]["per_longest_key_ms"]
    assert LatencyModel.from_dict(old) == m
    with pytest.raises(ValueError, match="malformed"):
        LatencyModel.from_dict({"linears": []})


def test_attention_fit_recovers_the_coefficients():
    true = AttentionCost(0.05, 0.001, 0.0002, 3e-6)
    pts = [(q, p, true(q, p)) for q in (1, 8, 64, 256) for p in (0, 100, 1000)]
    got = AttentionCost.fit(pts)
    for q, p, ms in pts:
        assert got(q, p) == pytest.approx(ms, rel=1e-6)
    # a negative trend is not followed (coefficients stay >= 0, the model stays monotone)
    neg = AttentionCost.fit([(1, 0, 1.0), (1, 100, 0.5), (1, 1000, 0.1)])
    assert min(neg.to_dict().values()) >= 0


def test_token_padding_runs_the_linears_and_per_token_overhead_on_the_padded_rows():
    """An engine that pads a step's tokens to a multiple of 64 runs its linears at the padded M: a step of
    65 tokens costs what one of 128 costs, less the attention of the rows that are padding."""
    m = hand_model()
    p = m.with_token_pad(64)
    assert p.padded(1) == 64 and p.padded(64) == 64 and p.padded(65) == 128 and m.padded(65) == 65
    dec = [10] * 65
    assert p.predict_step_ms(dec) == pytest.approx(
        m.step_ms(128, 65, m.decode_attention_ms(dec)))
    assert p.predict_step_ms([10] * 128) == pytest.approx(m.predict_step_ms([10] * 128))
    assert p.predict_step_ms(dec) > m.predict_step_ms(dec)
    assert LatencyModel.from_dict(p.to_dict()) == p
    assert LatencyModel.from_dict({k: v for k, v in m.to_dict().items() if k != "token_pad"}).token_pad == 1
    with pytest.raises(ValueError, match="token_pad"):
        m.with_token_pad(0)
