"""Gradients: MultiheadAttention.backward and scaled_dot_product_attention_backward.

Checked against torch autograd (float64 as the truth; float32 sets the tolerance, as in the forward
suite): max|ours - torch_fp64| <= 2 * max|torch_fp32 - torch_fp64| + 1e-5 * max(1, max|torch_fp64|)
(the floor scales with the gradient, since gradients are long sums; see grad_bound). Float64
gradients agree with torch's to ~1e-10 relative. Dropout, which torch cannot reproduce, is checked
by central differences in float64 and by its linear parts.

Legend: B batch, h heads, L queries, S keys, E embed_dim, d_k / d_v per-head widths.
"""
import numpy as np
import pytest
import torch

import mha
from mha_reference import additive_mask, mha_reference

KERNELS = {"flash": mha.Kernel.flash, "reference": mha.Kernel.reference}


NUMPY_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}


def grad_bound(err32, ref64):
    """2 * torch float32's error + 1e-5 of the largest gradient (about 80 float32 ulps): gradients
    are long sums (over B*L, S, d) whose float32 error depends on the summation order, and torch's
    reductions are pairwise, so on some shapes its float32 error is several times below a plain
    loop's; the relative floor absorbs that while any real mistake is O(1) relative."""
    scale = max(1.0, float(np.max(np.abs(ref64)))) if np.size(ref64) else 1.0
    return 2.0 * err32 + 1e-5 * scale


def max_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def normal(rng, shape, dtype=np.float32):
    return rng.normal(size=shape).astype(dtype)


# ---- MultiheadAttention.backward against torch autograd ------------------------------------------

def _mha_case(seed):
    r = np.random.default_rng([31, seed])
    long = seed % 8 == 7  # a few long ones, so the flash kernel crosses tiles
    return dict(
        seed=seed, layout=("batch_first", "seq_first", "unbatched")[seed % 3],
        B=int(r.integers(1, 4)), L=int(r.integers(1, 300 if long else 30)),
        S=int(r.integers(257, 400)) if long else int(r.integers(1, 30)),
        h=int(r.choice([1, 2, 3, 4])), head_dim=int(r.choice([1, 3, 8])),
        kdim=int(r.integers(1, 12)) if r.random() < 0.3 else None,
        vdim=int(r.integers(1, 12)) if r.random() < 0.3 else None,
        bias=bool(r.random() < 0.8), add_bias_kv=bool(r.random() < 0.3), add_zero_attn=bool(r.random() < 0.3),
        mask=str(r.choice(["none", "bool2d", "bool3d", "float2d"])), kpm=bool(r.random() < 0.4))


MHA_CASES = [_mha_case(s) for s in range(24)]


def _mha_id(c):
    parts = [f"{c['seed']:02d}", c["layout"], f"B{c['B']}", f"L{c['L']}", f"S{c['S']}", f"h{c['h']}x{c['head_dim']}"]
    parts += [f"kdim{c['kdim']}"] if c["kdim"] else []
    parts += [f"vdim{c['vdim']}"] if c["vdim"] else []
    parts += [] if c["bias"] else ["nobias"]
    parts += ["biaskv"] if c["add_bias_kv"] else []
    parts += ["zeroattn"] if c["add_zero_attn"] else []
    parts += [] if c["mask"] == "none" else [c["mask"]]
    parts += ["kpm"] if c["kpm"] else []
    return "-".join(parts)


