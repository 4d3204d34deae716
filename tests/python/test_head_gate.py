"""The per-head gate: ``head_gate=`` of mha.MultiheadAttention and mha.torch.MultiheadAttention.

    out = Concat(g_1 head_1, ..., g_h head_h) W^O + b_O

PyTorch has no gate, but the same thing is torch's layer with the columns of head i in
out_proj.weight (i*d_v .. (i+1)*d_v) multiplied by g_i: torch.nn.functional.multi_head_attention_forward
with out_proj_weight = W^O * g (one call per batch for a [B, h] gate). Its autograd gives every
gradient, the gate's included (d/dg of torch's output). mha's float64 layer must agree with torch's
float64 to ~1e-9 relative; its float32 layer within 2 * torch float32's error + 1e-5 of the largest
value (the rule of test_backward.py). Hypothesis draws the shapes, layouts, masks and gates (0, 1, -1
and anything in [-2, 2]).

Legend: B batch, h heads, L queries, S keys, E embed_dim, d_v per-head value width.
"""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mha
import mha.torch

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64}


@st.composite
def gate_cases(draw):
    layout = draw(st.sampled_from(["batch_first", "seq_first", "unbatched"]))
    B = 1 if layout == "unbatched" else draw(st.integers(1, 3))
    h, d = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    L, S = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    per_batch = layout != "unbatched" and draw(st.booleans())
    value = st.one_of(st.sampled_from([0.0, 1.0, -1.0]), st.floats(-2.0, 2.0, width=32))
    gate = draw(st.lists(value, min_size=B * h if per_batch else h, max_size=B * h if per_batch else h))
    return dict(
        seed=draw(st.integers(0, 2**31)), layout=layout, B=B, L=L, S=S, h=h, d=d,
        gate=np.array(gate, np.float64).reshape((B, h) if per_batch else (h,)),
        kdim=draw(st.sampled_from([None, 3])), bias=draw(st.booleans()),
        add_bias_kv=draw(st.booleans()), add_zero_attn=draw(st.booleans()),
        mask=draw(st.sampled_from(["none", "bool2d", "float3d", "causal"])) if L <= S else "none",
        kpm=draw(st.booleans()))


def make_data(c):
    """Seq-first inputs [L, B, *], dout, masks (no fully masked rows: torch gives NaN there) and a
    state_dict with nonzero biases."""
    r = np.random.default_rng(c["seed"])
    B, L, S, h = c["B"], c["L"], c["S"], c["h"]
    E = h * c["d"]
    kdim = c["kdim"] or E
    x = {"query": r.normal(size=(L, B, E)), "key": r.normal(size=(S, B, kdim)), "value": r.normal(size=(S, B, kdim))}
    dout = r.normal(size=(L, B, E))
    kpm = None
    if c["kpm"]:
        kpm = r.random((B, S)) < 0.3
        kpm[:, 0] = False
    mask, is_causal = None, c["mask"] == "causal"
    if c["mask"] == "bool2d":
        mask = r.random((L, S)) < 0.3
        mask[:, 0] = False
    elif c["mask"] == "float3d":
        mask = np.where(r.random((B * h, L, S)) < 0.2, -np.inf, r.normal(size=(B * h, L, S)))
        mask[..., 0] = 0.0
    torch.manual_seed(c["seed"] % 1000)
    module = torch.nn.MultiheadAttention(E, h, bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                         add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["kdim"])
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.5)
    state = {name: v.numpy().astype(np.float64) for name, v in module.state_dict().items()}
    return x, dout, kpm, mask, is_causal, state


