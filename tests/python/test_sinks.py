"""Attention sinks (mha/score.hpp's ScoreSpec::sinks): one logit per query head that joins every row's
softmax and brings no value, p_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k)).

The truth is written here, independently of the library: torch in float64, the sink as one more
logit column that is dropped after the softmax, and torch's autograd for dq, dk, dv and dsinks. The
same formulation in float32 measures what plain float32 arithmetic loses (the suite's 2x / 3x rule).

Legend: B batch, h query heads, h_kv key/value heads, L queries, S keys, d_k, d_v.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import mha
from mha_reference import round_to_bfloat16
from test_properties import hypothesis_settings

KERNELS = {"flash": mha.Kernel.flash, "reference": mha.Kernel.reference}


def reference(q, k, v, sinks, *, causal=False, window=None, alibi=None, softcap=0.0, key_lengths=None,
              scale=None, dtype=torch.float64, dout=None):
    """(out, lse) and, given dout, (dq, dk, dv, dsinks), in `dtype`, from NumPy inputs."""
    q, k, v = (torch.tensor(np.asarray(x, np.float64), dtype=dtype, requires_grad=True) for x in (q, k, v))
    sink = torch.tensor(np.asarray(sinks, np.float64), dtype=dtype, requires_grad=True)
    B, h, L, d_k = q.shape
    S, group = k.shape[2], h // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    x = q @ kk.transpose(-1, -2) * (d_k ** -0.5 if scale is None else scale)
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    position = torch.arange(L)[:, None] + S - L  # query i at i + S - L
    j = torch.arange(S)[None, :]
    allowed = torch.ones(B, h, L, S, dtype=torch.bool)
    if causal:
        allowed &= j <= position
    if window is not None:
        if window[0] >= 0:
            allowed &= j >= position - window[0]
        if window[1] >= 0:
            allowed &= j <= position + window[1]
    if key_lengths is not None:
        allowed &= j[None, None] < torch.tensor(key_lengths)[:, None, None, None]
    if alibi is not None:
        x = x - torch.tensor(alibi, dtype=dtype)[:, None, None] * (position - j).abs().to(dtype)
    x = x.masked_fill(~allowed, -np.inf)
    logits = torch.cat([x, sink[None, :, None, None].expand(B, h, L, 1)], dim=-1)
    p = torch.softmax(logits, dim=-1)[..., :S]
    out = p @ vv
    lse = torch.logsumexp(logits, dim=-1)
    if dout is None:
        return out.detach().numpy(), lse.detach().numpy()
    out.backward(torch.tensor(np.asarray(dout, np.float64), dtype=dtype))
    return tuple(t.grad.numpy() for t in (q, k, v, sink))


def assert_within_rule(name, got, ref64, ref32, factor, floor=1e-6):
    """|got - ref64| <= factor * |ref32 - ref64| + floor * max(1, |ref64|), elementwise maximum."""
    got, ref64, ref32 = (np.asarray(a, np.float64) for a in (got, ref64, ref32))
    assert got.shape == ref64.shape, (name, got.shape, ref64.shape)
    assert np.array_equal(np.isfinite(got), np.isfinite(ref64)), name
    finite = np.isfinite(ref64)
    if not finite.any():
        return
    err = np.abs(got - ref64)[finite].max()
    bound = factor * np.abs(ref32 - ref64)[finite].max() + floor * max(1.0, np.abs(ref64[finite]).max())
    assert err <= bound, f"{name}: max|ours - fp64| = {err:.3g} > {bound:.3g}"


def random_case(seed, B=2, h=4, h_kv=2, L=7, S=9, d_k=8, d_v=6, sink_scale=2.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, h, L, d_k))
    k = rng.standard_normal((B, h_kv, S, d_k))
    v = rng.standard_normal((B, h_kv, S, d_v))
    sinks = rng.standard_normal(h) * sink_scale
    dout = rng.standard_normal((B, h, L, d_v))
    return q, k, v, sinks, dout


@st.composite
def sink_cases(draw):
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2, 3]))
    L, S = draw(st.integers(1, 40)), draw(st.integers(0, 40))
    c = dict(B=draw(st.integers(1, 2)), h=h, h_kv=h_kv, L=L, S=S, d_k=draw(st.sampled_from([1, 4, 16])),
             d_v=draw(st.sampled_from([1, 5, 16])), seed=draw(st.integers(0, 2**31)),
             sink_scale=draw(st.sampled_from([0.1, 3.0, 30.0])))
    variants = dict(causal=draw(st.booleans()))
    if draw(st.booleans()):
        variants["window"] = (draw(st.integers(-1, 6)), draw(st.integers(-1, 6)))
    if draw(st.booleans()):
        variants["alibi"] = list(np.linspace(0.05, 0.5, h))
    if draw(st.booleans()):
        variants["softcap"] = draw(st.sampled_from([0.5, 5.0]))
    if draw(st.booleans()) and S > 0:
        variants["key_lengths"] = [draw(st.integers(0, S)) for _ in range(c["B"])]
    return c, variants


def library_options(variants):
    o = dict(variants)
    o["is_causal"] = o.pop("causal")
    if "alibi" in o:
        o["alibi_slopes"] = np.asarray(o.pop("alibi"))
    return o


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@hypothesis_settings(80)
@given(case=sink_cases())
def test_forward_and_backward_match_the_float64_reference(kernel, dtype, case):
    c, variants = case
    seed, sink_scale = c.pop("seed"), c.pop("sink_scale")
    q, k, v, sinks, dout = random_case(seed, sink_scale=sink_scale, **c)
    ref64 = reference(q, k, v, sinks, **variants)
    ref32 = reference(q, k, v, sinks, dtype=torch.float32, **variants)
    args = [x.astype(dtype) for x in (q, k, v)]
    opts = dict(kernel=KERNELS[kernel], sinks=sinks.astype(dtype), **library_options(variants))
    out, lse = mha.scaled_dot_product_attention(*args, need_lse=True, **opts)
    factor = 2.0 if dtype == np.float32 else 0.0
    floor = 1e-6 if dtype == np.float32 else 1e-12
    assert out.dtype == dtype and lse.dtype == dtype
    assert_within_rule("out", out, ref64[0], ref32[0], factor, floor)
    assert_within_rule("lse", lse, ref64[1], ref32[1], factor, floor)
    grads = mha.scaled_dot_product_attention_backward(dout.astype(dtype), *args, out, lse, **opts)
    assert len(grads) == 4 and grads[3].dtype == dtype and grads[3].shape == (c["h"],)
    g64 = reference(q, k, v, sinks, dout=dout, **variants)
    g32 = reference(q, k, v, sinks, dout=dout, dtype=torch.float32, **variants)
    for name, got, r64, r32 in zip(("dq", "dk", "dv", "dsinks"), grads, g64, g32):
        assert_within_rule(name, got, r64, r32, 3.0 if dtype == np.float32 else 0.0, 1e-5 if dtype == np.float32
                           else 1e-10)


def test_weights_sum_to_less_than_one_by_the_sink_share():
    """sum_j p_j = 1 - exp(sink - lse): the weights returned and the lse agree with the sink's share."""
    q, k, v, sinks, _ = random_case(1)
    for kernel in KERNELS.values():
        out, weights, lse = mha.scaled_dot_product_attention(q, k, v, sinks=sinks, need_weights=True, need_lse=True,
                                                             kernel=kernel)
        share = np.exp(sinks[None, :, None] - lse)
        np.testing.assert_allclose(weights.sum(-1), 1.0 - share, rtol=1e-12, atol=1e-12)
        assert np.all(weights.sum(-1) < 1.0)