def _torch_grads(module, dtype, c, inputs, dout, kpm, mask):
    """torch's gradients of sum(out * dout): (dquery, dkey, dvalue, {name: dparam}) as NumPy."""
    module.zero_grad()
    np_dtype = NUMPY_DTYPE[dtype]
    tensors = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in inputs]
    tmask = None
    if mask is not None:
        tmask = torch.from_numpy(mask if mask.dtype == bool else mask.astype(np_dtype))
    out, _ = module(*tensors, key_padding_mask=None if kpm is None else torch.from_numpy(kpm),
                    need_weights=False, attn_mask=tmask)
    (out * torch.from_numpy(dout.astype(np_dtype))).sum().backward()
    params = {name: p.grad.numpy().copy() for name, p in module.named_parameters()}
    return [t.grad.numpy() for t in tensors], params


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("c", MHA_CASES, ids=[_mha_id(c) for c in MHA_CASES])
def test_mha_backward_against_torch(c, kernel):
    r = np.random.default_rng([32, c["seed"]])
    B, L, S, h = c["B"], c["L"], c["S"], c["h"]
    E = h * c["head_dim"]
    kdim, vdim = c["kdim"] or E, c["vdim"] or E
    query, key, value = normal(r, (B, L, E)), normal(r, (B, S, kdim)), normal(r, (B, S, vdim))
    kpm = (r.random((B, S)) < 0.2) if c["kpm"] else None
    mask = None
    if c["mask"] != "none":
        shape = (L, S) if c["mask"].endswith("2d") else (B * h, L, S)
        forbid = r.random(shape) < 0.2
        forbid[..., 0] = False  # every row keeps key 0: no fully masked rows (torch's NaN)
        mask = forbid if c["mask"].startswith("bool") else np.where(forbid, -np.inf, normal(r, shape))
        mask = mask if mask.dtype == bool else mask.astype(np.float32)
    if kpm is not None:
        kpm[:, 0] = False
    dout = normal(r, (B, L, E))
    if c["layout"] == "seq_first":
        query, key, value, dout = (np.ascontiguousarray(x.transpose(1, 0, 2)) for x in (query, key, value, dout))
    elif c["layout"] == "unbatched":
        query, key, value, dout = (x[0] for x in (query, key, value, dout))
        kpm = None if kpm is None else kpm[0]

    torch.manual_seed(c["seed"])
    t32 = torch.nn.MultiheadAttention(E, h, bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                      add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
                                      batch_first=c["layout"] == "batch_first")
    with torch.no_grad():
        for name, p in t32.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.5)
    t64 = torch.nn.MultiheadAttention(E, h, bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                      add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
                                      batch_first=c["layout"] == "batch_first").double()
    t64.load_state_dict(t32.state_dict())
    state = {name: v.numpy() for name, v in t32.state_dict().items()}
    (dq32, dk32, dv32), dp32 = _torch_grads(t32, torch.float32, c, (query, key, value), dout, kpm, mask)
    (dq64, dk64, dv64), dp64 = _torch_grads(t64, torch.float64, c, (query, key, value), dout, kpm, mask)

    for dtype in (np.float32, np.float64):
        ours = mha.MultiheadAttention(E, h, bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                      add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
                                      batch_first=c["layout"] == "batch_first", dtype=dtype).train()
        ours.kernel = KERNELS[kernel]
        ours.load_state_dict(state)
        ours(query.astype(dtype), key.astype(dtype), value.astype(dtype), key_padding_mask=kpm,
             attn_mask=mask, need_weights=False)
        grads = ours.backward(dout.astype(dtype))
        assert list(grads) == ["query", "key", "value"] + list(state)
        pairs = [("query", grads["query"], dq32, dq64), ("key", grads["key"], dk32, dk64),
                 ("value", grads["value"], dv32, dv64)]
        pairs += [(name, grads[name], dp32[name], dp64[name]) for name in state]
        for name, ours_grad, g32, g64 in pairs:
            assert ours_grad.dtype == dtype and ours_grad.shape == g64.shape, name
            assert np.isfinite(ours_grad).all(), name
            err = max_diff(ours_grad, g64)
            if dtype == np.float32:
                bound = grad_bound(max_diff(g32, g64), g64)
            else:
                bound = 1e-10 * max(1.0, float(np.max(np.abs(g64)))) if g64.size else 0.0
            assert err <= bound, f"{dtype.__name__} d{name}: {err:.3g} > {bound:.3g}"


def test_mha_backward_errors():
    m = mha.MultiheadAttention(8, 2, batch_first=True, seed=0)
    x = np.ones((2, 3, 8), np.float32)
    with pytest.raises(ValueError, match="^backward"):
        m.backward(x)  # no forward yet
    m.eval()(x, x, x)
    with pytest.raises(ValueError, match="^backward"):
        m.backward(x)  # evaluation mode keeps nothing
    m.train()(x, x, x)
    with pytest.raises(ValueError, match="^dout"):
        m.backward(np.ones((2, 4, 8), np.float32))
    with pytest.raises(ValueError, match="^dout"):
        m.backward(x.astype(np.float64))
    grads = m.backward(x)
    assert isinstance(grads, dict) and grads["query"].shape == x.shape