def torch_gated(c, x, dout, kpm, mask, is_causal, state, dtype):
    """torch's gated layer in `dtype`: (out [L, B, E], weights [B, L, S'], {name: gradient}) with the
    gradients of sum(out * dout) for query, key, value, every parameter and "head_gate"."""
    B, L, S, h = c["B"], c["L"], c["S"], c["h"]
    E = h * c["d"]
    module = torch.nn.MultiheadAttention(E, h, bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                         add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["kdim"],
                                         dtype=dtype)
    module.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    inputs = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in x.items()}
    gate = torch.tensor(c["gate"], dtype=dtype, requires_grad=True)
    if is_causal:  # mha's causal: query i sees key j <= i + S - L
        mask = np.triu(np.ones((L, S), bool), k=S - L + 1)
    outs, weights = [], []
    for b in range(B):
        g = gate[b] if gate.dim() == 2 else gate
        out_proj_weight = module.out_proj.weight * g.repeat_interleave(c["d"])  # column block i times g_i
        mask_b = None if mask is None else torch.tensor(mask if mask.ndim == 2 else mask[b * h:(b + 1) * h])
        out, w = torch.nn.functional.multi_head_attention_forward(
            inputs["query"][:, b:b + 1], inputs["key"][:, b:b + 1], inputs["value"][:, b:b + 1], E, h,
            module.in_proj_weight, module.in_proj_bias, module.bias_k, module.bias_v, c["add_zero_attn"], 0.0,
            out_proj_weight, module.out_proj.bias, training=True,
            key_padding_mask=None if kpm is None else torch.tensor(kpm[b:b + 1]), need_weights=True,
            attn_mask=None if mask_b is None else (mask_b if mask_b.dtype == torch.bool else mask_b.to(dtype)),
            use_separate_proj_weight=not module._qkv_same_embed_dim, q_proj_weight=module.q_proj_weight,
            k_proj_weight=module.k_proj_weight, v_proj_weight=module.v_proj_weight)
        outs.append(out)
        weights.append(w)
    out = torch.cat(outs, dim=1)
    (out * torch.tensor(dout, dtype=dtype)).sum().backward()
    grads = {k: t.grad.numpy() for k, t in inputs.items()}
    grads.update({name: p.grad.numpy() for name, p in module.named_parameters()})
    grads["head_gate"] = gate.grad.numpy()
    return out.detach().numpy(), torch.cat(weights).detach().numpy(), grads


def to_layout(a, layout):
    """A seq-first [T, B, *] array in `layout`."""
    if layout == "batch_first":
        return np.ascontiguousarray(a.transpose(1, 0, 2))
    return a[:, 0] if layout == "unbatched" else a


def from_layout(a, layout):
    """An array in `layout` as seq-first [T, B, *]."""
    if layout == "batch_first":
        return a.transpose(1, 0, 2)
    return a[:, None] if layout == "unbatched" else a


def mha_gated(c, x, dout, kpm, mask, is_causal, state, dtype, kernel=mha.Kernel.flash):
    """mha's gated layer in `dtype`: (out [L, B, E], weights [B, L, S'], {name: gradient}) as torch_gated."""
    layout = c["layout"]
    E = c["h"] * c["d"]
    ours = mha.MultiheadAttention(E, c["h"], bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                  add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["kdim"],
                                  batch_first=layout == "batch_first", dtype=dtype).train()
    ours.kernel = kernel
    ours.load_state_dict(state)
    arrays = {k: to_layout(v, layout).astype(dtype) for k, v in x.items()}
    unbatched = layout == "unbatched"
    out, weights = ours(arrays["query"], arrays["key"], arrays["value"],
                        key_padding_mask=None if kpm is None else (kpm[0] if unbatched else kpm),
                        attn_mask=mask, is_causal=is_causal, head_gate=c["gate"].astype(dtype))
    grads = ours.backward(to_layout(dout, layout).astype(dtype))
    assert list(grads) == ["query", "key", "value"] + list(state) + ["head_gate"]
    assert grads["head_gate"].shape == c["gate"].shape and grads["head_gate"].dtype == dtype
    for k in x:
        grads[k] = from_layout(grads[k], layout)
    return from_layout(out, layout), weights[None] if unbatched else weights, grads


def max_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def scale(a):
    return max(1.0, float(np.max(np.abs(a)))) if np.size(a) else 1.0