def test_a_row_with_no_allowed_key_gets_output_zero_and_the_sink_as_lse():
    q, k, v, sinks, dout = random_case(2)
    key_lengths = [0, 4]  # batch 0 sees no key at all
    for kernel in KERNELS.values():
        out, lse = mha.scaled_dot_product_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                                    key_lengths=key_lengths, sinks=sinks.astype(np.float32),
                                                    need_lse=True, kernel=kernel)
        assert np.all(out[0] == 0.0)
        np.testing.assert_array_equal(lse[0], np.broadcast_to(sinks.astype(np.float32)[:, None], lse[0].shape))
        dq, dk, dv, dsinks = mha.scaled_dot_product_attention_backward(
            dout.astype(np.float32), q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), out, lse,
            key_lengths=key_lengths, sinks=sinks.astype(np.float32), kernel=kernel)
        assert np.all(dq[0] == 0) and np.all(dk[0] == 0) and np.all(dv[0] == 0) and np.all(np.isfinite(dsinks))


def test_a_minus_inf_sink_is_no_sink_and_nan_or_plus_inf_reach_only_their_head():
    q, k, v, sinks, dout = random_case(3)
    plain, plain_lse = mha.scaled_dot_product_attention(q, k, v, need_lse=True)
    for kernel in KERNELS.values():
        none = np.full(4, -np.inf)
        out, lse = mha.scaled_dot_product_attention(q, k, v, sinks=none, need_lse=True, kernel=kernel)
        np.testing.assert_allclose(out, plain, rtol=0, atol=1e-14)
        np.testing.assert_allclose(lse, plain_lse, rtol=0, atol=1e-14)
        for bad in (np.nan, np.inf):
            s = sinks.copy()
            s[1] = bad
            out, lse = mha.scaled_dot_product_attention(q, k, v, sinks=s, need_lse=True, kernel=kernel)
            assert np.all(np.isnan(out[:, 1])) and np.all(np.isfinite(np.delete(out, 1, axis=1)))
            dq, dk, dv, ds = mha.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, sinks=s, kernel=kernel)
            assert np.isnan(ds[1]) and np.all(np.isfinite(np.delete(ds, 1)))
            assert np.all(np.isnan(dq[:, 1])) and np.all(np.isfinite(np.delete(dq, 1, axis=1)))