def test_mha_backward_with_dropout_linear_parts():
    """With dropout, the parts of the gradient that are linear in the returned (dropped) weights."""
    r = np.random.default_rng(33)
    E, h, B, L, S = 8, 2, 2, 6, 7
    m = mha.MultiheadAttention(E, h, dropout=0.4, batch_first=True, seed=3).train()
    state = m.state_dict()
    state["in_proj_bias"] = normal(r, state["in_proj_bias"].shape)
    m.load_state_dict(state)
    q, k, v = normal(r, (B, L, E)), normal(r, (B, S, E)), normal(r, (B, S, E))
    out, w = m(q, k, v, average_attn_weights=False)
    assert (w == 0).any()
    dout = normal(r, (B, L, E))
    grads = m.backward(dout)
    np.testing.assert_allclose(grads["out_proj.bias"], dout.astype(np.float64).sum(axis=(0, 1)),
                               rtol=1e-5, atol=1e-5)
    # context = concat_h(W_h V_h) from the dropped weights; d out_proj.weight = sum dout^T context
    w_v = state["in_proj_weight"][2 * E:].astype(np.float64)
    b_v = state["in_proj_bias"][2 * E:].astype(np.float64)
    v_heads = (v.astype(np.float64) @ w_v.T + b_v).reshape(B, S, h, E // h).transpose(0, 2, 1, 3)
    context = (w.astype(np.float64) @ v_heads).transpose(0, 2, 1, 3).reshape(B, L, E)
    expected = np.einsum("ble,blf->ef", dout.astype(np.float64), context)
    np.testing.assert_allclose(grads["out_proj.weight"], expected, rtol=1e-4, atol=1e-4)
    # d value = (W_h^T dcontext_h) through the value projection
    dcontext = (dout.astype(np.float64) @ state["out_proj.weight"].astype(np.float64)).reshape(B, L, h, E // h)
    dv_heads = np.swapaxes(w.astype(np.float64), -1, -2) @ dcontext.transpose(0, 2, 1, 3)
    dvalue = dv_heads.transpose(0, 2, 1, 3).reshape(B, S, E) @ w_v
    np.testing.assert_allclose(grads["value"], dvalue, rtol=1e-4, atol=1e-4)
    ref, _ = mha_reference(state, q, k, v, h, E // h, E // h, weights_override=w)
    np.testing.assert_allclose(out, ref, atol=1e-5)


# ---- scaled_dot_product_attention_backward against torch autograd --------------------------------

def torch_sdpa_grads(q, k, v, additive, scale, dout, dtype):
    """Gradients of sum(out * dout) for softmax(q k^T * scale + mask) v in torch; rows with no
    allowed key have output 0 (their logits are opened, then their weights multiplied by 0)."""
    np_dtype = NUMPY_DTYPE[dtype]
    dead = np.isneginf(additive).all(axis=-1, keepdims=True)
    tq, tk, tv = (torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v))
    logits = tq @ tk.transpose(-1, -2) * scale + torch.from_numpy(np.where(dead, 0.0, additive).astype(np_dtype))
    weights = torch.softmax(logits, dim=-1) * torch.from_numpy((~dead).astype(np_dtype))
    out = weights @ tv
    (out * torch.from_numpy(dout.astype(np_dtype))).sum().backward()
    return out.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def _sdpa_case(seed):
    r = np.random.default_rng([34, seed])
    long = seed % 6 == 5
    return dict(seed=seed, B=int(r.integers(1, 3)), h=int(r.integers(1, 4)),
                L=int(r.integers(1, 200 if long else 30)),
                S=int(r.integers(257, 600)) if long else int(r.integers(1, 30)),
                d_k=int(r.choice([1, 4, 13])), d_v=int(r.choice([1, 5, 8])),
                causal=bool(r.random() < 0.4), mask=str(r.choice(["none", "bool2d", "bool3d", "float4d"])),
                kpm=bool(r.random() < 0.4), scale=None if r.random() < 0.6 else float(r.uniform(0.1, 1.5)),
                dead_rows=bool(r.random() < 0.3))


SDPA_CASES = [_sdpa_case(s) for s in range(24)]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("c", SDPA_CASES, ids=[
    "{seed:02d}-B{B}-h{h}-L{L}-S{S}-dk{d_k}-dv{d_v}-{mask}".format(**c) + ("-causal" if c["causal"] else "")
    + ("-kpm" if c["kpm"] else "") + ("-scale" if c["scale"] else "") + ("-deadrows" if c["dead_rows"] else "")
    for c in SDPA_CASES])
def test_sdpa_backward_against_torch(c, kernel):
    r = np.random.default_rng([35, c["seed"]])
    B, h, L, S, d_k, d_v = (c[n] for n in ("B", "h", "L", "S", "d_k", "d_v"))
    q, k, v = normal(r, (B, h, L, d_k)), normal(r, (B, h, S, d_k)), normal(r, (B, h, S, d_v))
    dout = normal(r, (B, h, L, d_v))
    mask = None
    if c["mask"] == "bool2d":
        mask = r.random((L, S)) < 0.2
    elif c["mask"] == "bool3d":
        mask = r.random((B * h, L, S)) < 0.2
    elif c["mask"] == "float4d":
        mask = normal(r, (B, h, L, S))
        mask[r.random(mask.shape) < 0.1] = -np.inf
    kpm = (r.random((B, S)) < 0.2) if c["kpm"] else None
    if not c["dead_rows"]:  # keep one key open in every row (unless causal closes whole rows)
        if mask is not None:
            mask[..., S - 1] = False if mask.dtype == bool else 0.0
        if kpm is not None:
            kpm[:, S - 1] = False
    elif kpm is not None:
        kpm[0, :] = True
    scale = c["scale"]
    s = 1.0 / np.sqrt(d_k) if scale is None else scale
    additive = additive_mask(B, h, L, S, mask, kpm, c["causal"])
    _, dq64, dk64, dv64 = torch_sdpa_grads(q, k, v, additive, s, dout, torch.float64)
    _, dq32, dk32, dv32 = torch_sdpa_grads(q, k, v, additive, s, dout, torch.float32)

    opts = dict(attn_mask=mask, is_causal=c["causal"], scale=scale, key_padding_mask=kpm, kernel=KERNELS[kernel])
    for dtype in (np.float32, np.float64):
        qq, kk, vv, dd = (x.astype(dtype) for x in (q, k, v, dout))
        out, lse = mha.scaled_dot_product_attention(qq, kk, vv, need_lse=True, **opts)
        assert lse.shape == (B, h, L) and lse.dtype == dtype
        dead = np.isneginf(additive).all(axis=-1)
        assert np.isneginf(lse[dead]).all() and np.isfinite(lse[~dead]).all()
        grads = mha.scaled_dot_product_attention_backward(dd, qq, kk, vv, out, lse, **opts)
        for name, g, g32, g64 in zip("qkv", grads, (dq32, dk32, dv32), (dq64, dk64, dv64)):
            assert g.dtype == dtype and g.shape == g64.shape and np.isfinite(g).all(), name
            err = max_diff(g, g64)
            bound = grad_bound(max_diff(g32, g64), g64) if dtype == np.float32 else 1e-10 * max(1.0, np.abs(g64).max())
            assert err <= bound, f"{dtype.__name__} d{name}: {err:.3g} > {bound:.3g}"
        assert (grads[0][dead] == 0).all()  # rows that attend to nothing get no gradient


def test_sdpa_lse_is_the_log_sum_exp_of_the_logits():
    r = np.random.default_rng(36)
    q, k, v = normal(r, (2, 2, 9, 4)), normal(r, (2, 2, 11, 4)), normal(r, (2, 2, 11, 3))
    mask = r.random((9, 11)) < 0.3
    additive = additive_mask(2, 2, 9, 11, mask, None, True)
    logits = (q.astype(np.float64) @ np.swapaxes(k, -1, -2)) / 2.0 + additive
    with np.errstate(divide="ignore"):
        expected = np.log(np.exp(logits).sum(axis=-1))
    for kernel in KERNELS.values():
        _, lse = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, need_lse=True,
                                                  kernel=kernel)
        finite = np.isfinite(expected)
        np.testing.assert_array_equal(np.isfinite(lse), finite)
        np.testing.assert_allclose(lse[finite], expected[finite], atol=1e-5)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_sdpa_backward_with_dropout_by_central_differences(kernel):
    """With a fixed dropout seed the forward is a deterministic function; its float64 gradient
    matches central differences, and the float32 gradient (same mask) matches the float64 one."""
    r = np.random.default_rng(37)
    B, h, L, S, d_k, d_v = 1, 2, 5, 6, 3, 2
    q, k, v = (r.normal(size=s) for s in ((B, h, L, d_k), (B, h, S, d_k), (B, h, S, d_v)))
    dout = r.normal(size=(B, h, L, d_v))
    opts = dict(dropout_p=0.3, dropout_seed=5, is_causal=True, kernel=KERNELS[kernel])

    def loss(q_, k_, v_):
        return float((mha.scaled_dot_product_attention(q_, k_, v_, **opts) * dout).sum())

    out, lse = mha.scaled_dot_product_attention(q, k, v, need_lse=True, **opts)
    grads = mha.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **opts)
    eps = 1e-6
    for index, (name, x) in enumerate(zip("qkv", (q, k, v))):
        for flat in r.choice(x.size, size=min(6, x.size), replace=False):
            pos = np.unravel_index(flat, x.shape)
            plus, minus = [a.copy() for a in (q, k, v)], [a.copy() for a in (q, k, v)]
            plus[index][pos] += eps
            minus[index][pos] -= eps
            numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
            assert abs(grads[index][pos] - numeric) < 1e-6, (name, pos, grads[index][pos], numeric)

    q32, k32, v32, d32 = (a.astype(np.float32) for a in (q, k, v, dout))
    out32, lse32 = mha.scaled_dot_product_attention(q32, k32, v32, need_lse=True, **opts)
    grads32 = mha.scaled_dot_product_attention_backward(d32, q32, k32, v32, out32, lse32, **opts)
    for g32, g64 in zip(grads32, grads):
        np.testing.assert_allclose(g32, g64, atol=1e-5)