@SETTINGS
@given(c=gate_cases())
def test_gated_layer_against_torch_with_scaled_out_proj(c):
    data = make_data(c)
    out64, w64, g64 = torch_gated(c, *data, torch.float64)
    out32, w32, g32 = torch_gated(c, *data, torch.float32)
    pairs = [("out", out64, out32), ("weights", w64, w32)] + [(k, g64[k], g32[k]) for k in g64]
    for dtype in (np.float64, np.float32):
        out, weights, grads = mha_gated(c, *data, dtype)
        ours = {"out": out, "weights": weights, **grads}
        for name, want, torch32 in pairs:
            bound = (1e-9 if dtype == np.float64 else 2 * max_diff(torch32, want) + 1e-5) * scale(want)
            assert max_diff(ours[name], want) <= bound, (name, np.dtype(dtype).name)


def test_gradient_of_gate_matches_central_differences():
    c = dict(seed=5, layout="batch_first", B=2, L=3, S=4, h=3, d=2, gate=np.array([[0.0, -1.0, 0.5], [2.0, 1.0, 0.0]]),
             kdim=None, bias=True, add_bias_kv=True, add_zero_attn=False, mask="causal", kpm=True)
    data = make_data(c)
    dout = data[1]
    _, _, grads = mha_gated(c, *data, np.float64)
    eps = 1e-6
    for index in np.ndindex(c["gate"].shape):
        loss = []
        for step in (eps, -eps):
            shifted = dict(c, gate=c["gate"].copy())
            shifted["gate"][index] += step
            out, _, _ = mha_gated(shifted, *data, np.float64)
            loss.append(float(np.sum(out * dout)))
        assert abs(grads["head_gate"][index] - (loss[0] - loss[1]) / (2 * eps)) <= 1e-7 * scale(grads["head_gate"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gate_of_ones_is_bitwise_no_gate(dtype):
    r = np.random.default_rng(2)
    layer = mha.MultiheadAttention(8, 4, batch_first=True, dtype=dtype, seed=3).train()
    x = r.normal(size=(2, 5, 8)).astype(dtype)
    dout = r.normal(size=(2, 5, 8)).astype(dtype)
    plain = layer(x, x, x, is_causal=True)
    plain_grads = layer.backward(dout)
    for gate in (np.ones(4), np.ones((2, 4), np.float32)):
        gated = layer(x, x, x, is_causal=True, head_gate=gate)
        gated_grads = layer.backward(dout)
        assert plain[0].tobytes() == gated[0].tobytes() and plain[1].tobytes() == gated[1].tobytes()
        assert set(gated_grads) == set(plain_grads) | {"head_gate"}
        for name, g in plain_grads.items():
            assert g.tobytes() == gated_grads[name].tobytes(), name


def test_forward_cached_with_gate_equals_forward():
    r = np.random.default_rng(4)
    layer = mha.MultiheadAttention(8, 4, batch_first=True, dtype=np.float64, seed=1).eval()
    x = r.normal(size=(2, 6, 8))
    gate = np.array([[1.0, 0.0, -0.5, 2.0], [0.0, 0.0, 1.0, 0.25]])
    full, full_weights = layer(x, x, x, is_causal=True, head_gate=gate)
    cache = mha.KeyValueCache()
    layer.append_to_cache(cache, x, x)
    cached, cached_weights = layer.forward_cached(x, cache, is_causal=True, head_gate=gate)
    np.testing.assert_allclose(cached, full, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cached_weights, full_weights, rtol=1e-12, atol=1e-12)
    ungated, _ = layer.forward_cached(x, cache, is_causal=True)
    assert max_diff(ungated, full) > 1e-3


@pytest.mark.parametrize("gate,unbatched,message", [
    (np.ones(3), False, r"^head_gate: expected one value per head \(num_heads = 4\)"),
    (np.ones((3, 4)), False, r"^head_gate: expected batch size 2"),
    (np.ones((2, 4, 1)), False, r"^head_gate: expected shape"),
    (np.ones((1, 4)), True, r"^head_gate: expected shape \[h\] = \[4\] \(unbatched input\)"),
    (np.ones(4, np.int64), False, r"^head_gate"),
    (np.ones(4, bool), False, r"^head_gate"),
])
def test_bad_gates_raise_naming_head_gate(gate, unbatched, message):
    layer = mha.MultiheadAttention(8, 4, batch_first=True)
    x = np.zeros((5, 8) if unbatched else (2, 5, 8), np.float32)
    with pytest.raises(mha.Error, match=message):
        layer(x, x, x, head_gate=gate)


# ---- mha.torch -------------------------------------------------------------------------------------

def test_torch_module_gate_gradients_match_torch():
    c = dict(seed=9, layout="seq_first", B=3, L=4, S=5, h=2, d=3, gate=np.array([[0.0, 1.5], [-1.0, 0.5], [1.0, 1.0]]),
             kdim=None, bias=True, add_bias_kv=False, add_zero_attn=True, mask="bool2d", kpm=True)
    x, dout, kpm, mask, is_causal, state = make_data(c)
    out64, _, want = torch_gated(c, x, dout, kpm, mask, is_causal, state, torch.float64)
    module = mha.torch.MultiheadAttention(6, 2, add_zero_attn=True, dtype=torch.float64)
    module.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    inputs = {k: torch.tensor(v, requires_grad=True) for k, v in x.items()}
    gate = torch.tensor(c["gate"], requires_grad=True)
    out, _ = module(inputs["query"], inputs["key"], inputs["value"], key_padding_mask=torch.tensor(kpm),
                    attn_mask=torch.tensor(mask), head_gate=gate)
    (out * torch.tensor(dout)).sum().backward()
    assert max_diff(out.detach(), out64) <= 1e-9 * scale(out64)
    assert gate.grad.dtype == torch.float64 and gate.grad.shape == (3, 2)
    assert max_diff(gate.grad, want["head_gate"]) <= 1e-9 * scale(want["head_gate"])
    for k, t in inputs.items():
        assert max_diff(t.grad, want[k]) <= 1e-9 * scale(want[k]), k
    for name, p in module.named_parameters():
        assert max_diff(p.grad, want[name]) <= 1e-9 * scale(want[name]), name


def test_torch_module_gradcheck_float64():
    torch.manual_seed(0)
    module = mha.torch.MultiheadAttention(6, 3, batch_first=True, dtype=torch.float64)
    query = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    key = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    gate = torch.tensor([[0.0, -1.0, 0.5], [2.0, 1.0, 0.25]], dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda q, k, g: module(q, k, k, head_gate=g, need_weights=False)[0],
                             (query, key, gate))
    per_head = torch.tensor([0.5, 0.0, -2.0], dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda q, g: module(q, q, q, head_gate=g, need_weights=False)[0], (query, per_head))


def test_torch_module_gate_without_grad_and_float32_gate_on_bfloat16():
    module = mha.torch.MultiheadAttention(8, 4, batch_first=True)
    x = torch.randn(2, 3, 8, requires_grad=True)
    gate = torch.tensor([1.0, 0.0, 1.0, 1.0])
    out, _ = module(x, x, x, head_gate=gate)
    out.sum().backward()
    assert x.grad is not None and gate.grad is None
    module_bf16 = mha.torch.MultiheadAttention(8, 4, batch_first=True, dtype=torch.bfloat16)
    module_bf16.load_state_dict(module.state_dict())
    with torch.no_grad():
        off, _ = module_bf16(x.bfloat16(), x.bfloat16(), x.bfloat16(), head_gate=torch.zeros(4))
    assert torch.equal(off.float(), module_bf16.out_proj.bias.float().expand_as(off))
    with pytest.raises(mha.Error, match="^head_gate"):
        module(x, x, x, head_gate=[1.0, 1.0, 1.0, 1.0])
