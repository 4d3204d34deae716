"""mha.torch.MultiheadAttention: a torch.nn.Module computed by mha, against torch.nn.MultiheadAttention.

* gradcheck in float64 with respect to the inputs and every parameter, over layouts, kdim/vdim,
  d_k/d_v, add_bias_kv, add_zero_attn, masks and is_causal;
* parity with torch's module holding the same weights on seeded random configurations, in float32:
  outputs and weights within max|ours - torch_fp64| <= 2 * max|torch_fp32 - torch_fp64| + 1e-6,
  gradients (through autograd) within 2 * err32 + 1e-5 * max(1, max|grad|) as test_backward.py;
  every few configurations also in float64 (1e-10 relative);
* a small model trained 50 Adam steps with each module: equal loss curves;
* state_dict round trips, swapping into torch.nn.TransformerEncoderLayer, several forwards before
  one backward (also with dropout), inputs reaching mha without a copy, errors.

Legend: B batch, h heads, L queries, S keys, E = embed_dim, d_k / d_v per-head widths.
"""
import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import mha
import mha.torch
from mha_reference import causal_forbidden, error_bound, max_abs_diff


def grad_bound(err32, ref64):
    """test_backward.py's gradient tolerance: 2 * torch float32's error + 1e-5 of the largest gradient."""
    scale = max(1.0, float(np.max(np.abs(ref64)))) if np.size(ref64) else 1.0
    return 2.0 * err32 + 1e-5 * scale


def module_pair(dtype=torch.float32, seed=0, **kwargs):
    """(torch's module, ours) holding the same weights; biases made nonzero so they are exercised."""
    torch.manual_seed(seed)
    theirs = torch.nn.MultiheadAttention(**kwargs, dtype=dtype)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.5)
    ours = mha.torch.MultiheadAttention(**kwargs, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


# ---- construction and the package ----------------------------------------------------------------

def test_import_mha_does_not_import_torch():
    code = ("import sys, mha; assert 'torch' not in sys.modules and 'mha.torch' not in sys.modules; "
            "import mha.torch, torch; assert mha.torch._torch is torch; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


CONSTRUCTIONS = [
    dict(embed_dim=8, num_heads=2),
    dict(embed_dim=12, num_heads=3, bias=False, batch_first=True),
    dict(embed_dim=8, num_heads=4, kdim=5, vdim=7, add_bias_kv=True),
    dict(embed_dim=6, num_heads=1, kdim=6, vdim=3, add_bias_kv=True, add_zero_attn=True, bias=False),
]


@pytest.mark.parametrize("kwargs", CONSTRUCTIONS, ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_parameters_and_attributes_as_torch(kwargs, dtype):
    torch.manual_seed(7)
    theirs = torch.nn.MultiheadAttention(**kwargs, dtype=dtype)
    torch.manual_seed(7)
    ours = mha.torch.MultiheadAttention(**kwargs, dtype=dtype)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name  # same initialisation, same random numbers
    for p in ours.parameters():
        assert isinstance(p, torch.nn.Parameter)
    assert type(ours.out_proj) is type(theirs.out_proj)
    for attr in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout", "batch_first",
                 "add_zero_attn", "_qkv_same_embed_dim", "in_proj_weight", "q_proj_weight",
                 "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k", "bias_v"):
        a, b = getattr(ours, attr), getattr(theirs, attr)
        assert (a is None) == (b is None) and (a is None or isinstance(a, torch.Tensor) or a == b), attr


def test_d_k_d_v_extras_shapes():
    m = mha.torch.MultiheadAttention(10, 3, d_k=4, d_v=2, kdim=5, add_bias_kv=True)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"q_proj_weight": (12, 10), "k_proj_weight": (12, 5), "v_proj_weight": (6, 10),
                      "in_proj_bias": (30,), "bias_k": (1, 1, 12), "bias_v": (1, 1, 6),
                      "out_proj.weight": (10, 6), "out_proj.bias": (10,)}
    assert not m._qkv_same_embed_dim and m.head_dim == 4
    packed = mha.torch.MultiheadAttention(10, 2, d_k=3, d_v=3)
    assert packed._qkv_same_embed_dim and tuple(packed.in_proj_weight.shape) == (18, 10)
    # the internal layer agrees on every name and shape (load_state_dict would raise otherwise)
    x = torch.randn(4, 2, 10)
    out, w = packed(x, x, x, average_attn_weights=False)
    assert out.shape == (4, 2, 10) and w.shape == (2, 2, 4, 4)


def test_construction_errors():
    with pytest.raises(ValueError, match="^dtype"):
        mha.torch.MultiheadAttention(8, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="^device"):
        mha.torch.MultiheadAttention(8, 2, device="meta")
    with pytest.raises(ValueError, match="^embed_dim"):
        mha.torch.MultiheadAttention(10, 3)
    assert mha.torch.MultiheadAttention(10, 3, d_k=4, d_v=4).embed_dim == 10


def test_forward_errors():
    m = mha.torch.MultiheadAttention(8, 2)
    x = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="^query: expected torch.float32"):
        m(x.double(), x, x)
    with pytest.raises(ValueError, match="^key: expected a torch.Tensor"):
        m(x, x.numpy(), x)
    with pytest.raises(ValueError, match="^value"):
        m(x, x, torch.randn(3, 2, 7))
    with pytest.raises(ValueError, match="^key_padding_mask"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="^attn_mask: no gradient"):
        m(x, x, x, attn_mask=torch.zeros(3, 3, requires_grad=True))
    with pytest.raises(ValueError, match="^in_proj_weight"):
        m.half()(x.half(), x.half(), x.half())


