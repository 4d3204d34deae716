"""Grouped-query attention (and the window, ALiBi and soft-capping variants) through
mha.scaled_dot_product_attention and its backward, and MultiheadAttention(num_kv_heads=...): k and v with
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


def torch_grouped(q, k, v, additive, scale, dout, dtype, alibi=None, softcap=0.0):
    """out, dq, dk, dv of sum(out * dout), with k and v repeated for each group in torch; the
    logits soft-capped, then ALiBi's bias (slopes [h]) and the additive masks added."""
    g = q.shape[1] // k.shape[1]
    L, S = q.shape[2], k.shape[2]
    dead = np.isneginf(additive).all(axis=-1, keepdims=True)
    tq, tk, tv = (torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v))
    k_all, v_all = tk.repeat_interleave(g, dim=1), tv.repeat_interleave(g, dim=1)
    logits = tq @ k_all.transpose(-1, -2) * scale
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    if alibi is not None:
        distance = np.abs(np.arange(L)[:, None] + S - L - np.arange(S)[None, :])
        logits = logits - torch.tensor(np.asarray(alibi)[:, None, None] * distance, dtype=dtype)
    logits = logits + torch.tensor(np.where(dead, 0.0, additive), dtype=dtype)
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
                kernel=draw(st.sampled_from(["flash", "reference"])), seed=draw(st.integers(0, 2**31)),
                window=draw(st.sampled_from([None, (0, 0), (3, -1), (-1, 2), (40, 5), (1000, 1000)])),
                alibi=draw(st.booleans()), softcap=draw(st.sampled_from([0.0, 0.5, 4.0])))


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
    if c["window"] is not None:  # the window as a mask: position i' = i + S - L sees i' - left .. i' + right
        distance = np.arange(L)[:, None] + S - L - np.arange(S)[None, :]
        left, right = c["window"]
        additive = additive + np.where(((left >= 0) & (distance > left)) | ((right >= 0) & (-distance > right)),
                                       -np.inf, 0.0)
    alibi = r.uniform(0.05, 1.0, h).astype(np.float32) if c["alibi"] else None
    scale = 1.0 / np.sqrt(d_k)
    variants = dict(alibi=alibi, softcap=c["softcap"])
    out64, dq64, dk64, dv64 = torch_grouped(q, k, v, additive, scale, dout, torch.float64, **variants)
    out32, dq32, dk32, dv32 = torch_grouped(q, k, v, additive, scale, dout, torch.float32, **variants)

    opts = dict(attn_mask=mask, key_padding_mask=kpm, is_causal=c["causal"], kernel=c["kernel"],
                window=c["window"], alibi_slopes=alibi, softcap=c["softcap"])
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
    opts64 = dict(opts, attn_mask=None if mask is None else (mask if mask.dtype == bool else mask.astype(np.float64)),
                  alibi_slopes=None if alibi is None else alibi.astype(np.float64))
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


# ---- the layer: mha.MultiheadAttention(..., num_kv_heads=h_kv) -------------------------------------

