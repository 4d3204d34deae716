"""mha.torch.scaled_dot_product_attention (the registered operator, python/torch_ops) against a float64
formulation of PyTorch 2.5's function written here with torch ops:

    softmax(q k^T * scale + mask) v,   GQA by repeat_interleave, is_causal = tril (top-left),
    window / ALiBi / softcap from their formulas (positions i' = i + S - L), sinks as an extra logit column.

The same formulation in float32 measures what plain float32 arithmetic loses: the kernel's error against
float64 must be within 2x of it (forward) and 3x (gradients of query, key, value and sinks), the suite's
rule. bfloat16 is held to 2x torch's own bfloat16 error. Then dropout (keep rate, torch.manual_seed),
strides, leading dims, and every refused argument.

Legend: N... leading dims, h query heads, h_kv key/value heads, L queries, S keys, E, E_v head widths.
"""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from test_properties import hypothesis_settings

mha_torch = pytest.importorskip("mha.torch")
import mha._torch_sdpa as torch_sdpa  # noqa: E402 (after torch is known to import)

sdpa = mha_torch.scaled_dot_product_attention
pytestmark = pytest.mark.skipif(not torch_sdpa.OPERATORS_LOADED,
                                reason="the operator library (libmha_torch_ops.so) was not built")


def reference(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, window=None,
              alibi_slopes=None, softcap=None, sinks=None, dtype=torch.float64):
    """PyTorch 2.5's math in `dtype`, with mha's variants; a row with no allowed key gives 0 (mha's rule)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    L, S, E = q.size(-2), k.size(-2), q.size(-1)
    if q.dim() >= 3 and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    s = q @ k.transpose(-2, -1) * (1 / math.sqrt(E) if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(L)[:, None] + S - L  # query positions, bottom-right aligned (window, ALiBi)
    j = torch.arange(S)[None, :]
    if alibi_slopes is not None:
        s = s - alibi_slopes.to(dtype)[:, None, None] * (i - j).abs().to(dtype)
    allowed = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        allowed &= j <= torch.arange(L)[:, None]  # torch.ones(L, S).tril(): top-left
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = allowed & attn_mask
    elif attn_mask is not None:
        s = s + attn_mask.to(dtype)
    s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        column = sinks.to(dtype)[:, None, None].expand(s.shape[:-1] + (1,))
        s = torch.cat([s, column], -1)
    dead = s.amax(-1, keepdim=True) == -math.inf
    p = torch.softmax(s.masked_fill(dead, 0), -1).masked_fill(dead, 0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


def assert_within(name, got, ref64, ref32, factor, floor=1e-6):
    """max|got - ref64| <= factor * max|ref32 - ref64| + floor * max(1, max|ref64|)."""
    got, ref64, ref32 = (t.detach().to(torch.float64) for t in (got, ref64, ref32))
    assert got.shape == ref64.shape, (name, got.shape, ref64.shape)
    assert torch.isfinite(got).all(), name
    if got.numel() == 0:
        return
    err = (got - ref64).abs().max().item()
    bound = factor * (ref32 - ref64).abs().max().item() + floor * max(1.0, ref64.abs().max().item())
    assert err <= bound, f"{name}: max|mha - fp64| = {err:.3g} > {bound:.3g}"


@st.composite
def cases(draw):
    """Shapes, masks, GQA and variants; the tensors come from a drawn seed."""
    lead = draw(st.sampled_from([(), (2,), (2, 1), (1, 3)]))
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2]))
    gqa = h != h_kv and (h_kv != 1 or draw(st.booleans()))
    L, S = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    E, E_v = draw(st.sampled_from([1, 3, 8, 16])), draw(st.sampled_from([1, 5, 8]))
    case = dict(lead=lead, h=h, h_kv=h_kv, L=L, S=S, E=E, E_v=E_v, seed=draw(st.integers(0, 2**31 - 1)),
                transposed=draw(st.booleans()), options=dict(enable_gqa=gqa))
    mask = draw(st.sampled_from(["none", "causal", "bool", "bool_heads", "padding", "float"]))
    case["mask"] = mask
    if mask == "causal":
        case["options"]["is_causal"] = True
    if draw(st.booleans()):
        case["options"]["window"] = [draw(st.sampled_from([-1, 0, 2, 5])), draw(st.sampled_from([-1, 0, 3]))]
    if draw(st.booleans()):
        case["options"]["softcap"] = draw(st.sampled_from([0.5, 4.0]))
    case["alibi"] = draw(st.booleans())
    case["sinks"] = draw(st.booleans())
    if draw(st.booleans()):
        case["options"]["scale"] = draw(st.sampled_from([0.3, -1.1]))
    return case


def make_inputs(case):
    """(q, k, v, extra) float32 leaf tensors; extra holds attn_mask / alibi_slopes / sinks."""
    g = torch.Generator().manual_seed(case["seed"])
    lead, h, h_kv, L, S = case["lead"], case["h"], case["h_kv"], case["L"], case["S"]

    def tensor(heads, rows, width):
        if case["transposed"]:  # (N..., rows, heads, width) viewed as (N..., heads, rows, width): strided
            t = torch.randn(lead + (rows, heads, width), generator=g).transpose(-2, -3)
        else:
            t = torch.randn(lead + (heads, rows, width), generator=g)
        return t.detach().requires_grad_(True)

    q, k, v = tensor(h, L, case["E"]), tensor(h_kv, S, case["E"]), tensor(h_kv, S, case["E_v"])
    extra = {}
    if case["mask"] == "bool":  # one [L, S] pattern broadcast over N... and h
        extra["attn_mask"] = torch.rand(L, S, generator=g) > 0.3
    elif case["mask"] == "bool_heads":  # per head, broadcast over the leading dims
        extra["attn_mask"] = torch.rand(h, 1 if S % 2 else L, S, generator=g) > 0.4
    elif case["mask"] == "padding":  # (N..., 1, 1, S), key padding as models pass it: [B*h, L, S] inside
        extra["attn_mask"] = torch.rand(lead + (1, 1, S), generator=g) > 0.3
    elif case["mask"] == "float":
        extra["attn_mask"] = torch.randn(lead + (h, L, S), generator=g)
    if case["alibi"]:
        extra["alibi_slopes"] = torch.linspace(0.05, 0.5, h)
    if case["sinks"]:
        extra["sinks"] = (2 * torch.randn(h, generator=g)).requires_grad_(True)
    return q, k, v, extra


def gradients(out, inputs, seed):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, dout)


@hypothesis_settings(70)
@given(case=cases())
def test_forward_and_gradients_within_the_rule_of_the_float64_math(case):
    q, k, v, extra = make_inputs(case)
    diff = [q, k, v] + ([extra["sinks"]] if "sinks" in extra else [])
    options = dict(case["options"], **extra)
    out = sdpa(q, k, v, **options)
    ref64 = reference(q, k, v, **options)
    ref32 = reference(q, k, v, dtype=torch.float32, **options)
    assert out.dtype == torch.float32
    assert_within("out", out, ref64, ref32, 2)
    names = ["dq", "dk", "dv", "dsinks"]
    for name, got, r64, r32 in zip(names, gradients(out, diff, case["seed"]), gradients(ref64, diff, case["seed"]),
                                   gradients(ref32, diff, case["seed"])):
        assert_within(name, got, r64, r32, 3)


@pytest.mark.parametrize("L,S", [(4, 4), (7, 3), (3, 8)])
def test_is_causal_is_top_left_aligned_as_torch_2_5(L, S):
    g = torch.Generator().manual_seed(L * 10 + S)
    q, k, v = (torch.randn(2, L if n == 0 else S, 4, generator=g, dtype=torch.float64) for n in range(3))
    tril = torch.ones(L, S, dtype=torch.bool).tril(diagonal=0)  # the mask PyTorch 2.5's docs build
    expected = reference(q, k, v, attn_mask=tril)
    assert torch.allclose(sdpa(q, k, v, is_causal=True), expected, rtol=0, atol=1e-12)


def test_float64_matches_the_math_to_rounding():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 6, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.randn(3, 6, 6, generator=g, dtype=torch.float64)
    out = sdpa(q, k, v, mask)
    ref = reference(q, k, v, mask)
    assert (out - ref).abs().max() < 1e-13
    for a, b in zip(gradients(out, (q, k, v), 0), gradients(ref, (q, k, v), 0)):
        assert (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("seed", [0, 1])
def test_bfloat16_within_twice_torchs_own_bfloat16_error(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g).bfloat16().requires_grad_(True) for _ in range(3))
    out = sdpa(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    truth = reference(q, k, v, is_causal=True)
    torch_bf16 = reference(q, k, v, is_causal=True, dtype=torch.bfloat16)  # torch's math in bfloat16
    assert_within("out", out, truth, torch_bf16, 2)
    for name, a, b, c in zip(["dq", "dk", "dv"], gradients(out, (q, k, v), seed), gradients(truth, (q, k, v), seed),
                             gradients(torch_bf16, (q, k, v), seed)):
        assert a.dtype == torch.bfloat16
        assert_within(name, a, b, c, 2)


def test_bfloat16_sinks_get_a_bfloat16_gradient():
    q, k, v = (torch.randn(1, 2, 5, 8).bfloat16() for _ in range(3))
    sinks = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    sdpa(q, k, v, sinks=sinks).sum().backward()
    assert sinks.grad.dtype == torch.bfloat16 and sinks.grad.shape == (2,)


def test_dropout_keeps_one_minus_p_and_repeats_under_manual_seed():
    # v = the identity over S keys: out = the weights after dropout, each row 1 / S before it.
    S, p = 64, 0.3
    q, k = torch.zeros(2, 4, 64, 8), torch.zeros(2, 4, S, 8)
    v = torch.eye(S).expand(2, 4, S, S)
    torch.manual_seed(5)
    first = sdpa(q, k, v, dropout_p=p)
    second = sdpa(q, k, v, dropout_p=p)
    torch.manual_seed(5)
    again = sdpa(q, k, v, dropout_p=p)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)  # the generator moved on
    kept = (first != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 4 * math.sqrt(p * (1 - p) / first.numel())
    assert torch.allclose(first[first != 0], torch.tensor(1 / S / (1 - p)))


def test_dropout_gradients_use_the_forwards_mask():
    # Linear in v: the gradient of v is (the dropped weights)^T dout, the weights being out with v = I.
    S = 16
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, S, 4)
    v = torch.eye(S).repeat(1, 2, 1, 1).requires_grad_(True)
    torch.manual_seed(9)
    weights = sdpa(q, k, v, dropout_p=0.5)
    dout = torch.randn(weights.shape)
    (dv,) = torch.autograd.grad(weights, v, dout)
    assert torch.allclose(dv, weights.detach().transpose(-2, -1) @ dout, atol=1e-5)


def test_bfloat16_query_takes_a_float32_mask():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g).bfloat16() for _ in range(3))
    mask = torch.randn(9, 9, generator=g)
    truth = reference(q, k, v, mask)
    torch_bf16 = reference(q, k, v, mask.bfloat16(), dtype=torch.bfloat16)
    assert_within("out", sdpa(q, k, v, mask), truth, torch_bf16, 2)


def _copies_made(call):
    """The aten copy ops (copy_, clone, contiguous) that `call` runs, as the profiler records them."""
    with torch.autograd.profiler.profile() as prof:
        call()
    return [e.name for e in prof.function_events if e.name in ("aten::copy_", "aten::clone", "aten::contiguous")]


def test_strided_inputs_and_a_broadcast_float_mask_reach_the_kernel_without_a_copy():
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(2, 7, 3, 4, 8, generator=g, requires_grad=True)  # (N, L, 3, h, d)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (N, h, L, d) each, strided views of one buffer
    mask = torch.randn(7, 7, generator=g)[None, None]  # (1, 1, L, S), broadcast
    out = sdpa(q, k, v, mask)
    assert _copies_made(lambda: sdpa(q, k, v, mask)) == []
    dout = torch.randn(1, 4, 1, 8, generator=g).expand(out.shape)  # stride 0, as out.sum()'s gradient is
    # the gradients at q, k and v themselves (no accumulation into qkv.grad, which is autograd's own work)
    assert _copies_made(lambda: torch.autograd.grad(out, (q, k, v), dout)) == []
    ref = reference(q, k, v, mask)
    assert (out - ref).abs().max() < 1e-5
    padding = torch.randn(2, 1, 1, 7, generator=g)  # (N, 1, 1, S): mha's key_padding_mask [N, S], not [N*h, L, S]
    assert _copies_made(lambda: sdpa(q, k, v, padding)) == []
    assert (sdpa(q, k, v, padding) - reference(q, k, v, padding)).abs().max() < 1e-5


def test_a_fully_masked_row_gives_zero_not_nan():
    q, k, v = (torch.randn(1, 1, 3, 4, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, True]])
    out = sdpa(q, k, v, mask)
    assert torch.equal(out[0, 0, 1], torch.zeros(4))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_strided_and_expanded_inputs_and_leading_dims_broadcast():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 5, 2, 8, generator=g, dtype=torch.float64).transpose(1, 2)  # (3, 2, 5, 8), strided
    k = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)  # batch 1 broadcasts
    v = torch.randn(2, 6, 1, generator=g, dtype=torch.float64).expand(1, 2, 6, 7)  # stride 0
    out = sdpa(q, k, v)
    assert out.shape == (3, 2, 5, 7)
    assert (out - reference(q, k.expand(3, 2, 6, 8), v.expand(3, 2, 6, 7))).abs().max() < 1e-13
    two_d = sdpa(q[0, 0], k[0, 0], v[0, 0])  # (L, E): no heads, no batch
    assert two_d.shape == (5, 7) and (two_d - out[0, 0]).abs().max() < 1e-13


def test_empty_sizes():
    assert sdpa(torch.randn(0, 2, 3, 4), torch.randn(0, 2, 5, 4), torch.randn(0, 2, 5, 6)).shape == (0, 2, 3, 6)
    assert sdpa(torch.randn(2, 0, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)).shape == (2, 0, 6)


def test_double_backward_is_refused():
    q, k, v = (torch.randn(1, 1, 3, 4, requires_grad=True) for _ in range(3))
    (dq,) = torch.autograd.grad(sdpa(q, k, v).sum(), q, create_graph=False)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(sdpa(q, k, v).sum(), q, create_graph=True)


def _qkv(*shape, **kwargs):
    return tuple(torch.randn(*shape, **kwargs) for _ in range(3))


@pytest.mark.parametrize("call,match", [
    (lambda: sdpa(*_qkv(1, 2, 3, 4, device="meta")), "query is on meta; mha runs on the CPU only"),
    (lambda: sdpa(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4, device="meta"), torch.randn(1, 2, 3, 4)),
     "key is on meta"),
    (lambda: sdpa(torch.randn(2, 3, 4), torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4)),
     "query, key, and value to have the same dtype"),
    (lambda: sdpa(*_qkv(2, 3, 4, dtype=torch.float16)), "query must be torch.float32, torch.float64 or torch.bfloat16"),
    (lambda: sdpa(torch.randn(2, 3, 4), torch.randn(2, 3, 5), torch.randn(2, 3, 4)), "key's last dim"),
    (lambda: sdpa(torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 5, 4)), "value .* must have key's"),
    (lambda: sdpa(torch.randn(4), torch.randn(4), torch.randn(4)), "rank >= 2"),
    (lambda: sdpa(torch.randn(2, 3, 3, 4), torch.randn(3, 3, 3, 4), torch.randn(3, 3, 3, 4)), "must broadcast"),
    (lambda: sdpa(torch.randn(1, 4, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)), "enable_gqa=True"),
    (lambda: sdpa(torch.randn(1, 4, 3, 4), torch.randn(1, 3, 3, 4), torch.randn(1, 3, 3, 4), enable_gqa=True),
     "multiple of key's"),
    (lambda: sdpa(*_qkv(2, 3, 4), attn_mask=torch.ones(3, 4, dtype=torch.bool)), "attn_mask must broadcast"),
    (lambda: sdpa(*_qkv(2, 3, 4), attn_mask=torch.ones(3, 3, dtype=torch.float64)), "attn_mask dtype"),
    (lambda: sdpa(*_qkv(2, 3, 4), attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True), "cannot both"),
    (lambda: sdpa(*_qkv(2, 3, 4), attn_mask=torch.zeros(3, 3, requires_grad=True)), "attn_mask requires grad"),
    (lambda: sdpa(*_qkv(2, 3, 4), dropout_p=1.0), r"dropout_p must be in \[0, 1\)"),
    (lambda: sdpa(*_qkv(2, 3, 4), window=[1]), r"window must be \(left, right\)"),
    (lambda: sdpa(*_qkv(2, 3, 4), window=[-2, 0]), "window: expected extents"),
    (lambda: sdpa(*_qkv(2, 3, 4), alibi_slopes=torch.ones(3)), "alibi_slopes: expected one slope per query head"),
    (lambda: sdpa(*_qkv(2, 3, 4), alibi_slopes=torch.ones(2, requires_grad=True)), "alibi_slopes requires grad"),
    (lambda: sdpa(*_qkv(2, 3, 4), sinks=torch.ones(2, dtype=torch.int64)), "sinks must be a floating tensor"),
    (lambda: sdpa(*_qkv(2, 3, 4), sinks=torch.ones(5)), "sinks"),
    (lambda: sdpa(*_qkv(2, 3, 4), softcap=-1.0), "softcap"),
    (lambda: sdpa(*_qkv(2, 3, 4), scale=math.inf), "scale"),
])
def test_bad_arguments_raise_torch_errors_naming_the_argument(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()


def test_without_the_operator_library_the_function_says_so(monkeypatch):
    monkeypatch.setattr(torch_sdpa, "OPERATORS_LOADED", False)
    with pytest.raises(RuntimeError, match="operator library .* was not built"):
        sdpa(*_qkv(2, 3, 4))