def nested(*shapes, dtype=torch.float32):
    return torch.nested.nested_tensor([torch.randn(*shape, dtype=dtype) for shape in shapes])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("argument", ["query", "key", "value", "key_padding_mask", "attn_mask", "head_gate"])
def test_nested_tensors_are_refused_by_name(argument):
    """A nested tensor is strided in torch 1.13 (layout torch.strided), so it passed the layout check and
    failed in torch ("NestedTensorImpl doesn't support sizes"); mha refuses it naming the argument."""
    m = mha.torch.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    inputs = dict(query=x, key=x, value=x)
    if argument in inputs:
        inputs[argument] = nested((3, 8), (2, 8))
        call = lambda: m(**inputs)  # noqa: E731
    else:
        bad = {"key_padding_mask": nested((3,), (2,)), "attn_mask": nested((3, 3), (2, 3)),
               "head_gate": nested((2,), (1,))}[argument]
        call = lambda: m(x, x, x, **{argument: bad})  # noqa: E731
    with pytest.raises(mha.Error, match=f"^{argument}: .*nested"):
        call()


@pytest.mark.parametrize("how", ["is_grads_batched", "jacobian_vectorize"])
def test_batched_gradients_are_refused_with_a_reason(how):
    """torch.autograd.grad(..., is_grads_batched=True) and jacobian(..., vectorize=True) call the backward
    under torch's vmap, whose BatchedTensor mha cannot read (it used to fail inside torch with "Batching
    rule not implemented for aten::detach"); mha says so and what to use instead. The unbatched forms work."""
    torch.manual_seed(0)
    m = mha.torch.MultiheadAttention(4, 2, batch_first=True, dtype=torch.float64)
    q = torch.randn(1, 2, 4, dtype=torch.float64, requires_grad=True)
    if how == "is_grads_batched":
        out, _ = m(q, q, q)
        basis = torch.eye(out.numel(), dtype=torch.float64).reshape(-1, *out.shape)
        with pytest.raises(RuntimeError, match="vmap.*is_grads_batched.*vectorize=False"):
            torch.autograd.grad(out, q, basis, is_grads_batched=True)
        rows = [torch.autograd.grad(out, q, g, retain_graph=True)[0] for g in basis]  # one at a time works
        assert len(rows) == out.numel()
    else:
        with pytest.raises(RuntimeError, match="vmap.*is_grads_batched.*vectorize=False"):
            torch.autograd.functional.jacobian(lambda x: m(x, x, x)[0], q, vectorize=True)
        jacobian = torch.autograd.functional.jacobian(lambda x: m(x, x, x)[0], q)
        assert jacobian.shape == (1, 2, 4, 1, 2, 4) and torch.isfinite(jacobian).all()


# ---- gradcheck (float64) ---------------------------------------------------------------------------

