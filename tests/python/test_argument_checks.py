"""Arguments of the Python API that used to give a confusing error or a crash (issue 10): key_lengths as a
NumPy array, and set_num_threads beyond any useful count; and the scope set_num_threads has. Then
(issue 30) the numbers a logit is formed with (scale, softcap, alibi_slopes), refused outside the range
of the dtype the logits are computed in rather than turned into NaN or silently into "no softcap"; and
keyword arguments of the wrong type or out of the 64-bit range, refused as mha.Error naming them rather
than as pybind11's TypeError."""
import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mha

B, h, L, S, E, d = 2, 2, 3, 4, 8, 4


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, h, L, d)).astype(np.float32)
    k = rng.standard_normal((B, h, S, d)).astype(np.float32)
    v = rng.standard_normal((B, h, S, d)).astype(np.float32)
    return q, k, v


# ---- key_lengths: any sequence or 1-D integer array ----------------------------------------------

LENGTHS_AS = {
    "list": [2, 3],
    "tuple": (2, 3),
    "int64 array": np.array([2, 3]),
    "int32 array": np.array([2, 3], np.int32),
    "uint8 array": np.array([2, 3], np.uint8),
    "list of numpy ints": [np.int64(2), np.int32(3)],
}


@pytest.mark.parametrize("lengths", LENGTHS_AS.values(), ids=LENGTHS_AS.keys())
def test_key_lengths_take_any_integer_sequence(lengths):
    q, k, v = _inputs()
    expected = mha.scaled_dot_product_attention(q, k, v, key_lengths=[2, 3])
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, key_lengths=lengths), expected)
    dout = np.ones_like(expected)
    out, lse = mha.scaled_dot_product_attention(q, k, v, key_lengths=lengths, need_lse=True)
    grads = mha.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, key_lengths=lengths)
    for a, b in zip(grads, mha.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, key_lengths=[2, 3])):
        np.testing.assert_array_equal(a, b)

    layer = mha.MultiheadAttention(E, h, batch_first=True, seed=1).eval()
    x = np.random.default_rng(2).standard_normal((B, S, E)).astype(np.float32)
    for a, b in zip(layer(x, x, x, key_lengths=lengths), layer(x, x, x, key_lengths=[2, 3])):
        np.testing.assert_array_equal(a, b)
    cache = mha.KeyValueCache()
    layer.append_to_cache(cache, x, x)
    for a, b in zip(layer.forward_cached(x[:, -1:], cache, key_lengths=lengths),
                    layer.forward_cached(x[:, -1:], cache, key_lengths=[2, 3])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("lengths", [np.array([2.0, 3.0]), [2.5, 3], np.array([True, False]), np.array([[2, 3]]),
                                     np.int64(2), "23", [2, None], np.array([2**64 - 1, 3], np.uint64)],
                         ids=["float array", "float list", "bool array", "2-D", "scalar", "str", "None inside",
                              "uint64 beyond int64"])
def test_key_lengths_that_are_not_integer_sequences_are_refused_by_name(lengths):
    q, k, v = _inputs()
    with pytest.raises(mha.Error, match="^key_lengths"):
        mha.scaled_dot_product_attention(q, k, v, key_lengths=lengths)
    layer = mha.MultiheadAttention(E, h, batch_first=True, seed=1).eval()
    x = np.zeros((B, S, E), np.float32)
    with pytest.raises(mha.Error, match="^key_lengths"):
        layer(x, x, x, key_lengths=lengths)


def test_empty_key_lengths_mean_none():
    q, k, v = _inputs()
    expected = mha.scaled_dot_product_attention(q, k, v)
    for empty in (None, [], (), np.array([], np.int64), np.array([])):
        np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, key_lengths=empty), expected)


# ---- set_num_threads: bounded, and the calling thread's ------------------------------------------

@pytest.fixture
def restore_threads():
    saved = mha.num_threads()
    yield
    mha.set_num_threads(saved)