def test_sdpa_backward_unbatched_and_errors():
    r = np.random.default_rng(38)
    q, k, v = normal(r, (2, 3, 4)), normal(r, (2, 5, 4)), normal(r, (2, 5, 6))
    dout = normal(r, (2, 3, 6))
    out, lse = mha.scaled_dot_product_attention(q, k, v, need_lse=True)
    assert lse.shape == (2, 3)
    dq, dk, dv = mha.scaled_dot_product_attention_backward(dout, q, k, v, out, lse)
    batched = mha.scaled_dot_product_attention_backward(dout[None], q[None], k[None], v[None], out[None], lse[None])
    for a, b in zip((dq, dk, dv), batched):
        np.testing.assert_allclose(a, b[0], atol=1e-6)
    with pytest.raises(ValueError, match="^dout"):
        mha.scaled_dot_product_attention_backward(dout[:, :2], q, k, v, out, lse)
    with pytest.raises(ValueError, match="^lse"):
        mha.scaled_dot_product_attention_backward(dout, q, k, v, out, lse[:, :2])


@pytest.mark.parametrize("L,S", [(0, 0), (0, 3), (3, 0)])
@pytest.mark.parametrize("kernel", ["flash", "reference"])
@pytest.mark.parametrize("bfloat16", [False, True])
def test_the_backward_of_empty_queries_or_keys_is_zero_not_a_crash(L, S, kernel, bfloat16):
    """L = 0 or S = 0 (an empty sequence of a packed batch, say): every gradient is 0. The fused kernel
    once aborted the process here (its workspace allocator asserts on a size of 0)."""
    q, k = np.ones((2, 3, L, 4), np.float32), np.ones((2, 3, S, 4), np.float32)
    if bfloat16:
        q, k = mha.to_bfloat16(q), mha.to_bfloat16(k)
    out, lse = mha.scaled_dot_product_attention(q, k, k, need_lse=True, kernel=kernel)
    grads = mha.scaled_dot_product_attention_backward(out, q, k, k, out, lse, kernel=kernel)
    for g, like in zip(grads, (q, k, k)):
        g = mha.from_bfloat16(g) if bfloat16 else g
        assert g.shape == like.shape and np.all(g == 0)
