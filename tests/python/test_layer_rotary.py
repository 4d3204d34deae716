"""mha.MultiheadAttention(..., rotary_dim=...): rotary position embeddings of every query and key head
after the projection (Su et al. 2021).

The truth is written here: the layer's math in torch float64 with the rotation from the formula
(inv_freq_i = base^(-2i / r), angle = position * inv_freq_i; pairs (i, i + r/2) or (2i, 2i + 1)), and
torch's autograd for the gradients; torch float32 measures what plain float32 arithmetic loses.

Legend: B batch, L queries, S keys, E embed_dim, h heads, h_kv key/value heads, d per-head width, r rotary_dim.
"""
import numpy as np
import pytest
import torch

import mha


def rotate(x, positions, r, base, interleaved):
    """x [B, heads, T, d] (torch) rotated at positions [T] (float64 angles)."""
    half = r // 2
    inv_freq = base ** (-2.0 * np.arange(half) / r)
    angle = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]  # [T, r/2]
    cos, sin = (torch.tensor(f(angle), dtype=x.dtype) for f in (np.cos, np.sin))
    if interleaved:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
    else:
        a, b = x[..., :half], x[..., half:r]
    ya, yb = a * cos - b * sin, b * cos + a * sin
    rotated = torch.stack([ya, yb], dim=-1).flatten(-2) if interleaved else torch.cat([ya, yb], dim=-1)
    return torch.cat([rotated, x[..., r:]], dim=-1)