def torch_grouped_layer(params, q_in, k_in, v_in, dout, h, h_kv, d_k, d_v, causal, dtype, window=(-1, -1),
                        alibi=None, softcap=0.0):
    """The layer written out in torch: q = x W_q^T + b_q (k, v likewise, h_kv heads), each key/value
    head repeated for its group, softmax(cap(q k^T / sqrt(d_k)) + ALiBi + masks) v per head,
    concatenated, W_o. Returns out and the gradients of sum(out * dout) for the inputs and every
    parameter."""
    t = {n: torch.tensor(p, dtype=dtype, requires_grad=True) for n, p in params.items()}
    xs = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q_in, k_in, v_in)]
    B, L, S = q_in.shape[0], q_in.shape[1], k_in.shape[1]
    qk, kk = h * d_k, h_kv * d_k
    b = t.get("in_proj_bias")
    q = xs[0] @ t["q_proj_weight"].T + (b[:qk] if b is not None else 0)
    k = xs[1] @ t["k_proj_weight"].T + (b[qk:qk + kk] if b is not None else 0)
    v = xs[2] @ t["v_proj_weight"].T + (b[qk + kk:] if b is not None else 0)
    q = q.reshape(B, L, h, d_k).transpose(1, 2)
    k = k.reshape(B, S, h_kv, d_k).transpose(1, 2).repeat_interleave(h // h_kv, dim=1)
    v = v.reshape(B, S, h_kv, d_v).transpose(1, 2).repeat_interleave(h // h_kv, dim=1)
    logits = q @ k.transpose(-1, -2) / np.sqrt(d_k)
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    position = np.arange(L)[:, None] + S - L  # query i's position, as causal aligns it
    distance = position - np.arange(S)[None, :]
    if alibi is not None:
        logits = logits - torch.tensor(np.asarray(alibi)[:, None, None] * np.abs(distance), dtype=dtype)
    hidden = np.zeros((L, S), bool)
    if causal:
        hidden |= distance < 0
    if window[0] >= 0:
        hidden |= distance > window[0]
    if window[1] >= 0:
        hidden |= -distance > window[1]
    logits = logits + torch.tensor(np.where(hidden, -np.inf, 0.0), dtype=dtype)
    context = (torch.softmax(logits, dim=-1) @ v).transpose(1, 2).reshape(B, L, h * d_v)
    out = context @ t["out_proj.weight"].T + (t["out_proj.bias"] if "out_proj.bias" in t else 0)
    (out * torch.tensor(dout, dtype=dtype)).sum().backward()
    grads = {"query": xs[0].grad, "key": xs[1].grad, "value": xs[2].grad}
    grads.update({n: p.grad for n, p in t.items()})
    return out.detach().numpy(), {n: g.numpy() for n, g in grads.items()}


@st.composite
def grouped_layer_cases(draw):
    h_kv = draw(st.integers(1, 3))
    h = h_kv * draw(st.sampled_from([1, 2, 4]))
    return dict(h=h, h_kv=h_kv, d_k=draw(st.sampled_from([2, 4])), d_v=draw(st.sampled_from([2, 3])),
                E=draw(st.sampled_from([6, 8])), B=draw(st.integers(1, 2)), L=draw(st.integers(1, 6)),
                S=draw(st.integers(1, 6)), bias=draw(st.booleans()), causal=draw(st.booleans()),
                window=draw(st.sampled_from([(-1, -1), (1, -1), (0, 2), (2, 0), (-1, 1)])),
                alibi=draw(st.booleans()), softcap=draw(st.sampled_from([0.0, 0.7, 3.0])),
                seed=draw(st.integers(0, 2**31)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grouped_layer_cases())
def test_grouped_query_layer_with_window_alibi_softcap_matches_torch(c):
    h, h_kv, d_k, d_v, E, B, L, S = (c[n] for n in ("h", "h_kv", "d_k", "d_v", "E", "B", "L", "S"))
    S = max(S, L)  # every row sees a key (its own position), whatever the window
    alibi = np.random.default_rng(c["seed"] + 1).uniform(0.1, 1.0, h) if c["alibi"] else None
    variants = dict(window=c["window"], softcap=c["softcap"], alibi_slopes=alibi)
    r = np.random.default_rng(c["seed"])
    results = {}
    for dtype in (np.float64, np.float32):
        layer = mha.MultiheadAttention(E, h, num_kv_heads=h_kv, d_k=d_k, d_v=d_v, bias=c["bias"],
                                       batch_first=True, dtype=dtype, seed=c["seed"])
        assert layer.num_kv_heads == h_kv
        state = layer.state_dict()
        assert "in_proj_weight" not in state or h_kv == h
        if dtype == np.float64:
            params = {n: p.astype(np.float64) for n, p in state.items()}
            if "in_proj_weight" in params:  # packed (h_kv == h): split as the torch formulation reads it
                w = params.pop("in_proj_weight")
                params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"] = np.split(w, 3)
            inputs = [r.normal(size=(B, T, E)) for T in (L, S, S)]
            dout = r.normal(size=(B, L, E))
        else:
            layer.load_state_dict({n: p.astype(np.float32) for n, p in results[np.float64][2].items()})
        xs = [x.astype(dtype) for x in inputs]
        out, _ = layer(*xs, need_weights=False, is_causal=c["causal"], **variants)
        grads = layer.backward(dout.astype(dtype))
        results[dtype] = (out, grads, layer.state_dict())
    torch_variants = dict(window=c["window"], alibi=alibi, softcap=c["softcap"])
    want64, g64 = torch_grouped_layer(params, *inputs, dout, h, h_kv, d_k, d_v, c["causal"], torch.float64,
                                      **torch_variants)
    want32, g32 = torch_grouped_layer({n: p.astype(np.float32) for n, p in params.items()},
                                      *[x.astype(np.float32) for x in inputs], dout.astype(np.float32),
                                      h, h_kv, d_k, d_v, c["causal"], torch.float32, **torch_variants)
    out64, grads64, _ = results[np.float64]
    out32, grads32, _ = results[np.float32]
    assert max_diff(out64, want64) <= 1e-10
    assert max_diff(out32, want64) <= 2 * max_diff(want32, want64) + 1e-6
    for name, g in grads64.items():
        if name == "in_proj_weight":
            want = np.concatenate([g64["q_proj_weight"], g64["k_proj_weight"], g64["v_proj_weight"]])
            want32_ = np.concatenate([g32["q_proj_weight"], g32["k_proj_weight"], g32["v_proj_weight"]])
        else:
            want, want32_ = g64[name], g32[name]
        scale = max(1.0, float(np.abs(want).max()))
        assert max_diff(g, want) <= 1e-10 * scale, name
        assert max_diff(grads32[name], want) <= 2 * max_diff(want32_, want) + 1e-5 * scale, name


def test_grouped_query_layer_refuses_num_kv_heads_that_do_not_divide():
    for bad in (3, 5, -1):
        with pytest.raises(ValueError, match="num_kv_heads"):
            mha.MultiheadAttention(8, 4, num_kv_heads=bad)
    layer = mha.MultiheadAttention(8, 4, num_kv_heads=2)
    assert "num_kv_heads=2" in repr(layer)
    assert layer.state_dict()["k_proj_weight"].shape == (4, 8)


@pytest.mark.parametrize("kernel", ["flash", "reference"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_softcap_caps_an_infinite_logit_and_the_nan_stays_where_ieee_puts_it(kernel, sign):
    """An Inf in a key makes its logit +-inf; soft-capping turns that into +-softcap (tanh(+-inf) = +-1),
    so the output stays finite, and its slope 1 - tanh^2 = 0 stops dS there; dq's component along the
    Inf is 0 * Inf = NaN, as the arithmetic says, in both kernels."""
    q = np.ones((1, 1, 2, 16), np.float32)
    k = np.ones((1, 1, 3, 16), np.float32)
    v = (np.arange(48, dtype=np.float32) / 10).reshape(1, 1, 3, 16)
    k[0, 0, 1, 3] = sign * np.inf
    cap = 5.0
    out, lse = mha.scaled_dot_product_attention(q, k, v, softcap=cap, kernel=kernel, need_lse=True)
    logits = cap * np.tanh(np.array([16.0, sign * np.inf, 16.0]) / 4.0 / cap)  # q.k / sqrt(16), capped
    weights = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert np.allclose(out[0, 0], np.broadcast_to(weights @ v[0, 0], (2, 16)), rtol=1e-5)
    dq, dk, dv = mha.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, out, lse, softcap=cap,
                                                           kernel=kernel)
    assert np.isnan(dq[0, 0, :, 3]).all() and np.isfinite(np.delete(dq[0, 0], 3, axis=1)).all()
    assert (dk[0, 0, 1] == 0).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
