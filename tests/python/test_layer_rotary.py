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
from layer_reference import layer_reference


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


def check_within_the_rule(got, ref64, ref32, dtype):
    """Each named result within 3x the float32 reference's own error (float64 layers: 1e-10 relative)."""
    for name in ref64:
        g, r64, r32 = (np.asarray(x[name], np.float64) for x in (got, ref64, ref32))
        err = np.abs(g - r64).max()
        bound = (1e-10 * max(1.0, np.abs(r64).max()) if dtype == np.float64
                 else 3 * np.abs(r32 - r64).max() + 1e-5 * max(1.0, np.abs(r64).max()))
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"


POSITION_CASES = [  # (h_kv, r, interleaved, causal, L, S, shared, int32)
    (4, 6, False, True, 7, 7, False, False),  # self-attention: the keys reuse positions
    (2, 4, True, False, 5, 9, False, True),   # cross-attention: key_positions of their own
    (1, 6, False, False, 6, 6, True, False),  # [L] positions shared by the batch rows
    (4, 2, True, True, 1, 4, True, True),
]


@pytest.mark.parametrize("h_kv,r,interleaved,causal,L,S,shared,int32", POSITION_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_explicit_positions_match_the_reference(h_kv, r, interleaved, causal, L, S, shared, int32, dtype):
    layer = mha.MultiheadAttention(24, 4, num_kv_heads=h_kv, batch_first=True, dtype=dtype, seed=9, rotary_dim=r,
                                   rotary_interleaved=interleaved)
    rng = np.random.default_rng(L * 10 + S)
    B = 3
    query = rng.standard_normal((B, L, 24)).astype(dtype)
    key = query if L == S else rng.standard_normal((B, S, 24)).astype(dtype)
    dout = rng.standard_normal((B, L, 24)).astype(dtype)
    int_dtype = np.int32 if int32 else np.int64
    positions = rng.integers(0, 100000, (L,) if shared else (B, L)).astype(int_dtype)  # far positions, any order
    key_positions = None if L == S else rng.integers(0, 100000, (S,) if shared else (B, S)).astype(int_dtype)
    out, _ = layer(query, key, key, is_causal=causal, need_weights=False, positions=positions,
                   key_positions=key_positions)
    got = layer.backward(dout)
    got["key"] = got["key"] + got["value"]  # the reference's key input plays both roles
    got["out"] = out
    args = (layer.state_dict(), query, key, 4, h_kv, r, 10000.0, interleaved, causal)
    places = dict(positions=positions, key_positions=positions if key_positions is None else key_positions)
    (out64, ref64), (out32, ref32) = (layer_reference(*args, t, dout, **places) for t in (torch.float64, torch.float32))
    ref64["out"], ref32["out"] = out64, out32
    check_within_the_rule(got, ref64, ref32, dtype)
    default, _ = layer(query, key, key, is_causal=causal, need_weights=False)
    assert np.abs(default - out).max() > 1e-4  # the positions act


def test_a_left_padded_batch_equals_each_sequence_alone():
    """Left padding (a serving batch): sequence b's n_b tokens at the right end of its row, pads masked by
    key_padding_mask, positions counting from 0 at its first token. Its rows (and the parameter gradients of
    a loss on them) equal the layer's on the sequence alone, unpadded, where positions are the default."""
    layer = mha.MultiheadAttention(16, 4, num_kv_heads=2, batch_first=True, dtype=np.float64, seed=3, rotary_dim=4)
    rng = np.random.default_rng(4)
    lengths, L = [5, 2, 8], 8
    x = rng.standard_normal((3, L, 16))
    dout = rng.standard_normal((3, L, 16))
    pad = np.arange(L)[None, :] < (L - np.array(lengths))[:, None]  # [B, L] True at the pads
    dout[pad] = 0  # the loss reads real rows only
    positions = np.maximum(np.arange(L)[None, :] - (L - np.array(lengths))[:, None], 0)  # [B, L]
    out, _ = layer(x, x, x, key_padding_mask=pad, is_causal=True, need_weights=False, positions=positions)
    grads = layer.backward(dout)
    summed = {}
    for b, n in enumerate(lengths):
        alone, _ = layer(x[b:b + 1, L - n:], x[b:b + 1, L - n:], x[b:b + 1, L - n:], is_causal=True,
                         need_weights=False)
        np.testing.assert_allclose(out[b, L - n:], alone[0], rtol=0, atol=1e-12)
        one = layer.backward(dout[b:b + 1, L - n:])
        for name, g in one.items():
            if name in ("query", "key", "value"):
                np.testing.assert_allclose(grads[name][b, L - n:], g[0], rtol=0, atol=1e-12)
            else:
                summed[name] = summed.get(name, 0) + g
    for name, g in summed.items():
        np.testing.assert_allclose(grads[name], g, rtol=0, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("kwargs,match", [
    (dict(positions=np.zeros((2, 5), np.int64)), r"positions: expected \[L\] = \[4\] or \[B, L\] = \[2, 4\]"),
    (dict(positions=np.array([0, 1, -1, 2])), r"positions: expected positions >= 0, got -1 at \[2\]"),
    (dict(positions=np.zeros(4, np.float32)), r"positions: expected an int64 or int32 array"),
    (dict(key_positions=np.zeros(4, np.int64)), r"key_positions: given without positions"),
    (dict(positions=np.arange(4), key_positions=np.zeros((3, 4), np.int64)), r"key_positions: expected \[S\]"),
    (dict(positions=np.arange(4), cu_seqlens=[0, 4]), r"positions: not with cu_seqlens"),
])
def test_bad_positions_are_refused_naming_them(kwargs, match):
    layer = mha.MultiheadAttention(16, 4, batch_first=True, seed=1, rotary_dim=4)
    x = np.ones((2, 4, 16), np.float32)
    if "cu_seqlens" in kwargs:
        x = x[0]
    with pytest.raises(mha.Error, match=match):
        layer(x, x, x, **kwargs)


def test_positions_are_refused_where_the_layer_places_them():
    x = np.ones((1, 4, 16), np.float32)
    with pytest.raises(mha.Error, match=r"positions: the layer has no rotary embedding"):
        mha.MultiheadAttention(16, 4, batch_first=True)(x, x, x, positions=np.arange(4))
    layer = mha.MultiheadAttention(16, 4, batch_first=True, seed=1, rotary_dim=4)
    with pytest.raises(mha.Error, match=r"key_positions: required with positions when key has S = 3"):
        layer(x, x[:, :3], x[:, :3], positions=np.arange(4))