def layer_reference(state, query, key, h, h_kv, r, base, interleaved, causal, dtype, dout=None):
    t = {name: torch.tensor(np.asarray(v, np.float64), dtype=dtype, requires_grad=True) for name, v in state.items()}
    xq = torch.tensor(np.asarray(query, np.float64), dtype=dtype, requires_grad=True)
    xk = torch.tensor(np.asarray(key, np.float64), dtype=dtype, requires_grad=True)
    B, L, E = xq.shape
    S = xk.shape[1]
    if "in_proj_weight" in t:
        w_q, w_k, w_v = t["in_proj_weight"].split([E, E, E])
    else:
        w_q, w_k, w_v = t["q_proj_weight"], t["k_proj_weight"], t["v_proj_weight"]
    d = w_q.shape[0] // h
    b_q, b_k, b_v = t["in_proj_bias"].split([w_q.shape[0], w_k.shape[0], w_v.shape[0]])
    q = (xq @ w_q.T + b_q).view(B, L, h, d).transpose(1, 2)
    k = (xk @ w_k.T + b_k).view(B, S, h_kv, d).transpose(1, 2)
    v = (xk @ w_v.T + b_v).view(B, S, h_kv, d).transpose(1, 2)
    q = rotate(q, np.arange(L) + S - L, r, base, interleaved)  # query i at i + S - L
    k = rotate(k, np.arange(S), r, base, interleaved)
    k, v = (x.repeat_interleave(h // h_kv, dim=1) for x in (k, v))
    logits = q @ k.transpose(-1, -2) / np.sqrt(d)
    if causal:
        logits = logits.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(S - L + 1), -np.inf)
    context = (torch.softmax(logits, -1) @ v).transpose(1, 2).reshape(B, L, h * d)
    out = context @ t["out_proj.weight"].T + t["out_proj.bias"]
    if dout is None:
        return out.detach().numpy()
    out.backward(torch.tensor(np.asarray(dout, np.float64), dtype=dtype))
    grads = {name: p.grad.numpy() for name, p in t.items()}
    grads["query"], grads["key"] = xq.grad.numpy(), xk.grad.numpy()
    return out.detach().numpy(), grads


CASES = [  # (h_kv, r, base, interleaved, causal, L, S)
    (4, 6, 10000.0, False, True, 9, 9),
    (4, 6, 10000.0, True, False, 5, 9),
    (2, 4, 500000.0, False, True, 7, 12),
    (1, 2, 10.0, True, True, 9, 9),
    (4, 6, 1.0, False, False, 1, 4),
]


@pytest.mark.parametrize("h_kv,r,base,interleaved,causal,L,S", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_and_gradients_match_the_reference(h_kv, r, base, interleaved, causal, L, S, dtype):
    layer = mha.MultiheadAttention(24, 4, num_kv_heads=h_kv, batch_first=True, dtype=dtype, seed=4, rotary_dim=r,
                                   rotary_base=base, rotary_interleaved=interleaved)
    rng = np.random.default_rng(r + L)
    query = rng.standard_normal((2, L, 24)).astype(dtype)
    key = query if L == S else rng.standard_normal((2, S, 24)).astype(dtype)
    dout = rng.standard_normal((2, L, 24)).astype(dtype)
    out, _ = layer(query, key, key, is_causal=causal, need_weights=False)
    grads = layer.backward(dout)
    grads["key"] = grads["key"] + grads["value"]  # the reference's key input plays both roles
    args = (layer.state_dict(), query, key, 4, h_kv, r, base, interleaved, causal)
    ref64_out, ref64 = layer_reference(*args, torch.float64, dout)
    ref32_out, ref32 = layer_reference(*args, torch.float32, dout)
    for name, got, r64, r32 in [("out", out, ref64_out, ref32_out)] + [(n, grads[n], ref64[n], ref32[n]) for n in ref64]:
        err = np.abs(np.asarray(got, np.float64) - r64).max()
        bound = (1e-10 * max(1.0, np.abs(r64).max()) if dtype == np.float64
                 else 3 * np.abs(r32 - r64).max() + 1e-5 * max(1.0, np.abs(r64).max()))
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"


def test_the_score_depends_only_on_relative_positions():
    """Shifting every position leaves self-attention unchanged: a prefix of keys the queries cannot see
    (causal, far away) changes nothing but the positions, so the last rows equal a shorter run's."""
    layer = mha.MultiheadAttention(16, 2, batch_first=True, dtype=np.float64, seed=5, rotary_dim=8)
    x = np.random.default_rng(6).standard_normal((1, 10, 16))
    plain = mha.MultiheadAttention(16, 2, batch_first=True, dtype=np.float64, seed=5)
    rotated, _ = layer(x, x, x, is_causal=True)
    unrotated, _ = plain(x, x, x, is_causal=True)
    assert np.abs(rotated - unrotated).max() > 1e-3  # the rotation acts
    np.testing.assert_allclose(rotated[:, 0], unrotated[:, 0], rtol=0, atol=1e-13)  # one key: nothing to compare


@pytest.mark.parametrize("interleaved", [False, True])
def test_forward_cached_step_by_step_equals_the_causal_forward(interleaved):
    layer = mha.MultiheadAttention(16, 4, num_kv_heads=2, batch_first=True, seed=7, rotary_dim=4,
                                   rotary_interleaved=interleaved)
    layer.eval()
    x = np.random.default_rng(8).standard_normal((2, 13, 16)).astype(np.float32)
    whole, _ = layer(x, x, x, is_causal=True, need_weights=False)
    cache = mha.KeyValueCache()
    steps = []
    for t0, t1 in [(0, 3), (3, 4), (4, 9), (9, 13)]:  # chunks of several positions and single ones
        layer.append_to_cache(cache, x[:, t0:t1], x[:, t0:t1])
        steps.append(layer.forward_cached(x[:, t0:t1], cache, is_causal=True, need_weights=False)[0])
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=0, atol=3e-6)


def test_a_cache_of_another_rotary_layer_is_refused():
    rotary = mha.MultiheadAttention(16, 4, batch_first=True, seed=1, rotary_dim=4)
    plain = mha.MultiheadAttention(16, 4, batch_first=True, seed=1)
    cache = mha.KeyValueCache()
    x = np.ones((1, 2, 16), np.float32)
    rotary.append_to_cache(cache, x, x)
    with pytest.raises(mha.Error, match=r"cache: filled by a layer with rotary_dim 4"):
        plain.forward_cached(x, cache)


@pytest.mark.parametrize("kwargs,match", [
    (dict(rotary_dim=3), r"rotary_dim: expected 0 \(none\) or an even number"),
    (dict(rotary_dim=6), r"rotary_dim: .*d_k = 4\], got 6"),
    (dict(rotary_dim=0), r"rotary_dim: expected an even number"),
    (dict(rotary_dim=4, rotary_base=-1.0), r"rotary_base: expected a finite base > 0"),
    (dict(rotary_dim=4, rotary_base=float("nan")), r"rotary_base"),
    (dict(rotary_dim=4, add_bias_kv=True), r"rotary_dim: not available with add_bias_kv"),
    (dict(rotary_dim=4, add_zero_attn=True), r"rotary_dim: not available with add_zero_attn"),
])
def test_bad_rotary_settings_are_refused_naming_them(kwargs, match):
    with pytest.raises(mha.Error, match=match):
        mha.MultiheadAttention(16, 4, **kwargs)


def test_rotary_settings_survive_save_load_and_pickle(tmp_path):
    import pickle
    layer = mha.MultiheadAttention(16, 2, batch_first=True, seed=2, rotary_dim=6, rotary_base=500000.0,
                                   rotary_interleaved=True)
    layer.save(tmp_path / "r.safetensors")
    x = np.random.default_rng(3).standard_normal((1, 5, 16)).astype(np.float32)
    for other in (mha.load(tmp_path / "r.safetensors"), pickle.loads(pickle.dumps(layer))):
        assert (other.rotary_dim, other.rotary_base, other.rotary_interleaved) == (6, 500000.0, True)
        np.testing.assert_array_equal(other(x, x, x)[0], layer(x, x, x)[0])
    assert "rotary_dim=6" in repr(layer) and mha.MultiheadAttention(16, 2).rotary_dim is None
