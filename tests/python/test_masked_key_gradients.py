"""A NaN or Inf at a key position no query sees changes nothing, parameter gradients included.

The layer's key and value projections have the gradients dW_k = dK^T X_k and dW_v = dV^T X_v: a masked
key's row of dK is 0, and IEEE's 0 * NaN is NaN, so a product over the rows lets the poison of a padded
key's input reach in_proj_weight (issue 30). The rule: for every way a key can be hidden from every query
(key_padding_mask, key_lengths, a boolean attn_mask column, an additive -inf column, a window, through
add_bias_kv / add_zero_attn), every output and every gradient (query, key, value, each parameter) is
bitwise that of the same call with the poisoned rows set to 0; and a poison at a key some query sees
still reaches dW_k (it must not be hidden). float32, float64, bfloat16 and mha.torch.

Legend: B batch, L queries, S keys, E = d_model.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mha

B, L, S, E, H = 2, 3, 6, 8, 2
HIDDEN = 4  # the key position that each mask hides from every query of batch 0 (windows hide 0..2)


def masks_hiding(kind, dtype):
    """Forward keyword arguments that hide key HIDDEN (or keys 0..2 for the window) of batch 0."""
    if kind == "key_padding_mask":
        m = np.zeros((B, S), bool)
        m[0, HIDDEN] = True
        return {"key_padding_mask": m}
    if kind == "float_key_padding_mask":
        m = np.zeros((B, S), dtype)
        m[0, HIDDEN] = -np.inf
        return {"key_padding_mask": m}
    if kind == "key_lengths":
        return {"key_lengths": [HIDDEN, S]}  # batch 0 holds keys 0..HIDDEN-1
    if kind == "bool_attn_mask":
        m = np.zeros((L, S), bool)
        m[:, HIDDEN] = True
        return {"attn_mask": m}
    if kind == "additive_attn_mask":
        m = np.zeros((L, S), dtype)
        m[:, HIDDEN] = -np.inf
        return {"attn_mask": m}
    assert kind == "window"
    return {"window": (1, 0)}  # queries at positions 3..5 see keys 2..5: key 0 and 1 are unseen


def hidden_rows(kind):
    if kind == "window":
        return [(b, j) for b in range(B) for j in (0, 1)]
    if kind in ("bool_attn_mask", "additive_attn_mask"):
        return [(b, HIDDEN) for b in range(B)]
    return [(0, j) for j in range(HIDDEN, S)] if kind == "key_lengths" else [(0, HIDDEN)]


def run(layer, query, key, value, masks):
    out, _ = layer(query, key, value, need_weights=False, **masks)
    grads = layer.backward(np.ones_like(out))
    return out, grads


def expect_bitwise_equal(got, clean):
    out, grads = got
    out_c, grads_c = clean
    assert np.array_equal(out, out_c)
    assert grads.keys() == grads_c.keys()
    for name in grads:
        assert np.array_equal(grads[name], grads_c[name]), name


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["key_padding_mask", "float_key_padding_mask", "key_lengths", "bool_attn_mask",
                             "additive_attn_mask", "window"]),
       dtype=st.sampled_from(["float32", "float64", "bfloat16"]),
       poison=st.sampled_from([np.nan, np.inf, -np.inf]), where=st.sampled_from(["key", "value", "both"]),
       packed=st.booleans(), extra=st.sampled_from([None, "add_bias_kv", "add_zero_attn"]), seed=st.integers(0, 99))
def test_a_poisoned_key_no_query_sees_changes_no_gradient(kind, dtype, poison, where, packed, extra, seed):
    if kind == "window" and extra:
        return  # windows are refused with the appended positions
    np_dtype = np.float64 if dtype == "float64" else np.float32
    rng = np.random.default_rng(seed)
    kdim = E if packed else 5  # packed: in_proj_weight; else separate k_proj_weight / v_proj_weight
    options = {extra: True} if extra else {}
    layer = mha.MultiheadAttention(E, H, kdim=kdim, vdim=kdim, batch_first=True, dtype=dtype, seed=seed, **options)
    layer.train()
    query = rng.uniform(-1, 1, (B, L, E)).astype(np_dtype)
    key = rng.uniform(-1, 1, (B, S, kdim)).astype(np_dtype)
    value = rng.uniform(-1, 1, (B, S, kdim)).astype(np_dtype)
    masks = masks_hiding(kind, np_dtype)
    clean_key, clean_value = key.copy(), value.copy()
    for b, j in hidden_rows(kind):
        if where in ("key", "both"):
            key[b, j, 1] = poison
            clean_key[b, j] = 0
        if where in ("value", "both"):
            value[b, j, 2] = poison
            clean_value[b, j] = 0
    poisoned = run(layer, query, key, value, masks)
    clean = run(layer, query, clean_key, clean_value, masks)
    expect_bitwise_equal(poisoned, clean)


def test_a_poisoned_key_a_query_sees_still_reaches_the_key_weights_gradient():
    """The other half of the rule: the fix must not hide a poison that the math carries."""
    layer = mha.MultiheadAttention(E, H, batch_first=True, seed=1)
    layer.train()
    rng = np.random.default_rng(2)
    query, key = rng.uniform(-1, 1, (B, L, E)).astype(np.float32), rng.uniform(-1, 1, (B, S, E)).astype(np.float32)
    key[0, HIDDEN, 1] = np.nan
    out, _ = layer(query, key, key.copy(), need_weights=False)
    grads = layer.backward(np.ones_like(out))
    assert np.isnan(grads["in_proj_weight"][E:2 * E]).any()  # the k rows of in_proj_weight


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_mha_torch_parameter_gradients_ignore_a_padded_nan(dtype):
    torch = pytest.importorskip("torch")
    import mha.torch as mt

    t_dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    layer = mt.MultiheadAttention(E, H, batch_first=True, dtype=t_dtype)
    query = torch.rand(B, L, E, dtype=t_dtype)
    key = torch.rand(B, S, E, dtype=t_dtype)
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[0, HIDDEN] = True

    def gradients(key):
        layer.zero_grad()
        q, k = query.clone().requires_grad_(), key.clone().requires_grad_()
        out, _ = layer(q, k, k, key_padding_mask=padding, need_weights=False)
        out.sum().backward()
        return [out.detach(), q.grad, k.grad] + [p.grad.clone() for p in layer.parameters()]

    poisoned_key, clean_key = key.clone(), key.clone()
    poisoned_key[0, HIDDEN] = float("nan")
    clean_key[0, HIDDEN] = 0
    for got, clean in zip(gradients(poisoned_key), gradients(clean_key)):
        assert torch.equal(got, clean)