def test_set_num_threads_refuses_counts_beyond_the_bound(restore_threads):
    bound = mha.max_num_threads()
    assert bound >= 64
    before = mha.num_threads()
    for n in (bound + 1, 100000, 2**31 - 1):
        with pytest.raises(mha.Error, match=rf"threads: {n} .*at most {bound}"):
            mha.set_num_threads(n)
        assert mha.num_threads() == before
    mha.set_num_threads(bound)
    assert mha.num_threads() == bound
    for n in (2**40, 2**63 - 1):  # beyond C int: refused by name too (it used to be pybind11's TypeError)
        with pytest.raises(mha.Error, match=rf"threads: {n} .*at most {bound}"):
            mha.set_num_threads(n)
    for bad in (-2**40, 2**63, 1.5, "4", None):
        with pytest.raises(mha.Error, match="^threads"):
            mha.set_num_threads(bad)
    assert mha.num_threads() == bound


def test_set_num_threads_applies_to_the_calling_thread_only(restore_threads):
    def in_a_new_thread(action):
        seen = []
        worker = threading.Thread(target=lambda: seen.append(action()))
        worker.start()
        worker.join()
        return seen[0]

    default = in_a_new_thread(mha.num_threads)
    mha.set_num_threads(3)
    assert mha.num_threads() == 3
    assert in_a_new_thread(mha.num_threads) == default  # another thread keeps its own count

    def set_and_read():
        mha.set_num_threads(5)
        return mha.num_threads()

    assert in_a_new_thread(set_and_read) == 5
    assert mha.num_threads() == 3  # ... and setting it there leaves this thread's alone


# ---- scale, softcap, alibi_slopes: 0 or a normal number of the logit dtype (issue 30) --------------------
#
# float32 and bfloat16 inputs compute their logits in float32, float64 inputs in float64. A value that is
# not 0 or a normal finite number there is refused, naming the argument and the range: 1e39 used to
# become inf in float32 (every output NaN where the float64 answer is finite), softcap=5e-324 used to
# become 0, "none" (an error of 1.39 against the capped answer).

F32_TINY, F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
F64_TINY = float(np.finfo(np.float64).tiny)
LOGIT_DTYPES = ["float32", "bfloat16", "float64"]


def outside_the_logit_range(dtype):
    """Values that are not 0 or a normal finite number of dtype's logit dtype, either sign."""
    if dtype == "float64":
        magnitude = st.floats(min_value=5e-324, max_value=math.nextafter(F64_TINY, 0))  # subnormal
    else:
        magnitude = st.one_of(st.floats(min_value=math.nextafter(F32_MAX, math.inf), max_value=1.7e308),
                              st.floats(min_value=5e-324, max_value=math.nextafter(F32_TINY, 0)),
                              st.sampled_from([1e39, 1e300, 5e-324, 1e-40]))
    magnitude = st.one_of(magnitude, st.sampled_from([math.inf, math.nan]))
    return st.tuples(magnitude, st.booleans()).map(lambda m: -m[0] if m[1] else m[0])


def attention_inputs(dtype, seed=0, h=2, L=3, S=4, d=4):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape) for shape in ((1, h, L, d), (1, h, S, d), (1, h, S, d))]
    if dtype == "bfloat16":
        return [mha.to_bfloat16(a.astype(np.float32)) for a in arrays]
    return [a.astype(dtype) for a in arrays]


def logit_variant(argument, value, h=2):
    """Keyword arguments giving `argument` the value (alibi_slopes: one head's slope)."""
    if argument == "alibi_slopes":
        return {"alibi_slopes": np.array([0.5] + [value] * (h - 1), np.float64)}
    return {argument: value}


def refuses_naming(argument, call):
    with pytest.raises(mha.Error) as raised:
        call()
    message = str(raised.value)
    assert message.startswith(argument) or message.startswith("decode_attention: " + argument), message
    assert "normal float" in message, message  # names the range
    return message


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(LOGIT_DTYPES), argument=st.sampled_from(["scale", "softcap", "alibi_slopes"]),
       data=st.data())
