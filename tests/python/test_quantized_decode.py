"""decode_attention over int8 and float8 e4m3 caches (issue 33): the result is attention over the dequantized
cache, keys(seq) / values(seq), computed by the float64 reference of test_decode_attention.py, within the
float32 rule (twice a NumPy float32 computation's error, plus 1e-6), for page sizes 1..256, ragged
sequences, forks inside a page, grouped heads and every variant of the score; bitwise the same for one
and two threads; float32 and bfloat16 queries.

Legend: n sequences, q_len new queries, h query heads, h_kv key/value heads, d_k, d_v, P page size.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mha
from mha_reference import round_to_bfloat16
from test_decode_attention import max_err, reference

STORAGES = ["int8", "float8_e4m3"]


def dequantized(cache, ids):
    """Each sequence's keys [T, h_kv, d_k] and values [T, h_kv, d_v] as decode reads them."""
    return ([cache.keys(s).transpose(1, 0, 2) for s in ids], [cache.values(s).transpose(1, 0, 2) for s in ids])


def check(got, q, keys, values, **score):
    ref64 = reference(q, keys, values, **score)
    ref32 = reference(q, keys, values, dtype=np.float32, **score)
    assert got.dtype == np.float32 and got.shape == ref64.shape
    err, bound = max_err(got, ref64), 2 * max_err(ref32, ref64) + 1e-6
    assert err <= bound, f"max|ours - fp64| = {err:.3g} > {bound:.3g}"


@st.composite
def batches(draw):
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2, 4]))
    lengths = draw(st.lists(st.integers(1, 160), min_size=1, max_size=4))
    return dict(h=h, h_kv=h_kv, d_k=draw(st.sampled_from([3, 16, 64])), d_v=draw(st.sampled_from([5, 16, 64])),
                page_size=draw(st.sampled_from([1, 2, 5, 16, 64, 256])), lengths=lengths,
                q_len=draw(st.integers(1, min(min(lengths), 3))), storage=draw(st.sampled_from(STORAGES)),
                fork=draw(st.none() | st.tuples(st.integers(0, len(lengths) - 1), st.integers(0, 9), st.integers(0, 9))),
                seed=draw(st.integers(0, 2**31)))


@settings(max_examples=60, deadline=None)
@given(b=batches(), variants=st.fixed_dictionaries({
    "causal": st.booleans(), "window": st.none() | st.tuples(st.integers(0, 30), st.integers(0, 4)),
    "alibi": st.booleans(), "softcap": st.sampled_from([0.0, 2.0]), "sinks": st.booleans()}))
def test_decode_over_a_quantized_cache_is_attention_over_its_dequantized_rows(b, variants):
    rng = np.random.default_rng(b["seed"])
    h, h_kv, d_k, d_v = b["h"], b["h_kv"], b["d_k"], b["d_v"]
    cache = mha.PagedKVCache(h_kv, d_k, value_dim=d_v, page_size=b["page_size"],
                             capacity_tokens=sum(b["lengths"]) + 40 + 8 * b["page_size"], dtype=b["storage"])
    ids = []
    for T in b["lengths"]:
        ids.append(cache.add_sequence())
        cache.append(ids[-1], rng.uniform(-2, 2, (T, h_kv, d_k)).astype(np.float32),
                     rng.uniform(-1, 1, (T, h_kv, d_v)).astype(np.float32))
    if b["fork"] is not None:  # the child shares the parent's pages; then each gets its own tokens
        parent, parent_extra, child_extra = b["fork"]
        ids.append(cache.fork(ids[parent]))
        for s, n in ((ids[-1], child_extra), (ids[parent], parent_extra)):
            cache.append(s, rng.normal(size=(n, h_kv, d_k)).astype(np.float32),
                         rng.normal(size=(n, h_kv, d_v)).astype(np.float32))
    q = rng.uniform(-2, 2, (len(ids), b["q_len"], h, d_k)).astype(np.float32)
    slopes = rng.uniform(0, 0.3, h).astype(np.float32) if variants["alibi"] else None
    sinks = rng.normal(size=h).astype(np.float32) if variants["sinks"] else None
    score = dict(causal=variants["causal"], window=variants["window"], alibi=slopes, softcap=variants["softcap"],
                 sinks=sinks)
    got = mha.decode_attention(q, cache, ids, is_causal=score["causal"], window=score["window"], alibi_slopes=slopes,
                               softcap=score["softcap"], sinks=sinks)
    keys, values = dequantized(cache, ids)
    check(got, q, keys, values, **score)


@pytest.mark.parametrize("storage", STORAGES)
def test_quantized_decode_is_bitwise_the_same_for_one_and_two_threads_and_takes_bfloat16_queries(storage):
    rng = np.random.default_rng(3)
    cache = mha.PagedKVCache(2, 64, page_size=16, capacity_tokens=5000, dtype=storage)
    ids = [cache.add_sequence() for _ in range(3)]
    for s, T in zip(ids, [3000, 5, 700]):
        cache.append(s, rng.normal(size=(T, 2, 64)).astype(np.float32), rng.normal(size=(T, 2, 64)).astype(np.float32))
    q = rng.normal(size=(3, 1, 8, 64)).astype(np.float32)
    saved = mha.num_threads()
    try:
        mha.set_num_threads(1)
        one = mha.decode_attention(q, cache, ids)
        mha.set_num_threads(2)
        two = mha.decode_attention(q, cache, ids)
    finally:
        mha.set_num_threads(saved)
    np.testing.assert_array_equal(one, two)
    keys, values = dequantized(cache, ids)
    check(one, q, keys, values)
    bf16 = mha.decode_attention(mha.to_bfloat16(q), cache, ids)  # widened exactly: as the rounded float32 q
    np.testing.assert_array_equal(mha.from_bfloat16(bf16) if isinstance(bf16, mha.BFloat16Bits) else bf16,
                                  mha.decode_attention(round_to_bfloat16(q), cache, ids))


@pytest.mark.parametrize("storage", STORAGES)
def test_a_nan_row_reaches_only_the_queries_that_weigh_it(storage):
    rng = np.random.default_rng(4)
    cache = mha.PagedKVCache(1, 8, page_size=4, capacity_tokens=64, dtype=storage)
    a, b = cache.add_sequence(), cache.add_sequence()
    keys = rng.normal(size=(10, 1, 8)).astype(np.float32)
    values = rng.normal(size=(10, 1, 8)).astype(np.float32)
    values[6, 0, 3] = np.nan
    cache.append(a, keys, values)
    cache.append(b, keys[:5], values[:5])
    q = rng.normal(size=(2, 1, 2, 8)).astype(np.float32)
    out = mha.decode_attention(q, cache, [a, b], window=(2, 0))  # a's last query sees 7..9: not the NaN row
    assert np.all(np.isfinite(out))
    out = mha.decode_attention(q, cache, [a, b])  # now it does: a's rows NaN, b's untouched
    assert np.all(np.isnan(out[0])) and np.all(np.isfinite(out[1]))
