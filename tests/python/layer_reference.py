"""The float64 truth for the layer's tests: mha.MultiheadAttention's math written out in torch (any dtype), with
rotary positions from their formula (inv_freq_i = base^(-2i / r), angle = position * inv_freq_i, pairs
(i, i + r/2) or (2i, 2i + 1)), sinks as one more logit column dropped after the softmax, and torch's autograd
for every gradient. Written here, not derived from the library.

Legend: B batch, L queries, S keys, E embed_dim, h heads, h_kv key/value heads, d per-head width, r rotary_dim.
"""
import numpy as np
import torch


def rotate(x, positions, r, base, interleaved):
    """x [B, heads, T, d] (torch) rotated at positions [T] or [B, T] (float64 angles)."""
    half = r // 2
    inv_freq = base ** (-2.0 * np.arange(half) / r)
    positions = np.asarray(positions, np.float64)
    angle = positions[..., None] * inv_freq  # [T, r/2] or [B, T, r/2]
    if angle.ndim == 3:
        angle = angle[:, None]  # [B, 1, T, r/2]: every head of batch row b at its row's positions
    cos, sin = (torch.tensor(f(angle), dtype=x.dtype) for f in (np.cos, np.sin))
    if interleaved:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
    else:
        a, b = x[..., :half], x[..., half:r]
    ya, yb = a * cos - b * sin, b * cos + a * sin
    rotated = torch.stack([ya, yb], dim=-1).flatten(-2) if interleaved else torch.cat([ya, yb], dim=-1)
    return torch.cat([rotated, x[..., r:]], dim=-1)


def layer_reference(state, query, key, h, h_kv, r, base, interleaved, causal, dtype, dout=None, positions=None,
                    key_positions=None, key_padding=None):
    """The layer with parameters `state` (a state_dict; "sinks" [h] there adds the sinks) over query [B, L, E]
    and key [B, S, E] (which also plays the value), in torch `dtype`. r: rotary_dim (0 or None: no rotation);
    positions [L] / [B, L] and key_positions [S] / [B, S] (None: i + S - L and j); key_padding [B, S] True
    where a key is padding. Returns out, or (out, gradients by name: the parameters', "query", "key")
    given dout."""
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
    if r:
        q = rotate(q, np.arange(L) + S - L if positions is None else positions, r, base, interleaved)  # i + S - L
        k = rotate(k, np.arange(S) if key_positions is None else key_positions, r, base, interleaved)
    k, v = (x.repeat_interleave(h // h_kv, dim=1) for x in (k, v))
    logits = q @ k.transpose(-1, -2) / np.sqrt(d)
    if causal:
        logits = logits.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(S - L + 1), -np.inf)
    if key_padding is not None:
        logits = logits.masked_fill(torch.tensor(np.asarray(key_padding))[:, None, None, :], -np.inf)
    if "sinks" in t:  # one more logit per row, with no value
        logits = torch.cat([logits, t["sinks"][None, :, None, None].expand(B, h, L, 1)], dim=-1)
    context = (torch.softmax(logits, -1)[..., :S] @ v).transpose(1, 2).reshape(B, L, h * d)
    out = context @ t["out_proj.weight"].T + t["out_proj.bias"]
    if dout is None:
        return out.detach().numpy()
    out.backward(torch.tensor(np.asarray(dout, np.float64), dtype=dtype))
    grads = {name: p.grad.numpy() for name, p in t.items()}
    grads["query"], grads["key"] = xq.grad.numpy(), xk.grad.numpy()
    return out.detach().numpy(), grads
