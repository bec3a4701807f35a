"""The split-KV decode attention (``lowering/split_kv_decode.py``) against ``decode_attention_ref``, and the
engine's composition of it with the varlen kernel (``runtime.attention.varlen_attention``) against the
per-sequence reference. On CPU under ``TRITON_INTERPRET=1``; on a GPU the compiled kernels."""
import pytest
import torch

from spear_compile.lowering._triton import HAS_TRITON
from spear_compile.ops.attention_ref import decode_attention_ref

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is a test dependency; install .[test]")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _step(q_lens, k_lens, H, Hkv, D, dtype, pad_q=0, pad_k=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(q_lens) + pad_q, sum(k_lens) + pad_k
    q = torch.randn(Tq, H, D, generator=g).to(DEV, dtype)
    k = torch.randn(Tk, Hkv, D, generator=g).to(DEV, dtype)
    v = torch.randn(Tk, Hkv, D, generator=g).to(DEV, dtype)
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    return q, k, v, cu(q_lens), cu(k_lens)


def _one_query_rows(cu_q):
    c = cu_q.tolist()
    return [a for a, b in zip(c, c[1:]) if b - a == 1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_lens,k_lens,H,Hkv,D", [
    ([1], [300], 2, 2, 64),                      # one long decode: several slices
    ([1, 1, 1], [5, 1, 97], 4, 2, 32),           # GQA, a decode of one key, uneven slices
    ([1, 7, 1, 0], [40, 60, 129, 0], 2, 1, 16),  # a prefill piece between decodes, a padded empty sequence
    ([3, 1], [3, 513], 1, 1, 48),                # head dim not a power of two
])
def test_split_kv_decode_matches_reference(dtype, q_lens, k_lens, H, Hkv, D):
    from spear_compile.lowering.split_kv_decode import split_kv_decode_

    q, k, v, cu_q, cu_k = _step(q_lens, k_lens, H, Hkv, D, dtype, pad_q=2, pad_k=3)
    sentinel = torch.full_like(q, 7.0)
    out = split_kv_decode_(sentinel.clone(), q, k, v, cu_q, cu_k, max(k_lens), scale=0.3)
    ref = decode_attention_ref(q, k, v, cu_q, cu_k, scale=0.3)
    rows = _one_query_rows(cu_q)
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=2e-2, rtol=2e-2)
    others = [r for r in range(q.shape[0]) if r not in rows]
    assert torch.equal(out[others], sentinel[others]), "rows of other sequences must be left as they were"


def test_splits_cover_long_sequences_and_stay_bounded():
    from spear_compile.lowering.split_kv_decode import MAX_SPLITS, MIN_KEYS_PER_SPLIT, splits_for

    assert splits_for(2, MIN_KEYS_PER_SPLIT, DEV) == 1
    assert splits_for(2, 10 * MIN_KEYS_PER_SPLIT, DEV) > 1
    assert splits_for(1, 10 ** 9, DEV) <= MAX_SPLITS


