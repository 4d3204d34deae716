"""A float key_padding_mask is added to the logits of its key, passed to the kernels as a per-key bias
([B, S], O(B S) memory) rather than expanded to a [B*h, L, S] attn_mask."""
import numpy as np
import pytest

import mha


@pytest.mark.parametrize("kernel", [mha.Kernel.flash, mha.Kernel.reference])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_equals_the_same_values_as_an_additive_attn_mask(kernel, dtype):
    rng = np.random.default_rng(0)
    B, h, L, S, d = 2, 3, 5, 300, 8  # S crosses the fused kernel's key block
    q, k, v = (rng.standard_normal((B, h, n, d)).astype(dtype) for n in (L, S, S))
    kpm = rng.standard_normal((B, S)).astype(dtype)
    kpm[0, 7] = kpm[1, 100] = -np.inf
    full = np.broadcast_to(kpm[:, None, None, :], (B, h, L, S)).reshape(B * h, L, S).copy()
    got = mha.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, need_weights=True, kernel=kernel)
    want = mha.scaled_dot_product_attention(q, k, v, attn_mask=full, need_weights=True, kernel=kernel)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert (got[1][0, :, :, 7] == 0).all() and (got[1][1, :, :, 100] == 0).all()


@pytest.mark.parametrize("extra", [{}, {"add_bias_kv": True, "add_zero_attn": True}])
def test_layer_adds_it_to_a_bool_attn_mask_and_key_lengths(extra):
    rng = np.random.default_rng(1)
    B, L, S, E = 2, 4, 6, 8
    m = mha.MultiheadAttention(E, 2, batch_first=True, seed=3, **extra)
    m.eval()
    x, y = rng.standard_normal((B, L, E)).astype(np.float32), rng.standard_normal((B, S, E)).astype(np.float32)
    kpm = rng.standard_normal((B, S)).astype(np.float32)
    bool_mask = np.zeros((L, S), bool)
    bool_mask[1, 2] = True
    got, w = m(x, y, y, key_padding_mask=kpm, attn_mask=bool_mask, key_lengths=[6, 4])
    # The same as one additive attn_mask per (b, head): kpm added, -inf where the bool mask or the
    # lengths forbid.
    additive = np.broadcast_to(kpm[:, None, None, :], (B, 2, L, S)).copy()
    additive[:, :, 1, 2] = -np.inf
    additive[1, :, :, 4:] = -np.inf
    want, w_want = m(x, y, y, attn_mask=additive.reshape(B * 2, L, S))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(w, w_want, rtol=1e-6, atol=1e-6)


def test_other_float_dtype_is_converted_and_wrong_shape_named():
    rng = np.random.default_rng(2)
    m = mha.MultiheadAttention(8, 2, batch_first=True, seed=1)
    m.eval()
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    kpm = rng.standard_normal((2, 3))
    a, _ = m(x, x, x, key_padding_mask=kpm)  # float64 mask, float32 layer
    b, _ = m(x, x, x, key_padding_mask=kpm.astype(np.float32))
    np.testing.assert_array_equal(a, b)
    with pytest.raises(mha.Error, match="key_padding_mask"):
        m(x, x, x, key_padding_mask=np.zeros((2, 4), np.float32))