def test_logit_numbers_outside_the_logit_dtype_are_refused_by_name(dtype, argument, data):
    value = data.draw(outside_the_logit_range(dtype), label="value")
    q, k, v = attention_inputs(dtype)
    variant = logit_variant(argument, value)
    refuses_naming(argument, lambda: mha.scaled_dot_product_attention(q, k, v, **variant))
    out, lse = mha.scaled_dot_product_attention(q, k, v, need_lse=True)
    refuses_naming(argument, lambda: mha.scaled_dot_product_attention_backward(out, q, k, v, out, lse, **variant))
    if argument == "scale":  # the layer has no scale argument (1 / sqrt(d_k))
        return
    layer = mha.MultiheadAttention(8, 2, batch_first=True, seed=1, dtype=dtype if dtype != "float32" else np.float32)
    x = np.random.default_rng(3).standard_normal((1, 4, 8)).astype(np.float32 if dtype != "float64" else np.float64)
    refuses_naming(argument, lambda: layer(x, x, x, **variant))
    layer.eval()
    cache = mha.KeyValueCache()
    layer.append_to_cache(cache, x, x)
    refuses_naming(argument, lambda: layer.forward_cached(x[:, -1:], cache, **variant))


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(LOGIT_DTYPES), data=st.data())
def test_decode_scale_outside_the_logit_dtype_is_refused_by_name(dtype, data):
    value = data.draw(outside_the_logit_range(dtype), label="scale")
    cache = mha.PagedKVCache(1, 4, page_size=2, capacity_tokens=8, dtype=dtype)
    s = cache.add_sequence()
    store = np.float64 if dtype == "float64" else np.float32
    cache.append(s, np.ones((3, 1, 4), store), np.ones((3, 1, 4), store))
    refuses_naming("scale", lambda: mha.decode_attention(np.ones((1, 1, 2, 4), store), cache, [s], scale=value))


def sdpa_float64(q, k, v, scale=None, softcap=0.0, alibi_slopes=None):
    """The attention of float64 copies of q, k, v, [1, h, L, d], in NumPy: the answer the refused values
    were compared with."""
    q, k, v = (np.asarray(mha.from_bfloat16(x) if isinstance(x, mha.BFloat16Bits) else x, np.float64)
               for x in (q, k, v))
    L, S = q.shape[2], k.shape[2]
    logits = (1 / math.sqrt(q.shape[-1]) if scale is None else scale) * (q @ k.transpose(0, 1, 3, 2))
    if softcap:
        logits = softcap * np.tanh(logits / softcap)
    if alibi_slopes is not None:
        distance = np.abs(np.arange(L)[:, None] + S - L - np.arange(S)[None, :])
        logits = logits - np.asarray(alibi_slopes, np.float64)[None, :, None, None] * distance
    logits = logits - logits.max(-1, keepdims=True)
    weights = np.exp(logits)
    return (weights / weights.sum(-1, keepdims=True)) @ v


# Values at the ends of the float32 range and beyond what float32 reaches in float64: accepted, and the
# result is the float64 answer (to the dtype's rounding).
ACCEPTED = [("scale", 0.0), ("scale", F32_TINY), ("scale", -1e30), ("scale", 1e30), ("softcap", F32_TINY),
            ("softcap", 1e-30), ("softcap", F32_MAX), ("alibi_slopes", F32_MAX), ("alibi_slopes", -F32_TINY),
            ("alibi_slopes", 0.0)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("argument, value", ACCEPTED, ids=[f"{a}={v:g}" for a, v in ACCEPTED])
def test_logit_numbers_at_the_ends_of_the_range_give_the_float64_answer(dtype, argument, value):
    q, k, v = attention_inputs(dtype, seed=4)
    variant = logit_variant(argument, value)
    got = mha.scaled_dot_product_attention(q, k, v, **variant)
    want = sdpa_float64(q, k, v, **variant)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-6)


def test_float64_inputs_take_scales_beyond_float32():
    q, k, v = attention_inputs("float64", seed=5)
    for variant in ({"scale": 1e39}, {"softcap": 1e300}, {"alibi_slopes": np.array([1e39, 1e300])},
                    {"scale": 1e-40}, {"softcap": 1e-300}):
        got = mha.scaled_dot_product_attention(q, k, v, **variant)
        np.testing.assert_allclose(got, sdpa_float64(q, k, v, **variant), rtol=1e-12, atol=1e-12)