def test_a_long_decode_among_transformers_padding_sequences_is_split_and_exact():
    """Under CUDA graphs transformers pads a step to 64 sequences (zero queries, zero keys): the one real
    decode still gets its keys split (the split does not count sequences) and the padding stores nothing."""
    from spear_compile.lowering.split_kv_decode import splits_for, split_kv_decode_

    H, n_keys = 2, 300
    assert splits_for(H, n_keys, DEV) > 1
    q, k, v, cu_q, cu_k = _step([1] + [0] * 63, [n_keys] + [0] * 63, H, 1, 32, torch.bfloat16, pad_q=63, pad_k=5)
    sentinel = torch.full_like(q, 3.0)
    out = split_kv_decode_(sentinel.clone(), q, k, v, cu_q, cu_k, max_k=1024)
    ref = decode_attention_ref(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(out[:1].float(), ref[:1].float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(out[1:], sentinel[1:])


@pytest.mark.parametrize("q_lens,to_varlen,to_split", [
    ([1, 1, 4, 1], [0, 1, 2, 6, 7], [0, 0, 0, 0, 0]),  # a prefill piece: every sequence to the varlen kernel
    ([5, 1, 0], [0, 5, 6, 6], [0, 0, 0, 0]),
    ([1, 1, 0, 0], [2, 2, 2, 2, 2], [0, 1, 2, 2, 2]),  # decodes and padding only: every decode to the split
    ([0, 0], [0, 0, 0], [0, 0, 0]),                    # nothing
])
def test_route_rows(q_lens, to_varlen, to_split):
    from spear_compile.lowering.split_kv_decode import route_rows

    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    routes = route_rows(cu)
    assert routes.dtype == torch.int32 and routes.shape == (2, len(q_lens) + 1)
    assert routes[0].tolist() == to_varlen and routes[1].tolist() == to_split
    with pytest.raises(ValueError, match="int32"):
        route_rows(cu.long())
    with pytest.raises(ValueError, match="contiguous"):
        route_rows(torch.zeros(2 * len(cu), dtype=torch.int32, device=DEV)[::2])


def test_bad_inputs_are_named():
    from spear_compile.lowering.split_kv_decode import split_kv_decode_

    q, k, v, cu_q, cu_k = _step([1], [8], 3, 2, 16, torch.float16)
    with pytest.raises(ValueError, match="not a multiple"):
        split_kv_decode_(torch.empty_like(q), q, k, v, cu_q, cu_k, 8)
    q, k, v, cu_q, cu_k = _step([1], [8], 2, 2, 16, torch.float16)
    with pytest.raises(ValueError, match="int32"):
        split_kv_decode_(torch.empty_like(q), q, k, v, cu_q.long(), cu_k, 8)


@pytest.mark.parametrize("q_lens,k_lens", [
    ([1, 1, 6, 1], [40, 300, 90, 7]),  # decodes around a prefill piece: the varlen kernel takes the whole step
    ([1, 1, 1], [3, 200, 64]),         # decodes only, max_q 1: the varlen kernel is not called
    ([1, 1, 0, 0], [3, 200, 0, 0]),    # decodes and padding under a padded max_q: the varlen kernel gets nothing
    ([4, 3], [4, 20]),                 # no decode
])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_engine_composition_equals_the_per_sequence_reference(q_lens, k_lens, overlap):
    """``runtime.attention.decodes_split``: a step with a prefill piece all to the varlen kernel (here
    ``varlen_reference``, as it runs on CPU), a step of decodes only all to the split-KV kernel; either way
    equal to the reference over the whole step (padding rows excluded). ``overlap`` puts the split's first
    launch on a side stream on CUDA (on CPU both run in order)."""
    from spear_compile.runtime.attention import decodes_split, varlen_reference

    q, k, v, cu_q, cu_k = _step(q_lens, k_lens, 4, 2, 32, torch.bfloat16, pad_q=0, pad_k=5)
    calls = []

    def varlen(q_, k_, v_, cu_q_, cu_k_, max_q, max_k, scale):
        calls.append(cu_q_.tolist())
        return varlen_reference(q_, k_, v_, cu_q_, cu_k_, scale)

    max_q = 64 if q_lens == [1, 1, 0, 0] else max(q_lens)  # (transformers' padded token count)
    out = decodes_split(varlen, q, k, v, cu_q, cu_k, max_q, max(k_lens), 0.25, overlap=overlap)
    ref = varlen_reference(q, k, v, cu_q, cu_k, 0.25)
    n = int(cu_q[-1])
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=2e-2, rtol=2e-2)
    if max_q == 1:
        assert calls == []
    elif max(q_lens) == 1:
        assert calls == [[n] * (len(q_lens) + 1)], calls  # every sequence empty
    else:
        assert calls == [cu_q.tolist()], calls


def test_the_two_launches_apart_equal_the_one_call_and_check_their_partials():
    """``split_kv_partials`` then ``combine_`` (the overlapped path's two halves) write what
    ``split_kv_decode_`` writes, leave the other rows alone, and a partials set of another step is refused."""
    from spear_compile.lowering.split_kv_decode import combine_, split_kv_decode_, split_kv_partials

    q, k, v, cu_q, cu_k = _step([1, 5, 1], [90, 20, 33], 4, 2, 32, torch.float16)
    sentinel = torch.full_like(q, 7.0)
    one = split_kv_decode_(sentinel.clone(), q, k, v, cu_q, cu_k, 90)
    parts = split_kv_partials(q, k, v, cu_q, cu_k, 90)
    two = combine_(sentinel.clone(), cu_q, parts)
    assert torch.equal(one, two)
    assert torch.equal(two[1:6], sentinel[1:6]), "the prefill piece's rows are not written"
    assert split_kv_partials(q, k, v, cu_q[:1], cu_k[:1], 90) is None, "a step of no sequence launches nothing"
    with pytest.raises(ValueError, match="partials of 3 sequences"):
        combine_(sentinel.clone(), cu_q[:3], parts)


def test_a_max_k_below_the_longest_sequence_still_attends_every_key():
    """A CUDA graph replays the grid of its capture, sized by that step's max_k: a later step's longer
    sequence must still be attended whole (the last slice takes the rest)."""
    from spear_compile.lowering.split_kv_decode import split_kv_decode_

    q, k, v, cu_q, cu_k = _step([1, 1], [40, 400], 2, 2, 32, torch.bfloat16)
    out = split_kv_decode_(torch.zeros_like(q), q, k, v, cu_q, cu_k, max_k=64)
    ref = decode_attention_ref(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_the_first_layer_remakes_the_step_routes_and_the_others_reuse_them():
    """``runtime.attention._routes``: one launch per forward, made by layer 0 (every forward and every
    CUDA-graph capture starts there, so no graph reads a tensor another graph made)."""
    from types import SimpleNamespace

    from spear_compile.runtime import attention as A

    layer = [SimpleNamespace(layer_idx=i) for i in range(3)]
    cu = torch.tensor([0, 1, 2, 6], dtype=torch.int32, device=DEV)
    first = A._routes(layer[0], cu)
    assert first.tolist() == [[0, 1, 2, 6], [0, 0, 0, 0]]
    assert A._routes(layer[1], cu) is first and A._routes(layer[2], cu) is first
    again = A._routes(layer[0], cu)
    assert again is not first and A._routes(layer[1], cu) is again, "a new forward remakes it at layer 0"
    other = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
    assert A._routes(layer[1], other).tolist() == [[2, 2, 2], [0, 1, 2]], "another step's lengths are never reused"
