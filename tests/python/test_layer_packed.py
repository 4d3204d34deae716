"""mha.MultiheadAttention.forward(..., cu_seqlens=...): packed sequences through the layer. The truth is the
layer itself run on each sequence alone (an unbatched call per sequence, tested against references
elsewhere): the packed forward equals the per-sequence forwards, and its backward the per-sequence
backwards (input gradients row by row, parameter gradients summed over the sequences).

Legend: n sequences, L_i / S_i query / key rows of sequence i, E embed_dim.
"""
import numpy as np
import pytest

import mha

CONFIGS = [  # layer keyword arguments
    dict(),
    dict(num_kv_heads=2, sinks=True),
    dict(rotary_dim=4, sinks=True),
    dict(num_kv_heads=1, rotary_dim=2, rotary_interleaved=True, kdim=12, vdim=10),
]


def make_layer(dtype, **kwargs):
    layer = mha.MultiheadAttention(16, 4, batch_first=True, dtype=dtype, seed=11, **kwargs)
    if kwargs.get("sinks"):
        layer.sinks = np.array([0.5, -1.0, 2.0, 0.0])
    return layer


def one_by_one(layer, queries, keys, values, douts, **options):
    """(outs, input gradients per sequence, parameter gradients summed) of per-sequence calls."""
    outs, grads, summed = [], [], {}
    for x_q, x_k, x_v, dout in zip(queries, keys, values, douts):
        if len(x_q) == 0:
            outs.append(np.zeros((0, 16)))
            grads.append((np.zeros_like(x_q), np.zeros_like(x_k), np.zeros_like(x_v)))
            continue
        out, _ = layer(x_q, x_k, x_v, need_weights=False, **options)
        g = layer.backward(dout)
        outs.append(out)
        grads.append((g["query"], g["key"], g["value"]))
        for name in layer.parameter_names():
            summed[name] = summed.get(name, 0) + g[name]
    return outs, grads, summed


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("causal", [False, True])
def test_a_packed_forward_and_backward_equal_the_per_sequence_calls(config, causal):
    layer = make_layer(np.float64, **config)
    rng = np.random.default_rng(5)
    q_lengths, k_lengths = [5, 1, 0, 8, 3], [5, 1, 2, 8, 3]
    if "kdim" in config:  # cross-attention: other key lengths
        k_lengths = [7, 2, 3, 4, 1]
    kdim, vdim = config.get("kdim", 16), config.get("vdim", 16)
    queries = [rng.standard_normal((n, 16)) for n in q_lengths]
    keys = [rng.standard_normal((n, kdim)) for n in k_lengths]
    values = [rng.standard_normal((n, vdim)) for n in k_lengths]
    douts = [rng.standard_normal((n, 16)) for n in q_lengths]
    if "kdim" not in config:
        keys = values = queries  # self-attention
    cu_q, cu_k = np.cumsum([0] + q_lengths), np.cumsum([0] + k_lengths)
    packed = [np.concatenate(x) for x in (queries, keys, values, douts)]
    kwargs = dict(cu_seqlens=cu_q, cu_seqlens_k=None if "kdim" not in config else cu_k)
    out, weights = layer(*packed[:3], is_causal=causal, **kwargs)
    assert weights is None
    g = layer.backward(packed[3])
    outs, grads, summed = one_by_one(layer, queries, keys, values, douts, is_causal=causal)
    np.testing.assert_allclose(out, np.concatenate(outs), rtol=0, atol=1e-12)
    for i, name in enumerate(("query", "key", "value")):
        want = np.concatenate([gr[i] for gr in grads])
        if "kdim" not in config:  # one array in three roles: compare the sums
            got = g["query"] + g["key"] + g["value"]
            want = sum(np.concatenate([gr[j] for gr in grads]) for j in range(3))
        else:
            got = g[name]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-11)
    for name in layer.parameter_names():
        np.testing.assert_allclose(g[name], summed[name], rtol=0, atol=1e-10, err_msg=name)