def test_softcap_none_means_no_softcap_as_window_and_alibi_none_do():
    q, k, v = attention_inputs("float32", seed=6)
    plain = mha.scaled_dot_product_attention(q, k, v)
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, softcap=None), plain)
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, softcap=None, window=None,
                                                                   alibi_slopes=None), plain)
    layer = mha.MultiheadAttention(8, 2, batch_first=True, seed=1).eval()
    x = np.random.default_rng(3).standard_normal((1, 4, 8)).astype(np.float32)
    np.testing.assert_array_equal(layer(x, x, x, softcap=None)[0], layer(x, x, x)[0])


# ---- keyword arguments of the wrong type or out of range: mha.Error naming them (issue 30) -------------

# Not a real number: a str (float() would parse it), None where None means nothing, a complex, an int
# beyond float64, a list.
NOT_A_NUMBER = st.one_of(st.text(max_size=5), st.just(1j), st.integers(min_value=2**1024, max_value=2**1100),
                         st.just([0.5]), st.just(b"1"))
# Not an int64: beyond either end, a float, a str, None.
NOT_AN_INT64 = st.one_of(st.integers(min_value=2**63, max_value=2**200), st.integers(max_value=-2**63 - 1,
                         min_value=-2**200), st.floats(allow_nan=True), st.text(max_size=5), st.none())
NOT_A_UINT64 = st.one_of(st.integers(min_value=2**64, max_value=2**200), st.integers(max_value=-1, min_value=-2**80),
                         st.floats(), st.text(max_size=5), st.none())


def refused_naming(argument, call):
    with pytest.raises(mha.Error) as raised:  # not TypeError, OverflowError or pybind11's message
        call()
    assert str(raised.value).startswith(argument), str(raised.value)


def _attention_calls():
    q, k, v = attention_inputs("float32")
    out, lse = mha.scaled_dot_product_attention(q, k, v, need_lse=True)
    layer = mha.MultiheadAttention(8, 2, batch_first=True, seed=1).eval()
    x = np.zeros((1, 4, 8), np.float32)
    cache = mha.KeyValueCache()
    layer.append_to_cache(cache, x, x)
    return {
        "sdpa": lambda **kw: mha.scaled_dot_product_attention(q, k, v, **kw),
        "sdpa_backward": lambda **kw: mha.scaled_dot_product_attention_backward(out, q, k, v, out, lse, **kw),
        "layer": lambda **kw: layer(x, x, x, **kw),
        "forward_cached": lambda **kw: layer.forward_cached(x, cache, **kw),
    }


@settings(max_examples=80, deadline=None)
@given(call=st.sampled_from(["sdpa", "sdpa_backward", "layer", "forward_cached"]), data=st.data())
def test_window_and_softcap_of_the_wrong_type_or_range_are_refused_by_name(call, data):
    calls = _attention_calls()
    softcap = data.draw(NOT_A_NUMBER, label="softcap")
    refused_naming("softcap", lambda: calls[call](softcap=softcap))
    bad = data.draw(NOT_AN_INT64, label="window side")
    good = data.draw(st.integers(-1, 3), label="other side")
    window = data.draw(st.sampled_from([(bad, good), (good, bad), [bad, good]]), label="window")
    refused_naming("window", lambda: calls[call](window=window))
    shape = data.draw(st.sampled_from([5, "ab", (1, 2, 3), (1,), {"left": 1}]), label="not a pair")
    refused_naming("window", lambda: calls[call](window=shape))


@settings(max_examples=60, deadline=None)
@given(call=st.sampled_from(["sdpa", "sdpa_backward"]), data=st.data())
def test_scale_and_dropout_of_the_wrong_type_or_range_are_refused_by_name(call, data):
    calls = _attention_calls()
    refused_naming("scale", lambda: calls[call](scale=data.draw(NOT_A_NUMBER, label="scale")))
    refused_naming("dropout_p", lambda: calls[call](dropout_p=data.draw(st.one_of(NOT_A_NUMBER, st.none()),
                                                                         label="dropout_p")))
    refused_naming("dropout_seed", lambda: calls[call](dropout_seed=data.draw(NOT_A_UINT64, label="dropout_seed")))


