"""Plain NumPy references for the tests: the math of "Attention Is All You Need" written out.

Legend: B batch, h heads, L queries, S keys, E embed_dim, d_k / d_v per-head widths.
Every function computes in `dtype` (float64 for the truth, float32 to measure what plain float32
arithmetic loses, which sets the tolerances).
"""
import numpy as np


def error_bound(err32):
    """The tolerance of the suite: twice a plain float32 implementation's error, plus 1e-6."""
    return 2.0 * err32 + 1e-6


def round_to_bfloat16(x):
    """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32: keeps the
    top 16 bits of each float32 after adding half of the dropped part (0x7FFF, +1 when the kept part
    is odd). Finite inputs only (what the tests feed)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).reshape(np.shape(x))


def max_abs_diff(a, b):
    """max |a - b| in float64 (0 for empty arrays)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def softmax_rows(logits):
    """Softmax over the last axis; a row whose logits are all -inf gives 0 (mha's defined result)."""
    if logits.shape[-1] == 0:
        return logits.copy()
    row_max = logits.max(axis=-1, keepdims=True)
    dead = np.isneginf(row_max)
    e = np.exp(logits - np.where(dead, 0, row_max))
    total = e.sum(axis=-1, keepdims=True)
    return np.where(dead, 0, e / np.where(dead, 1, total)).astype(logits.dtype)


def causal_forbidden(L, S):
    """[L, S] bool, True where query i may not see key j: j > i + S - L (bottom-right aligned)."""
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    return j > i + S - L


def additive_mask(B, h, L, S, attn_mask=None, key_padding_mask=None, causal=False, dtype=np.float64):
    """All masks combined into one additive [B, h, L, S] mask (0 allowed, -inf forbidden)."""
    add = np.zeros((B, h, L, S), dtype)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.ndim == 3:
            m = m.reshape(B, h, L, S)
        elif m.ndim == 4:
            m = m.reshape(B, h, L, S)
        if m.dtype.kind in "biu":
            add = add + np.where(m != 0, -np.inf, 0).astype(dtype)
        else:
            add = add + m.astype(dtype)
    if key_padding_mask is not None:
        kpm = np.asarray(key_padding_mask)
        if kpm.dtype.kind in "biu":
            add = add + np.where(kpm != 0, -np.inf, 0).astype(dtype)[:, None, None, :]
        else:
            add = add + kpm.astype(dtype)[:, None, None, :]
    if causal:
        add = add + np.where(causal_forbidden(L, S), -np.inf, 0).astype(dtype)
    return add.astype(dtype)


def sdpa_reference(q, k, v, attn_mask=None, key_padding_mask=None, causal=False, scale=None,
                   dtype=np.float64):
    """q [B, h, L, d_k], k [B, h, S, d_k], v [B, h, S, d_v] -> (out [B, h, L, d_v], weights [B, h, L, S])."""
    q, k, v = (np.asarray(x).astype(dtype) for x in (q, k, v))
    B, h, L, d_k = q.shape
    S = k.shape[2]
    if scale is None:
        scale = 1.0 / np.sqrt(d_k)
    logits = (q @ np.swapaxes(k, -1, -2)) * np.array(scale, dtype=dtype)
    logits = logits + additive_mask(B, h, L, S, attn_mask, key_padding_mask, causal, dtype)
    weights = softmax_rows(logits)
    return weights @ v, weights


def split_in_proj(params, num_heads, d_k, d_v):
    """(W_q, W_k, W_v, b_q, b_k, b_v) from a state_dict, packed or separate; biases None if absent."""
    hk, hv = num_heads * d_k, num_heads * d_v
    if "in_proj_weight" in params:
        w = params["in_proj_weight"]
        w_q, w_k, w_v = w[:hk], w[hk:2 * hk], w[2 * hk:2 * hk + hv]
    else:
        w_q, w_k, w_v = params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"]
    b = params.get("in_proj_bias")
    if b is None:
        return w_q, w_k, w_v, None, None, None
    return w_q, w_k, w_v, b[:hk], b[hk:2 * hk], b[2 * hk:2 * hk + hv]


def project_to_heads(p, x_q, x_k, x_v, h, d_k, d_v, add, add_zero_attn, dtype):
    """The projected inputs per head, with the bias_k / zero-attention positions appended as PyTorch
    does: (q [B, h, L, d_k], k [B, h, S', d_k], v [B, h, S', d_v], add [B, h, L, S'] with the appended
    positions allowed). x_*: batch_first [B, T, width]; add [B, h, L, S] covers the S input keys."""
    B, L = x_q.shape[0], x_q.shape[1]
    w_q, w_k, w_v, b_q, b_k, b_v = split_in_proj(p, h, d_k, d_v)
    q, k, v = x_q @ w_q.T, x_k @ w_k.T, x_v @ w_v.T
    if b_q is not None:
        q, k, v = q + b_q, k + b_k, v + b_v
    extra = []
    if "bias_k" in p:
        extra.append((p["bias_k"].reshape(1, 1, h * d_k), p["bias_v"].reshape(1, 1, h * d_v)))
    if add_zero_attn:
        extra.append((np.zeros((1, 1, h * d_k), dtype), np.zeros((1, 1, h * d_v), dtype)))
    for ek, ev in extra:
        k = np.concatenate([k, np.broadcast_to(ek, (B, 1, h * d_k))], axis=1)
        v = np.concatenate([v, np.broadcast_to(ev, (B, 1, h * d_v))], axis=1)
        add = np.concatenate([add, np.zeros((B, h, L, 1), dtype)], axis=3)
    S2 = k.shape[1]
    qh = q.reshape(B, L, h, d_k).transpose(0, 2, 1, 3)
    kh = k.reshape(B, S2, h, d_k).transpose(0, 2, 1, 3)
    vh = v.reshape(B, S2, h, d_v).transpose(0, 2, 1, 3)
    return qh, kh, vh, add


def mha_reference(params, query, key, value, num_heads, d_k, d_v, attn_mask=None,
                  key_padding_mask=None, causal=False, add_zero_attn=False, dtype=np.float64,
                  weights_override=None):
    """Multi-head attention from a state_dict, batch_first inputs.

    query [B, L, E], key [B, S, kdim], value [B, S, vdim]; attn_mask [L, S] or [B*h, L, S] and
    key_padding_mask [B, S] cover the S input keys (the bias_k / zero positions are always
    allowed). weights_override [B, h, L, S'] replaces the softmax (to check dropout).
    Returns (out [B, L, E], per-head weights [B, h, L, S']).
    """
    p = {name: np.asarray(value_).astype(dtype) for name, value_ in params.items()}
    query, key, value = (np.asarray(x).astype(dtype) for x in (query, key, value))
    h = num_heads
    B, L, _ = query.shape
    S = key.shape[1]
    add = additive_mask(B, h, L, S, attn_mask, key_padding_mask, causal, dtype)
    qh, kh, vh, add = project_to_heads(p, query, key, value, h, d_k, d_v, add, add_zero_attn, dtype)
    logits = (qh @ kh.transpose(0, 1, 3, 2)) * np.array(1.0 / np.sqrt(d_k), dtype=dtype) + add
    weights = softmax_rows(logits) if weights_override is None else np.asarray(weights_override).astype(dtype)
    heads = (weights @ vh).transpose(0, 2, 1, 3).reshape(B, L, h * d_v)
    out = heads @ p["out_proj.weight"].T
    if "out_proj.bias" in p:
        out = out + p["out_proj.bias"]
    return out, weights