def test_float32_packed_equals_per_sequence_within_rounding():
    layer = make_layer(np.float32, rotary_dim=4)
    rng = np.random.default_rng(6)
    lengths = [130, 7, 300, 1]
    xs = [rng.standard_normal((n, 16)).astype(np.float32) for n in lengths]
    out, _ = layer(np.concatenate(xs), np.concatenate(xs), np.concatenate(xs), is_causal=True,
                   cu_seqlens=np.cumsum([0] + lengths).astype(np.int32))
    want = np.concatenate([layer(x, x, x, is_causal=True)[0] for x in xs])
    assert np.abs(out - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("call,match", [
    (lambda m, x: m(x[None], x[None], x[None], cu_seqlens=[0, 4, 9]), r"cu_seqlens: packed sequences are unbatched"),
    (lambda m, x: m(x, x, x, cu_seqlens=[0, 4, 8]), r"cu_seqlens: expected prefix sums ending at the query rows = 9"),
    (lambda m, x: m(x, x, x, cu_seqlens=[1, 4, 9]), r"cu_seqlens: expected prefix sums starting at 0"),
    (lambda m, x: m(x, x, x, cu_seqlens=[0, 5, 4, 9]), r"cu_seqlens: expected non-decreasing"),
    (lambda m, x: m(x, x, x, cu_seqlens=[0, 4, 9], cu_seqlens_k=[0, 9]), r"cu_seqlens_k: expected n \+ 1 = 3"),
    (lambda m, x: m(x, x, x, cu_seqlens_k=[0, 9]), r"cu_seqlens_k: given without cu_seqlens"),
    (lambda m, x: m(x, x, x, cu_seqlens=[0, 4, 9], key_lengths=[3]), r"key_lengths: not taken by varlen"),
    (lambda m, x: m(x, x, x, cu_seqlens=[0, 4, 9], attn_mask=np.zeros((9, 9), bool)), r"attn_mask: not taken"),
    (lambda m, x: m(x, x, x, cu_seqlens=[0.0, 4, 9]), r"cu_seqlens\[0\]"),
    (lambda m, x: m(x, x, x, cu_seqlens="0,9"), r"cu_seqlens: expected a sequence of integers"),
])
def test_bad_packed_calls_are_refused_naming_the_argument(call, match):
    layer = make_layer(np.float32)
    x = np.ones((9, 16), np.float32)
    with pytest.raises(mha.Error, match=match):
        call(layer, x)


def test_packed_input_is_refused_by_the_caches_and_with_appended_keys():
    layer = make_layer(np.float32)
    layer.eval()
    x = np.ones((1, 3, 16), np.float32)
    cache = mha.KeyValueCache()
    layer.append_to_cache(cache, x, x)
    with pytest.raises(TypeError):  # forward_cached has no cu_seqlens keyword at all in Python
        layer.forward_cached(x, cache, cu_seqlens=[0, 3])
    biased = mha.MultiheadAttention(16, 4, add_bias_kv=True)
    flat = np.ones((3, 16), np.float32)
    with pytest.raises(mha.Error, match=r"cu_seqlens: not available with add_bias_kv"):
        biased(flat, flat, flat, cu_seqlens=[0, 3])


@pytest.mark.parametrize("window", [None, (1, 0)])
def test_a_nan_in_a_key_its_sequence_never_sees_reaches_no_gradient(window):
    """Packed cross-attention: sequence 0 has no queries (all three of its keys unseen); sequence 1 has one
    query at the bottom-right of its five keys, whose window (1, 0) lets it see only keys 3 and 4 of them.
    A NaN in an unseen key row changes nothing, parameter gradients included; the same NaN in a key the
    query sees reaches them (the rule works both ways)."""
    layer = make_layer(np.float64, kdim=12, vdim=12)
    rng = np.random.default_rng(12)
    query, key = rng.standard_normal((1, 16)), rng.standard_normal((8, 12))
    dout = rng.standard_normal((1, 16))
    options = dict(cu_seqlens=[0, 0, 1], cu_seqlens_k=[0, 3, 8], window=window, need_weights=False)

    def run(k):
        out, _ = layer(query, k, k, **options)
        return out, layer.backward(dout)

    clean_out, clean = run(key)
    unseen_rows = [0, 1, 2] + ([3, 4, 5] if window else [])  # sequence 0's keys; sequence 1's keys 0-2
    for row in unseen_rows:
        poisoned = key.copy()
        poisoned[row, 5] = np.nan
        out, grads = run(poisoned)
        np.testing.assert_array_equal(out, clean_out)
        for name, g in grads.items():
            if name in ("key", "value"):
                others = np.delete(np.arange(8), row)
                np.testing.assert_array_equal(g[others], clean[name][others], err_msg=f"{name}, row {row}")
            else:
                np.testing.assert_array_equal(g, clean[name], err_msg=f"{name}, row {row}")
    seen = key.copy()
    seen[7, 5] = np.nan  # the query's own key
    _, grads = run(seen)
    assert np.isnan(grads["k_proj_weight"]).any() and np.isnan(grads["v_proj_weight"]).any()