GRADCHECK_CASES = {
    "seq_first": dict(module=dict(embed_dim=4, num_heads=2), B=2, L=3, S=4),
    "batch_first-kdim-vdim": dict(module=dict(embed_dim=4, num_heads=2, kdim=3, vdim=5, batch_first=True),
                                  B=2, L=3, S=2),
    "unbatched-biaskv-zeroattn": dict(module=dict(embed_dim=4, num_heads=1, add_bias_kv=True,
                                                  add_zero_attn=True), B=None, L=3, S=3),
    "nobias-d_k-d_v": dict(module=dict(embed_dim=3, num_heads=2, d_k=2, d_v=3, bias=False,
                                       batch_first=True), B=2, L=2, S=3),
    "bool_kpm-bool3d_mask": dict(module=dict(embed_dim=4, num_heads=2, batch_first=True), B=2, L=3, S=4,
                                 kpm="bool", mask="bool3d"),
    "float_kpm": dict(module=dict(embed_dim=4, num_heads=2), B=2, L=2, S=3, kpm="float"),
    "float2d_mask-biaskv": dict(module=dict(embed_dim=4, num_heads=2, add_bias_kv=True), B=1, L=3, S=3,
                                mask="float2d"),
    "causal": dict(module=dict(embed_dim=4, num_heads=2, batch_first=True), B=2, L=3, S=4, causal=True),
    "causal-zeroattn-kpm": dict(module=dict(embed_dim=4, num_heads=2, add_zero_attn=True), B=2, L=4, S=4,
                                causal=True, kpm="bool"),
    "self_attention-causal": dict(module=dict(embed_dim=4, num_heads=2, batch_first=True), B=2, L=3, S=3,
                                  causal=True, self_attention=True),
}


@pytest.fixture
def one_mha_thread():
    """One mha thread while a test makes thousands of calls on tiny shapes: there, OpenMP's
    per-call barriers cost more than the work, by orders of magnitude when the CPUs are busy."""
    threads = mha.num_threads()
    mha.set_num_threads(1)
    yield
    mha.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", list(GRADCHECK_CASES))
def test_gradcheck(name, mode, one_mha_thread):
    c = GRADCHECK_CASES[name]
    torch.manual_seed(3)
    m = mha.torch.MultiheadAttention(**c["module"], dtype=torch.float64).train(mode == "train")
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.7)
    E, kdim, vdim = m.embed_dim, m.kdim, m.vdim
    B, L, S = c["B"], c["L"], c["S"]

    def shaped(n, width):  # [B, n, width] (batch_first), [n, B, width] or unbatched [n, width]
        if B is None:
            return torch.randn(n, width, dtype=torch.float64)
        return torch.randn(*((B, n) if m.batch_first else (n, B)), width, dtype=torch.float64)

    query, key, value = shaped(L, E), shaped(S, kdim), shaped(S, vdim)
    kpm = None
    if c.get("kpm") == "bool":
        kpm = torch.rand(B, S) < 0.3
        kpm[:, 0] = False
    elif c.get("kpm") == "float":
        kpm = torch.randn(B, S, dtype=torch.float64)
    mask = None
    if c.get("mask") == "bool3d":
        mask = torch.rand(B * m.num_heads, L, S) < 0.3
        mask[..., 0] = False
    elif c.get("mask") == "float2d":
        mask = torch.randn(L, S, dtype=torch.float64)
        mask[0, 1] = float("-inf")
    options = dict(key_padding_mask=kpm, attn_mask=mask, is_causal=c.get("causal", False), need_weights=False)
    params = list(m.parameters())
    if c.get("self_attention"):
        inputs = (query.requires_grad_(),)

        def f(x, *ps):
            return m(x, x, x, **options)[0]
    else:
        inputs = tuple(t.requires_grad_() for t in (query, key, value))

        def f(q, k, v, *ps):
            return m(q, k, v, **options)[0]
    # gradcheck perturbs the parameters in place; each forward reads their current values.
    assert torch.autograd.gradcheck(f, inputs + tuple(params), eps=1e-6, atol=1e-6, rtol=1e-5)


# ---- parity with torch.nn.MultiheadAttention --------------------------------------------------------

N_PARITY = 30
MASK_KINDS = ("none", "bool2d", "bool3d", "float2d", "float3d", "causal", "causal+bool2d")


