"""mha.decode_attention against a NumPy float64 reference written here from the keys and values the test
appended (not from the cache): hypothesis draws the heads (grouped-query: num_heads a multiple of
num_kv_heads), widths, page sizes, ragged sequence lengths, q_len, and forks at any position followed by
different appends to parent and child. float64 caches agree to 1e-10 relative; float32 within twice a
NumPy float32 reference's error (plus 1e-6); bfloat16 within twice the error of the exact result rounded
to bfloat16 (plus 2^-14 of the result's scale). Then: bitwise the same for 1 and 2 threads, and every
refused call raises mha.Error naming the cause."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mha
from mha_reference import round_to_bfloat16


def reference(q, keys, values, scale=None, dtype=np.float64, causal=True, window=None, alibi=None, softcap=0.0,
              sinks=None):
    """q [n, q_len, h, d_k]; keys[s] [T, h_kv, d_k], values[s] [T, h_kv, d_v]: query i of sequence s, at
    position i' = T - q_len + i, sees positions <= i' (causal; else all T), within [i' - left, i' + right]
    for a window (-1: unbounded); logits softcap tanh(x / softcap), then - slope |i' - t|; query head i
    reads kv head i // (h // h_kv); a sink [h] is one more logit of the row with no value."""
    n, q_len, h, d_k = q.shape
    h_kv, d_v = keys[0].shape[1], values[0].shape[2]
    scale = 1.0 / np.sqrt(d_k) if scale is None else scale
    left, right = window if window is not None else (-1, -1)
    out = np.zeros((n, q_len, h, d_v), dtype)
    for s in range(n):
        k, v = keys[s].astype(dtype), values[s].astype(dtype)
        T = k.shape[0]
        for i in range(q_len):
            position = T - q_len + i
            t = np.arange(T)
            seen = (t <= position) if causal else np.ones(T, bool)
            if left >= 0:
                seen &= t >= position - left
            if right >= 0:
                seen &= t <= position + right
            for head in range(h):
                kv = head // (h // h_kv)
                logits = (k[seen, kv] @ q[s, i, head].astype(dtype)) * dtype(scale)
                if softcap > 0:
                    logits = dtype(softcap) * np.tanh(logits / dtype(softcap))
                if alibi is not None:
                    logits = logits - dtype(alibi[head]) * np.abs(position - t[seen]).astype(dtype)
                if sinks is not None:
                    logits = np.append(logits, dtype(sinks[head]))
                p = np.exp(logits - logits.max())
                values_seen = v[seen, kv]
                out[s, i, head] = (p[:len(values_seen)] @ values_seen) / p.sum()
    return out


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b))) if a.size else 0.0


def check(got, q, keys, values, dtype, scale=None, **score):
    ref64 = reference(q, keys, values, scale, **score)
    if dtype == "float64":
        assert max_err(got, ref64) <= 1e-10 * max(1.0, np.abs(ref64).max())
    elif dtype == "float32":
        ref32 = reference(q, keys, values, scale, np.float32, **score)
        assert max_err(got, ref64) <= 2 * max_err(ref32, ref64) + 1e-6
    else:
        slack = 2.0 ** -14 * np.abs(ref64).max() + 1e-6
        assert max_err(got, ref64) <= 2 * max_err(round_to_bfloat16(ref64.astype(np.float32)), ref64) + slack


@st.composite
def batches(draw):
    h_kv = draw(st.sampled_from([1, 2, 3]))
    h = h_kv * draw(st.sampled_from([1, 2, 4]))
    d_k, d_v = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    page_size = draw(st.sampled_from([1, 2, 3, 5, 16, 64]))
    lengths = draw(st.lists(st.integers(1, 150), min_size=1, max_size=5))
    q_len = draw(st.integers(1, min(min(lengths), 5)))
    fork = draw(st.none() | st.tuples(st.integers(0, len(lengths) - 1), st.integers(0, 20), st.integers(0, 20)))
    dtype = draw(st.sampled_from(["float32", "float64", "bfloat16"]))
    seed = draw(st.integers(0, 2 ** 31))
    return h, h_kv, d_k, d_v, page_size, lengths, q_len, fork, dtype, seed