def test_a_nan_in_dout_of_a_row_with_output_zero_stays_out_of_dsinks():
    q, k, v, sinks, dout = random_case(4)
    key_lengths = [0, 9]
    out, lse = mha.scaled_dot_product_attention(q, k, v, key_lengths=key_lengths, sinks=sinks, need_lse=True)
    dout[0, :, 3] = np.nan  # batch 0 has no key: its output is 0 whatever the sink
    *_, ds = mha.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, key_lengths=key_lengths, sinks=sinks)
    assert np.all(np.isfinite(ds))


def test_bfloat16_inputs_take_float32_sinks_within_bfloat16_precision():
    q, k, v, sinks, dout = random_case(5, L=33, S=70, d_k=16, d_v=16)
    bq, bk, bv = (mha.to_bfloat16(x.astype(np.float32)) for x in (q, k, v))
    wide = [round_to_bfloat16(x.astype(np.float32)).astype(np.float64) for x in (q, k, v)]
    ref_out, ref_lse = reference(*wide, sinks.astype(np.float32), causal=True)
    out, lse = mha.scaled_dot_product_attention(bq, bk, bv, sinks=sinks.astype(np.float32), is_causal=True,
                                                need_lse=True)
    assert lse.dtype == np.float32
    got = mha.from_bfloat16(out)
    assert np.abs(got - ref_out).max() <= 2.0 ** -7 * np.abs(ref_out).max()
    assert np.abs(lse - ref_lse).max() <= 1e-4 * max(1.0, np.abs(ref_lse).max())
    *_, ds = mha.scaled_dot_product_attention_backward(mha.to_bfloat16(dout.astype(np.float32)), bq, bk, bv, out, lse,
                                                       sinks=sinks.astype(np.float32), is_causal=True)
    ref_ds = reference(*wide, sinks.astype(np.float32), causal=True, dout=round_to_bfloat16(dout.astype(np.float32)))[3]
    assert ds.dtype == np.float32
    assert np.abs(ds - ref_ds).max() <= 2.0 ** -6 * max(1.0, np.abs(ref_ds).max())