def parity_case(seed):
    r = np.random.default_rng([41, seed])
    layout = ("batch_first", "seq_first", "unbatched")[seed % 3]
    self_attention = bool(r.random() < 0.25)
    L = int(r.integers(1, 13))
    S = L if self_attention else int(r.integers(1, 13))
    mask = str(r.choice(MASK_KINDS))
    if mask.startswith("causal") and S < L:  # bottom-right causal alignment leaves no fully masked rows
        L, S = S, L
        S = L if self_attention else S
    h = int(r.choice([1, 2, 3, 4]))
    return dict(
        seed=seed, layout=layout, B=int(r.integers(1, 4)), L=L, S=S, h=h,
        head_dim=int(r.choice([1, 2, 3, 8])), self_attention=self_attention,
        kdim=None if self_attention or r.random() < 0.7 else int(r.integers(1, 10)),
        vdim=None if self_attention or r.random() < 0.7 else int(r.integers(1, 10)),
        bias=bool(r.random() < 0.8), add_bias_kv=bool(r.random() < 0.3),
        add_zero_attn=bool(r.random() < 0.3), mask=mask,
        kpm=str(r.choice(["none", "bool", "float"] if mask == "none" else ["none", "bool"])),
        need_weights=bool(r.random() < 0.7), average=bool(r.random() < 0.5),
        mode=str(r.choice(["train", "eval"])), check_fp64=seed % 3 == 0)


PARITY_CASES = [parity_case(s) for s in range(N_PARITY)]


def parity_id(c):
    parts = [f"{c['seed']:02d}", c["layout"]] + ([] if c["layout"] == "unbatched" else [f"B{c['B']}"])
    parts += [f"L{c['L']}", f"S{c['S']}", f"h{c['h']}x{c['head_dim']}"]
    parts += ["self"] if c["self_attention"] else []
    parts += [f"kdim{c['kdim']}"] if c["kdim"] else []
    parts += [f"vdim{c['vdim']}"] if c["vdim"] else []
    parts += [] if c["bias"] else ["nobias"]
    parts += ["biaskv"] if c["add_bias_kv"] else []
    parts += ["zeroattn"] if c["add_zero_attn"] else []
    parts += [] if c["mask"] == "none" else [c["mask"]]
    parts += [] if c["kpm"] == "none" else [f"{c['kpm']}kpm"]
    parts += [("avg" if c["average"] else "perhead") + "weights"] if c["need_weights"] else []
    parts.append(c["mode"])
    return "-".join(parts)


def run_module(module, dtype, inputs, dout, options, self_attention):
    """sum(out * dout).backward() through autograd: (out, weights, [d query, d key, d value] or
    [d x], {name: d parameter}) as float64 NumPy arrays (weights None when not asked for)."""
    module.zero_grad()
    leaves = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in inputs[:1 if self_attention else 3]]
    qkv = leaves * 3 if self_attention else leaves
    opts = dict(options)
    for name in ("attn_mask", "key_padding_mask"):
        if opts.get(name) is not None and opts[name].dtype.kind == "f":
            opts[name] = torch.tensor(opts[name], dtype=dtype)
        elif opts.get(name) is not None:
            opts[name] = torch.from_numpy(opts[name])
    out, weights = module(*qkv, **opts)
    (out * torch.tensor(dout, dtype=dtype)).sum().backward()
    as64 = lambda t: t.detach().numpy().astype(np.float64)  # noqa: E731
    return (as64(out), None if weights is None else as64(weights), [as64(t.grad) for t in leaves],
            {n: as64(p.grad) for n, p in module.named_parameters()})