@settings(max_examples=60, deadline=None)
@given(batches())
def test_decode_matches_a_float64_reference(batch):
    h, h_kv, d_k, d_v, page_size, lengths, q_len, fork, dtype, seed = batch
    rng = np.random.default_rng(seed)
    np_dtype = np.float64 if dtype == "float64" else np.float32
    stored = round_to_bfloat16 if dtype == "bfloat16" else (lambda a: a)
    cache = mha.PagedKVCache(h_kv, d_k, value_dim=d_v, page_size=page_size,
                             capacity_tokens=sum(lengths) + 64 + 4 * page_size, dtype=dtype)
    ids, keys, values = [], [], []

    def append(s, n):
        k = rng.uniform(-2, 2, (n, h_kv, d_k)).astype(np_dtype)
        v = rng.uniform(-1, 1, (n, h_kv, d_v)).astype(np_dtype)
        cache.append(ids[s], k, v)
        keys[s] = np.concatenate([keys[s], stored(k)])
        values[s] = np.concatenate([values[s], stored(v)])

    for T in lengths:
        ids.append(cache.add_sequence())
        keys.append(np.zeros((0, h_kv, d_k), np_dtype))
        values.append(np.zeros((0, h_kv, d_v), np_dtype))
        append(len(ids) - 1, T)
    if fork is not None:  # the child shares the parent's pages; then each is appended its own tokens
        parent, parent_extra, child_extra = fork
        ids.append(cache.fork(ids[parent]))
        keys.append(keys[parent].copy())
        values.append(values[parent].copy())
        append(len(ids) - 1, child_extra)
        append(parent, parent_extra)
    order = list(rng.permutation(len(ids)))
    q = stored(rng.uniform(-2, 2, (len(order), q_len, h, d_k)).astype(np_dtype))
    got = mha.decode_attention(q, cache, [ids[s] for s in order])
    assert got.shape == (len(order), q_len, h, d_v) and got.dtype == np_dtype
    check(got, q, [keys[s] for s in order], [values[s] for s in order], dtype)


@settings(max_examples=60, deadline=None)
@given(batch=batches(), variants=st.fixed_dictionaries({
    "causal": st.booleans(),
    "window": st.none() | st.tuples(st.integers(-1, 40), st.integers(-1, 6)),
    "alibi": st.none() | st.just("slopes"),
    "softcap": st.sampled_from([0.0, 0.5, 3.0, 50.0]),
    "sinks": st.none() | st.sampled_from([0.5, 4.0])}))
def test_decode_with_every_variant_matches_a_float64_reference(batch, variants):
    """Window, ALiBi, softcap, sinks and causal or not, alone and together, over the sequences' own positions
    (issue 31's decode variants), against the reference above; chunks wholly before every window are
    skipped by the kernel, which the long sequences and small windows here exercise."""
    h, h_kv, d_k, d_v, page_size, lengths, q_len, fork, dtype, seed = batch
    rng = np.random.default_rng(seed)
    np_dtype = np.float64 if dtype == "float64" else np.float32
    stored = round_to_bfloat16 if dtype == "bfloat16" else (lambda a: a)
    cache = mha.PagedKVCache(h_kv, d_k, value_dim=d_v, page_size=page_size, capacity_tokens=(sum(lengths) + len(lengths) * page_size),
                             dtype=dtype)  # each sequence's last page may be partly filled
    ids, keys, values = [], [], []
    for T in lengths:
        ids.append(cache.add_sequence())
        keys.append(stored(rng.uniform(-2, 2, (T, h_kv, d_k)).astype(np_dtype)))
        values.append(stored(rng.uniform(-1, 1, (T, h_kv, d_v)).astype(np_dtype)))
        cache.append(ids[-1], keys[-1], values[-1])
    q = stored(rng.uniform(-2, 2, (len(ids), q_len, h, d_k)).astype(np_dtype))
    window, softcap, causal = variants["window"], variants["softcap"], variants["causal"]
    if window is not None and not causal and window[1] < 0 and window[0] < 0:
        window = None
    slopes = rng.uniform(0, 0.5, h).astype(np.float32) if variants["alibi"] else None
    if window is not None and not causal:  # every query must see at least one position: its own
        window = (max(window[0], 0), max(window[1], 0))
    sinks = None if variants["sinks"] is None else (rng.standard_normal(h) * variants["sinks"]).astype(np.float32)
    got = mha.decode_attention(q, cache, ids, is_causal=causal, window=window, alibi_slopes=slopes, softcap=softcap,
                               sinks=sinks)
    check(got, q, keys, values, dtype, causal=causal, window=window, alibi=slopes, softcap=softcap, sinks=sinks)