def test_numbers_of_other_numeric_types_are_taken():
    q, k, v = attention_inputs("float32")
    want = mha.scaled_dot_product_attention(q, k, v, scale=0.5, softcap=2.0, window=(1, 0), dropout_p=0.25,
                                            dropout_seed=7)
    got = mha.scaled_dot_product_attention(q, k, v, scale=np.float32(0.5), softcap=np.float64(2),
                                           window=(np.int8(1), 0), dropout_p=np.float32(0.25),
                                           dropout_seed=np.uint64(7))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, dropout_p=0.25, dropout_seed=2**64 - 1),
                                  mha.scaled_dot_product_attention(q, k, v, dropout_p=0.25,
                                                                   dropout_seed=np.uint64(2**64 - 1)))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_layer_constructor_dropout_and_seed_of_the_wrong_type_are_refused_by_name(data):
    refused_naming("dropout", lambda: mha.MultiheadAttention(8, 2, dropout=data.draw(st.one_of(NOT_A_NUMBER, st.none()),
                                                                                      label="dropout")))
    seed = data.draw(st.one_of(st.floats(), st.text(max_size=3), st.integers(min_value=2**64, max_value=2**70),
                               st.integers(max_value=-1, min_value=-2**70)), label="seed")
    refused_naming("seed", lambda: mha.MultiheadAttention(8, 2, seed=seed))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_decode_attention_sequences_and_scale_of_the_wrong_type_are_refused_by_name(data):
    cache = mha.PagedKVCache(1, 4, page_size=2, capacity_tokens=8)
    s = cache.add_sequence()
    cache.append(s, np.ones((2, 1, 4), np.float32), np.ones((2, 1, 4), np.float32))
    q = np.ones((1, 1, 1, 4), np.float32)
    refused_naming("scale", lambda: mha.decode_attention(q, cache, [s], scale=data.draw(NOT_A_NUMBER, label="scale")))
    bad_id = data.draw(NOT_AN_INT64, label="id")
    refused_naming("sequences", lambda: mha.decode_attention(q, cache, [bad_id]))
    refused_naming("sequences", lambda: mha.decode_attention(q, cache, data.draw(st.sampled_from([None, "ab", 3, 1.5]),
                                                                                    label="sequences")))
    np.testing.assert_array_equal(mha.decode_attention(q, cache, np.array([s])), mha.decode_attention(q, cache, (s,)))


def test_caches_and_flags_of_the_wrong_type_are_refused_by_name():
    cache = mha.PagedKVCache(1, 4, page_size=2, capacity_tokens=8)
    s = cache.add_sequence()
    cache.append(s, np.ones((2, 1, 4), np.float32), np.ones((2, 1, 4), np.float32))
    q = np.ones((1, 1, 1, 4), np.float32)
    for not_a_cache in (None, "cache", mha.KeyValueCache(), np.zeros(3)):
        refused_naming("cache", lambda: mha.decode_attention(q, not_a_cache, [s]))
    refused_naming("need_lse", lambda: mha.decode_attention(q, cache, [s], need_lse=np.array([True, False])))
    out, lse = mha.decode_attention(q, cache, [s], need_lse=np.bool_(True))
    assert lse.shape == (1, 1, 1)
    layer = mha.MultiheadAttention(8, 2, batch_first=True, seed=1).eval()
    x = np.zeros((1, 2, 8), np.float32)
    for not_a_cache in (None, cache, [1, 2]):
        refused_naming("cache", lambda: layer.append_to_cache(not_a_cache, x, x))
        refused_naming("cache", lambda: layer.forward_cached(x, not_a_cache))


def test_layer_dtype_none_is_refused_not_read_as_float64():
    with pytest.raises(mha.Error, match=r'^dtype: expected numpy.float32, numpy.float64 or "bfloat16", got None'):
        mha.MultiheadAttention(8, 2, dtype=None)