@pytest.mark.parametrize("c", PARITY_CASES, ids=[parity_id(c) for c in PARITY_CASES])
def test_parity_with_torch(c):
    r = np.random.default_rng([42, c["seed"]])
    B, L, S, h = c["B"], c["L"], c["S"], c["h"]
    E = h * c["head_dim"]
    kdim, vdim = c["kdim"] or E, c["vdim"] or E
    q, k, v = (r.normal(size=(B, n, w)) for n, w in ((L, E), (S, kdim), (S, vdim)))
    dout = r.normal(size=(B, L, E))
    if c["self_attention"]:
        k = v = q
    kpm = None
    if c["kpm"] == "bool":
        kpm = r.random((B, S)) < 0.25
        kpm[:, 0] = False  # no fully masked rows (torch gives NaN there)
    elif c["kpm"] == "float":
        kpm = r.normal(size=(B, S))
    torch_mask = ours_mask = None
    if c["mask"] != "none":
        shape = (B * h, L, S) if c["mask"].endswith("3d") else (L, S)
        forbid = r.random(shape) < 0.25
        forbid[..., 0] = False
        if c["mask"].startswith("float"):
            torch_mask = ours_mask = np.where(forbid, -np.inf, r.normal(size=shape))
        elif c["mask"].startswith("bool"):
            torch_mask = ours_mask = forbid
        else:  # causal: ours gets is_causal (with the bool2d mask), torch the combined mask
            ours_mask = forbid if c["mask"] == "causal+bool2d" else None
            torch_mask = causal_forbidden(L, S) | (forbid if ours_mask is not None else False)
    if c["layout"] == "seq_first":
        q, k, v, dout = (np.ascontiguousarray(x.transpose(1, 0, 2)) for x in (q, k, v, dout))
    elif c["layout"] == "unbatched":
        q, k, v, dout = (x[0] for x in (q, k, v, dout))
        kpm = None if kpm is None else kpm[0]
        if torch_mask is not None and torch_mask.ndim == 3:
            torch_mask = torch_mask[:h]
            ours_mask = torch_mask
    kwargs = dict(embed_dim=E, num_heads=h, kdim=c["kdim"], vdim=c["vdim"], bias=c["bias"],
                  add_bias_kv=c["add_bias_kv"], add_zero_attn=c["add_zero_attn"],
                  batch_first=c["layout"] == "batch_first")
    theirs32, ours32 = module_pair(torch.float32, seed=c["seed"], **kwargs)
    theirs64 = copy.deepcopy(theirs32).double()
    for m in (theirs32, ours32, theirs64):
        m.train(c["mode"] == "train")
    common = dict(key_padding_mask=kpm, need_weights=c["need_weights"], average_attn_weights=c["average"])
    inputs, sa = (q, k, v), c["self_attention"]
    t32 = run_module(theirs32, torch.float32, inputs, dout, dict(common, attn_mask=torch_mask), sa)
    t64 = run_module(theirs64, torch.float64, inputs, dout, dict(common, attn_mask=torch_mask), sa)
    ours_options = dict(common, attn_mask=ours_mask, is_causal=c["mask"].startswith("causal"))
    o32 = run_module(ours32, torch.float32, inputs, dout, ours_options, sa)
    assert np.isfinite(t64[0]).all()

    def check(ours, rule, label):
        (out, weights, dinputs, dparams), (out32, weights32, dinputs32, dparams32) = ours, t32
        out64, weights64, dinputs64, dparams64 = t64
        assert out.shape == out64.shape
        assert max_abs_diff(out, out64) <= rule(max_abs_diff(out32, out64), None), f"{label} out"
        assert (weights is None) == (weights64 is None)
        if weights is not None:
            assert weights.shape == weights64.shape
            assert max_abs_diff(weights, weights64) <= rule(max_abs_diff(weights32, weights64), None), \
                f"{label} weights"
        pairs = list(zip(["x"] if sa else ["query", "key", "value"], dinputs, dinputs32, dinputs64))
        pairs += [(n, dparams[n], dparams32[n], dparams64[n]) for n in dparams64]
        assert sorted(dparams) == sorted(dparams64)
        for name, g, g32, g64 in pairs:
            err = max_abs_diff(g, g64)
            assert err <= rule(max_abs_diff(g32, g64), g64), f"{label} d{name}: {err:.3g}"

    check(o32, lambda err32, g64: error_bound(err32) if g64 is None else grad_bound(err32, g64), "float32")
    if c["check_fp64"]:
        ours64 = copy.deepcopy(ours32).double()
        o64 = run_module(ours64, torch.float64, inputs, dout, ours_options, sa)
        check(o64, lambda err32, g64: 1e-10 * (1.0 if g64 is None else max(1.0, float(np.abs(g64).max()))),
              "float64")