def test_dsinks_is_bitwise_repeatable_across_thread_counts():
    q, k, v, sinks, dout = (x.astype(np.float32) for x in random_case(6, B=3, L=300, S=300))
    results, before = [], mha.num_threads()
    for threads in (1, 2):
        mha.set_num_threads(threads)
        out, lse = mha.scaled_dot_product_attention(q, k, v, sinks=sinks, need_lse=True, is_causal=True)
        results.append((out, lse) + tuple(mha.scaled_dot_product_attention_backward(
            dout, q, k, v, out, lse, sinks=sinks, is_causal=True)))
    mha.set_num_threads(before)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("sinks,match", [
    (np.zeros(3), r"sinks: expected one logit per query head, \[h\] = \[4\]"),
    (np.zeros((4, 1)), r"sinks: expected one logit per query head"),
    (np.zeros(4, np.int32), r"sinks"),
    (np.array([0, 0, 1e39, 0]), r"sinks: expected finite values within \+-3.4028235e\+38 .*1e\+39 for head 2"),
])
def test_bad_sinks_are_refused_naming_the_argument(sinks, match):
    q, k, v, _, _ = random_case(7)
    with pytest.raises(mha.Error, match=match):
        mha.scaled_dot_product_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                         sinks=sinks)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_packed_sequences_take_sinks_forward_and_backward(dtype):
    """varlen_attention with sinks equals the float64 reference run per sequence; its dsinks is the sum
    of the sequences' dsinks."""
    rng = np.random.default_rng(12)
    lengths = [(5, 7), (0, 3), (1, 1), (9, 4), (3, 0)]  # (L_i, S_i), empty ones included
    h, h_kv, d = 4, 2, 8
    sinks = (rng.standard_normal(h) * 2).astype(dtype)
    qs = [rng.standard_normal((L, h, d)) for L, _ in lengths]
    ks = [rng.standard_normal((S, h_kv, d)) for _, S in lengths]
    vs = [rng.standard_normal((S, h_kv, d)) for _, S in lengths]
    douts = [rng.standard_normal((L, h, d)) for L, _ in lengths]
    cu_q = np.cumsum([0] + [L for L, _ in lengths])
    cu_k = np.cumsum([0] + [S for _, S in lengths])
    q, k, v, dout = (np.concatenate(x).astype(dtype) for x in (qs, ks, vs, douts))
    out, lse = mha.varlen_attention(q, k, v, cu_q, cu_k, sinks=sinks, is_causal=True, need_lse=True)
    dq, dk, dv, ds = mha.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, sinks=sinks, is_causal=True)
    ref_ds, ref32_ds = np.zeros(h), np.zeros(h)
    for i, (L, S) in enumerate(lengths):
        args = [x[None].transpose(0, 2, 1, 3) for x in (qs[i], ks[i], vs[i])]
        ref_out, ref_lse = reference(*args, sinks, causal=True)
        got = out[cu_q[i]:cu_q[i + 1]].transpose(1, 0, 2)[None]
        assert np.abs(got - ref_out).max(initial=0) <= (1e-5 if dtype == np.float32 else 1e-12)
        if L:
            dout_i = douts[i][None].transpose(0, 2, 1, 3)
            ref_ds += reference(*args, sinks, causal=True, dout=dout_i)[3]
            ref32_ds += reference(*args, sinks, causal=True, dout=dout_i, dtype=torch.float32)[3]
    assert ds.dtype == dtype and ds.shape == (h,)
    assert_within_rule("dsinks", ds, ref_ds, ref32_ds, 3.0 if dtype == np.float32 else 0.0,
                       1e-5 if dtype == np.float32 else 1e-10)
