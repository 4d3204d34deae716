"""Grouped-query attention through mha.scaled_dot_product_attention and its backward: k and v with
h_kv heads (h_kv divides h; 1 is multi-query attention), query head i reading key/value head
i // (h // h_kv). Checked against torch autograd on k and v repeated per group
(repeat_interleave), whose gradients sum over each group, in float64 (the truth) and float32 (the
error a plain float32 implementation makes, which sets the tolerance), on shapes hypothesis draws.

Legend: B batch, h query heads, h_kv key/value heads, g = h / h_kv, L queries, S keys.
"""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mha
from mha_reference import additive_mask


def torch_grouped(q, k, v, additive, scale, dout, dtype):
    """out, dq, dk, dv of sum(out * dout), with k and v repeated for each group in torch."""
    g = q.shape[1] // k.shape[1]
    dead = np.isneginf(additive).all(axis=-1, keepdims=True)
    tq, tk, tv = (torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v))
    k_all, v_all = tk.repeat_interleave(g, dim=1), tv.repeat_interleave(g, dim=1)
    logits = tq @ k_all.transpose(-1, -2) * scale + torch.tensor(np.where(dead, 0.0, additive), dtype=dtype)
    weights = torch.softmax(logits, dim=-1) * torch.tensor(~dead, dtype=dtype)
    out = weights @ v_all
    (out * torch.tensor(dout, dtype=dtype)).sum().backward()
    return out.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def max_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


@st.composite
def grouped_cases(draw):
    h_kv = draw(st.integers(1, 3))
    g = draw(st.sampled_from([1, 2, 3, 4, 8]))
    return dict(B=draw(st.integers(1, 2)), h_kv=h_kv, h=h_kv * g, L=draw(st.integers(1, 40)),
                S=draw(st.one_of(st.integers(1, 40), st.integers(250, 300))),
                d_k=draw(st.sampled_from([1, 5, 16])), d_v=draw(st.sampled_from([1, 7, 16])),
                causal=draw(st.booleans()), mask=draw(st.sampled_from(["none", "bool2d", "float4d", "kpm"])),
                kernel=draw(st.sampled_from(["flash", "reference"])), seed=draw(st.integers(0, 2**31)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grouped_cases())
def test_grouped_query_matches_torch_on_repeated_heads(c):
    r = np.random.default_rng(c["seed"])
    B, h, h_kv, L, S, d_k, d_v = (c[n] for n in ("B", "h", "h_kv", "L", "S", "d_k", "d_v"))
    q = r.normal(size=(B, h, L, d_k)).astype(np.float32)
    k = r.normal(size=(B, h_kv, S, d_k)).astype(np.float32)
    v = r.normal(size=(B, h_kv, S, d_v)).astype(np.float32)
    dout = r.normal(size=(B, h, L, d_v)).astype(np.float32)
    mask = kpm = None
    if c["mask"] == "bool2d":
        mask = r.random((L, S)) < 0.3
    elif c["mask"] == "float4d":
        mask = r.normal(size=(B, h, L, S)).astype(np.float32)
        mask[r.random(mask.shape) < 0.1] = -np.inf
    elif c["mask"] == "kpm":
        kpm = r.random((B, S)) < 0.3
    additive = additive_mask(B, h, L, S, mask, kpm, c["causal"])
    scale = 1.0 / np.sqrt(d_k)
    out64, dq64, dk64, dv64 = torch_grouped(q, k, v, additive, scale, dout, torch.float64)
    out32, dq32, dk32, dv32 = torch_grouped(q, k, v, additive, scale, dout, torch.float32)

    opts = dict(attn_mask=mask, key_padding_mask=kpm, is_causal=c["causal"], kernel=c["kernel"])
    out, lse = mha.scaled_dot_product_attention(q, k, v, need_lse=True, **opts)
    assert out.shape == (B, h, L, d_v)
    assert max_diff(out, out64) <= 2 * max_diff(out32, out64) + 1e-6
    dq, dk, dv = mha.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **opts)
    assert dk.shape == k.shape and dv.shape == v.shape
    for name, got, g32, g64 in (("dq", dq, dq32, dq64), ("dk", dk, dk32, dk64), ("dv", dv, dv32, dv64)):
        bound = 2 * max_diff(g32, g64) + 1e-5 * max(1.0, float(np.abs(g64).max()) if g64.size else 1.0)
        assert max_diff(got, g64) <= bound, name

    # float64 is the verification dtype: within float64 rounding of torch's float64
    q64, k64, v64, d64 = (x.astype(np.float64) for x in (q, k, v, dout))
    opts64 = dict(opts, attn_mask=None if mask is None else (mask if mask.dtype == bool else mask.astype(np.float64)))
    out_f64, lse64 = mha.scaled_dot_product_attention(q64, k64, v64, need_lse=True, **opts64)
    assert max_diff(out_f64, out64) <= 1e-10
    grads64 = mha.scaled_dot_product_attention_backward(d64, q64, k64, v64, out_f64, lse64, **opts64)
    for got, want in zip(grads64, (dq64, dk64, dv64)):
        assert max_diff(got, want) <= 1e-10 * max(1.0, float(np.abs(want).max()) if want.size else 1.0)


@pytest.mark.parametrize("k_heads, v_heads", [(3, 3), (8, 8), (2, 1), (0, 0)])
def test_key_value_heads_that_do_not_divide_the_query_heads_are_refused(k_heads, v_heads):
    q = np.zeros((1, 4, 2, 8), np.float32)
    k, v = np.zeros((1, k_heads, 3, 8), np.float32), np.zeros((1, v_heads, 3, 8), np.float32)
    with pytest.raises(ValueError, match="h_kv|v: expected"):
        mha.scaled_dot_product_attention(q, k, v)