def test_weights_have_no_gradient_and_no_grad_mode():
    theirs, ours = module_pair(embed_dim=8, num_heads=2, batch_first=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    out, weights = ours(x, x, x)
    assert out.requires_grad and out.grad_fn is not None
    assert not weights.requires_grad and weights.grad_fn is None
    with torch.no_grad():
        out_ng, weights_ng = ours(x, x, x)
    assert not out_ng.requires_grad and torch.equal(out_ng, out.detach()) and torch.equal(weights_ng, weights)
    out_none, weights_none = ours(x, x, x, need_weights=False)
    assert weights_none is None and torch.equal(out_none.detach(), out.detach())


def test_fully_masked_row_gives_out_proj_bias():
    """Where torch gives NaN (every key of a row masked), the output row is out_proj.bias."""
    theirs, ours = module_pair(embed_dim=8, num_heads=2, batch_first=True)
    x = torch.randn(2, 3, 8)
    padding = torch.tensor([[True] * 3, [False] * 3])
    out, weights = ours(x, x, x, key_padding_mask=padding)
    torch.testing.assert_close(out[0], ours.out_proj.bias.detach().expand(3, 8))
    assert torch.equal(weights[0], torch.zeros(3, 3))
    torch.testing.assert_close(out[1], theirs(x, x, x, key_padding_mask=padding)[0][1])


class Doubled(torch.nn.Module):
    def forward(self, w):
        return 2.0 * w


def test_parametrized_out_proj_weight():
    """A parametrisation (torch.nn.utils.parametrize) on out_proj.weight is differentiated through."""
    theirs, ours = module_pair(embed_dim=8, num_heads=2, batch_first=True)
    grads = []
    x = torch.randn(2, 4, 8)
    for m in (theirs, ours):
        torch.nn.utils.parametrize.register_parametrization(m.out_proj, "weight", Doubled())
        m(x, x, x)[0].square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    assert [n for n, _ in ours.named_parameters()][-1] == "out_proj.parametrizations.weight.original"
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_float64_module_after_double():
    theirs, ours = module_pair(embed_dim=6, num_heads=3, add_bias_kv=True)
    theirs.double()
    ours.double()
    x = torch.randn(4, 2, 6, dtype=torch.float64)
    a, wa = theirs(x, x, x)
    b, wb = ours(x, x, x)
    assert b.dtype == torch.float64
    torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(wb, wa, rtol=1e-12, atol=1e-12)


# ---- autograd across several forwards ----------------------------------------------------------------

def test_two_forwards_then_one_backward():
    theirs, ours = module_pair(embed_dim=8, num_heads=2, kdim=5, add_bias_kv=True, batch_first=True)
    r = torch.Generator().manual_seed(5)
    q1, q2 = torch.randn(2, 3, 8, generator=r), torch.randn(3, 4, 8, generator=r)  # different shapes
    k1, k2 = torch.randn(2, 6, 5, generator=r), torch.randn(3, 2, 5, generator=r)
    v1, v2 = torch.randn(2, 6, 8, generator=r), torch.randn(3, 2, 8, generator=r)
    grads = []
    for m in (theirs, ours):
        leaves = [t.clone().requires_grad_() for t in (q1, k1, v1, q2, k2, v2)]
        y1, _ = m(*leaves[:3])
        y2, _ = m(*leaves[3:])
        (y1.square().sum() + (y2 * 3).sum()).backward()
        grads.append([t.grad for t in leaves] + [p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_internal_layers_are_reused(monkeypatch):
    """A training loop creates no more than two internal mha layers (the graph of the previous step
    is alive during the next forward), and a forward under no_grad reuses an idle one."""
    created = []
    real_init = mha.MultiheadAttention.__init__

    def counting_init(self, *args, **kwargs):
        created.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(mha.MultiheadAttention, "__init__", counting_init)
    m = mha.torch.MultiheadAttention(8, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(3, 2, 8)
    for _ in range(5):
        loss = m(x, x, x)[0].square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        m(x, x, x)
    assert len(created) <= 2


def test_retain_graph_backward_twice():
    theirs, ours = module_pair(embed_dim=8, num_heads=2)
    x = torch.randn(3, 2, 8, requires_grad=True)
    loss = ours(x, x, x)[0].square().sum()
    loss.backward(retain_graph=True)
    once = [x.grad.clone()] + [p.grad.clone() for p in ours.parameters()]
    loss.backward()
    twice = [x.grad] + [p.grad for p in ours.parameters()]
    for a, b in zip(once, twice):
        torch.testing.assert_close(b, 2 * a)


def test_dropout_each_backward_uses_its_own_forward():
    """Two dropout forwards, then one backward: out_proj.weight's gradient must be the sum over both
    forwards of dout^T context, with each forward's own (dropped) weights."""
    E, h, B, L, S = 8, 2, 2, 4, 5
    torch.manual_seed(11)
    m = mha.torch.MultiheadAttention(E, h, dropout=0.5, batch_first=True)
    xs = [(torch.randn(B, L, E), torch.randn(B, S, E), torch.randn(B, S, E)) for _ in range(2)]
    douts = [torch.randn(B, L, E) for _ in range(2)]
    outs, weights = zip(*(m(*x, average_attn_weights=False) for x in xs))
    assert all((w == 0).any() for w in weights) and not torch.equal(weights[0] == 0, weights[1] == 0)
    sum((o * d).sum() for o, d in zip(outs, douts)).backward()
    with torch.no_grad():
        expected = torch.zeros(E, E, dtype=torch.float64)
        w_v, b_v = m.in_proj_weight[2 * E:].double(), m.in_proj_bias[2 * E:].double()
        for (q, k, v), w, d, out in zip(xs, weights, douts, outs):
            v_heads = (v.double() @ w_v.T + b_v).reshape(B, S, h, E // h).transpose(1, 2)
            context = (w.double() @ v_heads).transpose(1, 2).reshape(B, L, E)
            expected += torch.einsum("ble,blf->ef", d.double(), context)
            # the output is made of those weights too
            torch.testing.assert_close(m.out_proj(context.float()), out.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m.out_proj.weight.grad.double(), expected, rtol=1e-4, atol=1e-5)
    # the same torch seed gives the same masks; eval mode drops nothing
    torch.manual_seed(12)
    a = mha.torch.MultiheadAttention(E, h, dropout=0.5, batch_first=True)(*xs[0])[0]
    torch.manual_seed(12)
    b = mha.torch.MultiheadAttention(E, h, dropout=0.5, batch_first=True)(*xs[0])[0]
    assert torch.equal(a, b)
    evaluated = m.eval()(*xs[0], average_attn_weights=False)[1]
    assert (evaluated > 0).all()


# ---- memory: inputs reach mha without a copy ---------------------------------------------------------

def test_inputs_reach_mha_without_copy(monkeypatch):
    seen = []
    real_forward = mha.MultiheadAttention.forward

    def spy(self, query, key, value, **kwargs):
        seen.append([a.__array_interface__["data"][0] for a in (query, key, value)])
        seen.append([query is key, key is value])
        return real_forward(self, query, key, value, **kwargs)

    monkeypatch.setattr(mha.MultiheadAttention, "forward", spy)
    monkeypatch.setattr(mha.torch, "_OPERATORS_LOADED", False)  # the NumPy path (test_torch_module_script.py: the op's)
    m = mha.torch.MultiheadAttention(8, 2, kdim=4)
    q, k, v = torch.randn(3, 2, 8), torch.randn(5, 2, 4), torch.randn(5, 2, 8).requires_grad_()
    m(q, k, v)
    assert seen[0] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    m2 = mha.torch.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        m2(x, x, x)
    assert seen[2] == [x.data_ptr()] * 3 and seen[3] == [True, True]  # self-attention: one array
    xt = torch.randn(3, 2, 8).transpose(0, 1)  # strided: still a view
    with torch.no_grad():
        m2(xt, xt, xt)
    assert seen[4] == [xt.data_ptr()] * 3


# ---- training: the same loss curve as torch's module ---------------------------------------------------

class TinyLM(torch.nn.Module):
    """Embedding -> causal self-attention -> linear head: predicts the next token."""

    def __init__(self, attention, vocab=11, E=16, T=10, causal_argument=False):
        super().__init__()
        self.token = torch.nn.Embedding(vocab, E)
        self.position = torch.nn.Parameter(0.1 * torch.randn(T, E))
        self.attn = attention
        self.head = torch.nn.Linear(E, vocab)
        self.causal_argument = causal_argument
        self.register_buffer("mask", torch.from_numpy(causal_forbidden(T, T)))

    def forward(self, tokens):  # tokens: [B, T]
        x = self.token(tokens) + self.position  # [B, T, E]
        if self.causal_argument:
            y, _ = self.attn(x, x, x, need_weights=False, is_causal=True)
        else:
            y, _ = self.attn(x, x, x, need_weights=False, attn_mask=self.mask)
        return self.head(x + y)  # [B, T, vocab]


def tiny_task(steps, B=8, T=11, vocab=11, seed=0):
    """Sequences that count up by a per-sequence stride mod vocab: tokens [steps, B, T]."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (steps, B, 1), generator=g)
    stride = torch.randint(1, 4, (steps, B, 1), generator=g)
    return (start + stride * torch.arange(T)) % vocab


@pytest.mark.parametrize("causal", ["attn_mask", "is_causal"])
def test_training_loss_curve_matches_torch(causal):
    steps = 50
    data = tiny_task(steps)
    torch.manual_seed(0)
    theirs = TinyLM(torch.nn.MultiheadAttention(16, 4, batch_first=True))
    ours = TinyLM(mha.torch.MultiheadAttention(16, 4, batch_first=True),
                  causal_argument=causal == "is_causal")
    ours.load_state_dict(theirs.state_dict())
    curves = []
    for model in (theirs, ours):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for tokens in data:
            logits = model(tokens[:, :-1])  # predict tokens[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(np.array(losses))
    theirs_curve, ours_curve = curves
    assert ours_curve[-1] < 0.5 * ours_curve[0]  # it learns
    rel = np.abs(ours_curve - theirs_curve) / np.abs(theirs_curve)
    assert rel.max() <= 1e-4, (rel.max(), int(rel.argmax()))


# ---- state_dict ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", CONSTRUCTIONS, ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
def test_state_dict_round_trips(kwargs):
    torch.manual_seed(1)
    theirs = torch.nn.MultiheadAttention(**kwargs)
    ours = mha.torch.MultiheadAttention(**kwargs)  # different random numbers
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()
    B, L, S = 2, 3, 4
    seq = lambda n, w: torch.randn(B, n, w) if theirs.batch_first else torch.randn(n, B, w)  # noqa: E731
    q, k, v = seq(L, theirs.embed_dim), seq(S, theirs.kdim), seq(S, theirs.vdim)

    fresh = torch.nn.MultiheadAttention(**kwargs)
    fresh.load_state_dict(ours.state_dict())  # ours -> torch
    torch.testing.assert_close(fresh(q, k, v)[0], ours(q, k, v)[0], rtol=1e-5, atol=1e-5)
    back = mha.torch.MultiheadAttention(**kwargs)
    back.load_state_dict(theirs.state_dict())  # torch -> ours
    torch.testing.assert_close(back(q, k, v)[0], theirs(q, k, v)[0], rtol=1e-5, atol=1e-5)
    for (n1, a), (n2, b) in zip(back.state_dict().items(), theirs.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)


# ---- inside torch.nn.TransformerEncoderLayer ----------------------------------------------------------

def swapped_layer(batch_first, norm_first):
    """(torch's TransformerEncoderLayer, a deep copy whose self_attn is ours, a call counter)."""
    torch.manual_seed(2)
    layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0,
                                             batch_first=batch_first, norm_first=norm_first)
    swapped = copy.deepcopy(layer)
    attention = mha.torch.MultiheadAttention(16, 4, batch_first=batch_first)
    attention.load_state_dict(layer.self_attn.state_dict())
    swapped.self_attn = attention
    calls = []
    attention.register_forward_hook(lambda *args: calls.append(1))
    return layer, swapped, calls


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_layer_with_ours(batch_first, norm_first):
    layer, swapped, calls = swapped_layer(batch_first, norm_first)
    assert [n for n, _ in swapped.named_parameters()] == [n for n, _ in layer.named_parameters()]
    B, T = 3, 7
    x = torch.randn(B, T, 16) if batch_first else torch.randn(T, B, 16)
    src_mask = torch.from_numpy(causal_forbidden(T, T))
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[1, 5:] = True
    for mode in ("train", "eval"):  # eval with grad enabled: torch's fast path is off
        outs = []
        for model in (layer, swapped):
            model.train(mode == "train").zero_grad()
            y = model(x, src_mask=src_mask, src_key_padding_mask=padding)
            y.square().sum().backward()
            outs.append([y.detach()] + [p.grad for p in model.parameters()])
        for a, b in zip(*outs):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert len(calls) == 2


def test_transformer_encoder_layer_fast_path_and_encoder_stack():
    layer, swapped, calls = swapped_layer(batch_first=True, norm_first=False)
    x = torch.randn(2, 5, 16)
    layer.eval()
    swapped.eval()
    with torch.no_grad():  # torch's fast path reads self_attn's parameters and skips its forward
        torch.testing.assert_close(swapped(x), layer(x), rtol=1e-5, atol=1e-5)
    assert len(calls) == 0
    # TransformerEncoder deep-copies the layer (ours included, after it has run)
    swapped.train()
    swapped(x)
    encoder = torch.nn.TransformerEncoder(swapped, num_layers=2, enable_nested_tensor=False)
    reference = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    assert isinstance(encoder.layers[1].self_attn, mha.torch.MultiheadAttention)
    encoder.train()
    reference.train()
    torch.testing.assert_close(encoder(x), reference(x), rtol=1e-4, atol=1e-5)