def test_decode_variants_are_bitwise_the_same_for_one_and_two_threads_and_refuse_masks():
    cache, ids, rng = small_cache()
    q = rng.standard_normal((3, 2, 4, 8)).astype(np.float32)
    options = dict(window=(7, 0), alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], np.float32), softcap=5.0,
                   sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32))
    saved = mha.num_threads()
    try:
        mha.set_num_threads(1)
        one = mha.decode_attention(q, cache, ids, **options)
        mha.set_num_threads(2)
        two = mha.decode_attention(q, cache, ids, **options)
    finally:
        mha.set_num_threads(saved)
    assert np.array_equal(one, two)
    with pytest.raises(mha.Error, match=r"alibi_slopes: expected one slope per query head"):
        mha.decode_attention(q, cache, ids, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(mha.Error, match=r"decode_attention: window: expected extents >= 0, or -1"):
        mha.decode_attention(q, cache, ids, window=(-2, 0))
    with pytest.raises(mha.Error, match=r"decode_attention: softcap"):
        mha.decode_attention(q, cache, ids, softcap=1e39)
    with pytest.raises(mha.Error, match=r"decode_attention: sinks: expected one logit per query head"):
        mha.decode_attention(q, cache, ids, sinks=np.ones(3, np.float32))


def small_cache(dtype="float32", page_size=4):
    rng = np.random.default_rng(1)
    cache = mha.PagedKVCache(2, 8, value_dim=6, page_size=page_size, capacity_tokens=3000, dtype=dtype)
    ids = [cache.add_sequence() for _ in range(3)]
    for s, T in zip(ids, [1500, 3, 40]):
        cache.append(s, rng.standard_normal((T, 2, 8)).astype(np.float32), rng.standard_normal((T, 2, 6)).astype(np.float32))
    return cache, ids, rng


def test_scale_lse_and_bfloat16_bits():
    cache, ids, rng = small_cache()
    q = rng.standard_normal((3, 2, 4, 8)).astype(np.float32)
    keys = [cache.keys(s).transpose(1, 0, 2) for s in ids]
    values = [cache.values(s).transpose(1, 0, 2) for s in ids]
    out, lse = mha.decode_attention(q, cache, ids, scale=0.3, need_lse=True)
    check(out, q, keys, values, "float32", scale=0.3)
    assert lse.shape == (3, 2, 4) and lse.dtype == np.float32 and np.all(np.isfinite(lse))
    # A bfloat16 cache takes float32 q (rounded) or BFloat16Bits, and answers in the same form.
    bf, bf_ids, _ = small_cache("bfloat16")
    from_float = mha.decode_attention(q, bf, bf_ids)
    from_bits = mha.decode_attention(mha.to_bfloat16(q), bf, bf_ids)
    assert isinstance(from_bits, mha.BFloat16Bits)
    np.testing.assert_array_equal(mha.from_bfloat16(from_bits), from_float)


def test_bitwise_the_same_for_one_and_two_threads():
    cache, ids, rng = small_cache()
    q = rng.standard_normal((3, 3, 4, 8)).astype(np.float32)
    saved = mha.num_threads()
    try:
        mha.set_num_threads(1)
        one = mha.decode_attention(q, cache, ids)
        mha.set_num_threads(2)
        two = mha.decode_attention(q, cache, ids)
    finally:
        mha.set_num_threads(saved)
    assert one.tobytes() == two.tobytes()


@pytest.mark.parametrize("q_shape, sequences, says", [
    ((3, 1, 4, 8), [0, 1, 7], "sequences[2]: sequence 7 is not in the cache"),
    ((3, 1, 4, 8), [0, 1], "sequences: expected one id per row of q (3), got 2"),
    ((3, 1, 3, 8), [0, 1, 2], "num_heads 3 must be a positive multiple of the cache's num_kv_heads 2"),
    ((3, 1, 4, 7), [0, 1, 2], "head_dim = the cache's 8"),
    ((3, 4, 4, 8), [0, 1, 2], "sequence 1 holds 3 positions, fewer than q_len 4"),
    ((3, 0, 4, 8), [0, 1, 2], "q_len >= 1"),
    ((0, 1, 4, 8), [], "n >= 1"),
    ((3, 4, 8), [0, 1, 2], "q: expected [n, q_len, num_heads, head_dim]"),
])
def test_refused_calls_name_the_cause(q_shape, sequences, says):
    cache, ids, _ = small_cache()
    with pytest.raises(mha.Error, match=__import__("re").escape(says)):
        mha.decode_attention(np.zeros(q_shape, np.float32), cache, sequences)


def test_released_sequences_and_wrong_dtypes_are_refused():
    cache, ids, _ = small_cache()
    cache.release(ids[1])
    with pytest.raises(mha.Error, match="sequence 1 is not in the cache"):
        mha.decode_attention(np.zeros((1, 1, 4, 8), np.float32), cache, [ids[1]])
    with pytest.raises(mha.Error, match="expected the cache's dtype float32, got float64"):
        mha.decode_attention(np.zeros((1, 1, 4, 8)), cache, [ids[0]])
    with pytest.raises(ValueError):  # mha.Error is a ValueError
        mha.decode_attention(np.zeros((1, 1, 4, 8), np.int32), cache, [ids[0]])
