"""mha.torch.MultiheadAttention under TorchScript, through the registered operator mha::multi_head_attention.

* A small model (an encoder layer whose attention is mha.torch.MultiheadAttention, then a call of
  mha.torch.scaled_dot_product_attention), in configurations that cover the packed and separate
  projections, kdim / vdim, add_bias_kv, add_zero_attn, bool / float / byte masks, key padding,
  is_causal, a head gate, per-head weights, sequence-first inputs and float64: torch.jit.script and
  torch.jit.trace give outputs and gradients (input and every parameter) bitwise equal to eager mode;
  saved with torch.jit.save, the models run bitwise equal again in a fresh Python process (after
  `import mha.torch`) and in the C++ program examples/libtorch (libtorch and mha_torch_ops only).
* The scripted module against torch's own nn.MultiheadAttention holding the same state_dict, on
  hypothesis-drawn configurations: outputs, weights and gradients within the suite's rule (2x torch
  float32's error against torch float64, test_torch_module.py's grad_bound for gradients).
* Errors from scripted code name the argument.

Legend: B batch, h heads, L queries, S keys, E = embed_dim, d head width.
"""
import os
import pathlib
import subprocess
import sys
from typing import Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mha
import mha.torch as mha_torch
import mha._torch_sdpa as torch_sdpa
from mha_reference import causal_forbidden, error_bound, max_abs_diff

pytestmark = pytest.mark.skipif(not torch_sdpa.OPERATORS_LOADED,
                                reason="the operator library (libmha_torch_ops.so) was not built")

PACKAGE_PARENT = pathlib.Path(mha_torch.__file__).resolve().parents[1]  # build/python in a build tree
BUILD_TREE = PACKAGE_PARENT.parent
EXAMPLE = BUILD_TREE / "examples" / "libtorch" / "mha_libtorch_example"

B, L, E, H = 2, 6, 16, 4


class EncoderLayer(torch.nn.Module):
    """Post-norm encoder layer (as torch.nn.TransformerEncoderLayer) on mha.torch.MultiheadAttention,
    attending to x itself or, with kdim / vdim, to projections of x of those widths (cross attention),
    followed by a causal mha.torch.scaled_dot_product_attention over x's heads. forward(x) -> y only
    (masks are buffers), as the C++ example calls it."""

    def __init__(self, batch_first=True, kdim=None, vdim=None, add_bias_kv=False, add_zero_attn=False,
                 key_padding_mask=None, attn_mask=None, is_causal=False, head_gate=False, need_weights=False,
                 average_attn_weights=True, dtype=torch.float32):
        super().__init__()
        factory = dict(dtype=dtype)
        self.batch_first = batch_first
        self.num_heads = H
        self.self_attn = mha_torch.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=vdim,
                                                      add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                                                      **factory)
        self.cross = kdim is not None  # then vdim too
        self.to_key = torch.nn.Linear(E, kdim, **factory) if self.cross else torch.nn.Identity()
        self.to_value = torch.nn.Linear(E, vdim, **factory) if self.cross else torch.nn.Identity()
        self.register_buffer("key_padding_mask", key_padding_mask)
        self.register_buffer("attn_mask", attn_mask)
        self.is_causal = is_causal
        self.need_weights = need_weights
        self.average_attn_weights = average_attn_weights
        self.head_gate = torch.nn.Parameter(torch.linspace(0.5, 1.5, H, **factory)) if head_gate else None
        self.ff1, self.ff2 = torch.nn.Linear(E, 32, **factory), torch.nn.Linear(32, E, **factory)
        self.norm1, self.norm2 = torch.nn.LayerNorm(E, **factory), torch.nn.LayerNorm(E, **factory)
        with torch.no_grad():  # nonzero biases, so that their gradients are exercised
            for name, p in self.self_attn.named_parameters():
                if "bias" in name:
                    p.normal_(0.0, 0.5)

    def forward(self, x):  # x: [B, L, E] (batch_first) or [L, B, E]
        a, w = self.self_attn(x, self.to_key(x), self.to_value(x), key_padding_mask=self.key_padding_mask,
                              need_weights=self.need_weights, attn_mask=self.attn_mask,
                              average_attn_weights=self.average_attn_weights, is_causal=self.is_causal,
                              head_gate=self.head_gate)
        x = self.norm1(x + a)
        y = self.norm2(x + self.ff2(torch.relu(self.ff1(x))))
        yb = y if self.batch_first else y.transpose(0, 1)  # [B, L, E]
        n, l, e = yb.shape
        heads = yb.reshape(n, l, self.num_heads, e // self.num_heads).transpose(1, 2)  # [B, h, L, d], strided
        z = mha_torch.scaled_dot_product_attention(heads, heads, heads, is_causal=True).transpose(1, 2).reshape(n, l, e)
        y = y + (z if self.batch_first else z.transpose(0, 1))
        if w is not None:
            y = y + w.mean()  # the weights (no gradient) reach the output, so they are compared too
        return y


def _padding():
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, -2:] = True
    return kpm


def _forbidden(shape):
    g = torch.Generator().manual_seed(5)
    forbid = torch.rand(shape, generator=g) < 0.3
    forbid[..., 0] = False  # no fully masked rows
    return forbid


CONFIGS = {
    "packed-kpm": dict(key_padding_mask=_padding()),
    "cross-kdim-vdim-biaskv-zeroattn-float2d-weights": dict(
        kdim=5, vdim=7, add_bias_kv=True, add_zero_attn=True,
        attn_mask=torch.where(_forbidden((L, L)), -1e4, 0.5), need_weights=True),
    "seqfirst-bool3d-perhead-weights": dict(batch_first=False, attn_mask=_forbidden((B * H, L, L)),
                                            need_weights=True, average_attn_weights=False),
    "causal-headgate-byte-kpm": dict(is_causal=True, head_gate=True, key_padding_mask=_padding().to(torch.uint8)),
    "float64-biaskv-bool2d": dict(add_bias_kv=True, attn_mask=_forbidden((L, L)), dtype=torch.float64),
}


def model_and_input(name):
    torch.manual_seed(0)
    config = CONFIGS[name]
    model = EncoderLayer(**config).eval()
    dtype = config.get("dtype", torch.float32)
    x = torch.randn((B, L, E) if config.get("batch_first", True) else (L, B, E), dtype=dtype)
    return model, x


def output_and_gradients(module, x):
    x = x.detach().clone().requires_grad_(True)
    for p in module.parameters():
        p.grad = None
    out = module(x)
    out.sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("compile", ["script", "trace"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_scripted_and_traced_module_equals_eager_bitwise(name, compile):
    model, x = model_and_input(name)
    compiled = torch.jit.script(model) if compile == "script" else torch.jit.trace(model, x)
    graph = str(compiled.inlined_graph)
    assert "mha::multi_head_attention" in graph and "mha::scaled_dot_product_attention" in graph
    eager = output_and_gradients(model, x)
    got = output_and_gradients(compiled, x)
    assert_bitwise(got[0], eager[0])
    assert_bitwise(got[1], eager[1])
    assert len(got[2]) == len(eager[2]) and all(g is not None for g in got[2])
    for a, b in zip(got[2], eager[2]):  # every parameter's gradient, the attention's and the head gate's
        assert_bitwise(a, b)


def test_saved_modules_load_in_a_fresh_process_after_import_mha_torch(tmp_path):
    names = list(CONFIGS)
    for i, name in enumerate(names):
        model, x = model_and_input(name)
        torch.jit.script(model).save(str(tmp_path / f"model{i}.pt"))
        torch.save(x, tmp_path / f"x{i}.pt")
    script = ("import sys, pathlib, torch, mha.torch\n"
              "d = pathlib.Path(sys.argv[1])\n"
              "for i in range(int(sys.argv[2])):\n"
              "    m = torch.jit.load(str(d / f'model{i}.pt'))\n"
              "    x = torch.load(d / f'x{i}.pt').requires_grad_(True)\n"
              "    out = m(x); out.sum().backward()\n"
              "    torch.save((out.detach(), x.grad), d / f'out{i}.pt')\n")
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT))
    subprocess.run([sys.executable, "-c", script, str(tmp_path), str(len(names))], check=True, env=env, timeout=120)
    for i, name in enumerate(names):
        model, x = model_and_input(name)
        out, grad = torch.load(tmp_path / f"out{i}.pt")
        expected_out, expected_grad, _ = output_and_gradients(model, x)
        assert_bitwise(out, expected_out)
        assert_bitwise(grad, expected_grad)


class Inputs(torch.nn.Module):
    """Holds the input for the C++ program (a saved scripted module is a file libtorch 1.13 reads)."""

    def __init__(self, x):
        super().__init__()
        self.register_buffer("x", x)

    def forward(self):
        return self.x


@pytest.mark.parametrize("name", ["packed-kpm", "cross-kdim-vdim-biaskv-zeroattn-float2d-weights",
                                  "float64-biaskv-bool2d"])
def test_libtorch_program_runs_the_saved_module_bitwise_as_python(tmp_path, name):
    if not (BUILD_TREE / "CMakeCache.txt").exists():
        pytest.skip("mha.torch is not in a CMake build tree: no examples/libtorch program to run")
    assert EXAMPLE.exists(), f"{EXAMPLE} was not built (CMake builds it with the operator library)"
    model, x = model_and_input(name)
    torch.jit.script(model).save(str(tmp_path / "model.pt"))
    torch.jit.script(Inputs(x)).save(str(tmp_path / "inputs.pt"))
    result = subprocess.run([str(EXAMPLE), str(tmp_path / "model.pt"), str(tmp_path / "inputs.pt"),
                             str(tmp_path / "out.bin")], check=True, capture_output=True, text=True, timeout=120)
    assert "mha_libtorch_example: out [" + ", ".join(map(str, x.shape)) + "]" in result.stdout
    raw = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=x.dtype)
    expected_out, expected_grad, _ = output_and_gradients(model, x)
    assert raw.numel() == 2 * x.numel()
    assert_bitwise(raw[:x.numel()].view_as(x), expected_out)
    assert_bitwise(raw[x.numel():].view_as(x), expected_grad)


# ---- the scripted module against torch's nn.MultiheadAttention -------------------------------------

def grad_bound(err32, ref64):
    """test_torch_module.py's gradient tolerance: 2 * torch float32's error + 1e-5 of the largest gradient."""
    scale = max(1.0, float(np.max(np.abs(ref64)))) if np.size(ref64) else 1.0
    return 2.0 * err32 + 1e-5 * scale


def run(module, dtype, q, k, v, dout, kpm, mask, need_weights, average):
    """(out, weights or None, [dq, dk, dv], {name: dparam}) as float64 NumPy arrays."""
    module.zero_grad()
    leaves = [torch.tensor(t, dtype=dtype, requires_grad=True) for t in (q, k, v)]
    m = None if mask is None else (torch.from_numpy(mask) if mask.dtype == bool else torch.tensor(mask, dtype=dtype))
    kp = None if kpm is None else torch.from_numpy(kpm)
    out, weights = module(*leaves, key_padding_mask=kp, need_weights=need_weights, attn_mask=m,
                          average_attn_weights=average)
    (out * torch.tensor(dout, dtype=dtype)).sum().backward()
    as64 = lambda t: t.detach().numpy().astype(np.float64)  # noqa: E731
    return (as64(out), None if weights is None else as64(weights), [as64(t.grad) for t in leaves],
            {n: as64(p.grad) for n, p in module.named_parameters()})


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), queries=st.integers(1, 7), keys=st.integers(1, 7),
       heads=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([2, 3, 8]), kdim=st.sampled_from([None, 5]),
       vdim=st.sampled_from([None, 3]), add_bias_kv=st.booleans(), add_zero_attn=st.booleans(),
       bias=st.booleans(), batch_first=st.booleans(), mask=st.sampled_from(["none", "bool2d", "float3d", "causal"]),
       kpm=st.booleans(), need_weights=st.booleans(), average=st.booleans())
def test_scripted_module_matches_torch_module(seed, batch, queries, keys, heads, head_dim, kdim, vdim, add_bias_kv,
                                              add_zero_attn, bias, batch_first, mask, kpm, need_weights, average):
    r = np.random.default_rng(seed)
    e = heads * head_dim
    q = r.normal(size=(batch, queries, e))
    k, v = r.normal(size=(batch, keys, kdim or e)), r.normal(size=(batch, keys, vdim or e))
    dout = r.normal(size=(batch, queries, e))
    if not batch_first:
        q, k, v, dout = (np.ascontiguousarray(t.transpose(1, 0, 2)) for t in (q, k, v, dout))
    padding = None
    if kpm:
        padding = r.random((batch, keys)) < 0.3
        padding[:, 0] = False  # no fully masked rows (torch gives NaN there)
    attn_mask = None
    if mask == "bool2d":
        attn_mask = r.random((queries, keys)) < 0.3
        attn_mask[:, 0] = False
    elif mask == "float3d":
        attn_mask = r.normal(size=(batch * heads, queries, keys))
    elif mask == "causal":
        attn_mask = causal_forbidden(queries, keys)
        attn_mask[:, 0] = False
    kwargs = dict(embed_dim=e, num_heads=heads, kdim=kdim, vdim=vdim, bias=bias, add_bias_kv=add_bias_kv,
                  add_zero_attn=add_zero_attn, batch_first=batch_first)
    torch.manual_seed(seed)
    theirs32 = torch.nn.MultiheadAttention(**kwargs)
    with torch.no_grad():
        for name, p in theirs32.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.5)
    theirs64 = torch.nn.MultiheadAttention(**kwargs, dtype=torch.float64)
    theirs64.load_state_dict(theirs32.state_dict())
    ours = mha_torch.MultiheadAttention(**kwargs)
    ours.load_state_dict(theirs32.state_dict())
    scripted = torch.jit.script(ours)
    args = (q, k, v, dout, padding, attn_mask, need_weights, average)
    o, t32 = run(scripted, torch.float32, *args), run(theirs32, torch.float32, *args)
    t64 = run(theirs64, torch.float64, *args)
    assert np.isfinite(t64[0]).all()
    assert max_abs_diff(o[0], t64[0]) <= error_bound(max_abs_diff(t32[0], t64[0])), "out"
    assert (o[1] is None) == (t64[1] is None)
    if o[1] is not None:
        assert max_abs_diff(o[1], t64[1]) <= error_bound(max_abs_diff(t32[1], t64[1])), "weights"
    for name, g, g32, g64 in zip(["query", "key", "value"], o[2], t32[2], t64[2]):
        assert max_abs_diff(g, g64) <= grad_bound(max_abs_diff(g32, g64), g64), f"d{name}"
    assert sorted(o[3]) == sorted(t64[3])
    for name in t64[3]:
        assert max_abs_diff(o[3][name], t64[3][name]) <= grad_bound(max_abs_diff(t32[3][name], t64[3][name]),
                                                                    t64[3][name]), f"d{name}"


# ---- errors and the rest ------------------------------------------------------------------------------

def test_scripted_module_errors_name_the_argument():
    scripted = torch.jit.script(mha_torch.MultiheadAttention(8, 2, kdim=4))
    q, k, v = torch.randn(3, 2, 8), torch.randn(5, 2, 4), torch.randn(5, 2, 8)
    with pytest.raises(RuntimeError, match="value: expected"):
        scripted(q, k, v[..., :7])
    with pytest.raises(RuntimeError, match="query: expected torch.float32"):
        scripted(q.to(torch.int32), k, v)
    with pytest.raises(RuntimeError, match="attn_mask"):
        scripted(q, k, v, attn_mask=torch.zeros(4, 4, dtype=torch.bool))
    out, _ = scripted(q, k, v)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), scripted.out_proj.weight, create_graph=True)


def test_eager_errors_stay_mha_errors_with_the_operator():
    m = mha_torch.MultiheadAttention(8, 2, kdim=4)
    q, k, v = torch.randn(3, 2, 8), torch.randn(5, 2, 4), torch.randn(5, 2, 8)
    with pytest.raises(mha.Error, match="^value: expected"):
        m(q, k, v[..., :7])


def test_operator_reads_parameter_updates_and_pools_layers():
    """Each call copies the current parameters (an in-place update is seen at the next forward); a graph
    kept alive holds its layer, so two forwards before their backwards give each its own gradients."""
    torch.manual_seed(0)
    m = mha_torch.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    before, _ = m(x, x, x)
    with torch.no_grad():
        m.out_proj.bias.add_(1.0)
    after, _ = m(x, x, x)
    assert torch.allclose(after - before, torch.ones_like(before), atol=1e-6)
    x1, x2 = torch.randn(2, 3, 8, requires_grad=True), torch.randn(2, 3, 8, requires_grad=True)
    o1, _ = m(x1, x1, x1)
    o2, _ = m(x2, x2, x2)
    o2.sum().backward()
    g2 = x2.grad.clone()
    o1.sum().backward()
    x1b = x1.detach().clone().requires_grad_(True)
    m(x1b, x1b, x1b)[0].sum().backward()
    assert torch.equal(x1.grad, x1b.grad) and torch.equal(x2.grad, g2)


@pytest.mark.parametrize("options", [dict(), dict(need_weights=False, is_causal=True),
                                     dict(average_attn_weights=False, attn_mask="bool3d")], ids=str)
def test_numpy_fallback_equals_the_operator_bitwise(monkeypatch, options):
    """Without the operator library (monkeypatched away) the module runs mha's layer through NumPy: the
    same C++ layer, so the same bits, forward and gradients (the fallback a build without libtorch has)."""
    torch.manual_seed(1)
    m = mha_torch.MultiheadAttention(8, 2, kdim=5, vdim=3, add_bias_kv=True)
    options = dict(options)
    if options.get("attn_mask") == "bool3d":
        options["attn_mask"] = _forbidden((2 * 2, 4, 6))
    inputs = [torch.randn(4, 2, 8), torch.randn(6, 2, 5), torch.randn(6, 2, 3)]

    def run_path():
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        m.zero_grad()
        out, weights = m(*leaves, **options)
        out.sum().backward()
        return [out, weights] + [t.grad for t in leaves] + [p.grad.clone() for p in m.parameters()]

    with_operator = run_path()
    monkeypatch.setattr(mha_torch, "_OPERATORS_LOADED", False)
    for a, b in zip(run_path(), with_operator):
        assert (a is None) == (b is None)
        if a is not None:
            assert_bitwise(a, b)


@pytest.mark.skipif(not hasattr(mha_torch, "replace_attention"), reason="mha.torch.replace_attention not there")
def test_torch_transformer_encoder_with_the_module_scripts_bitwise():
    """torch.nn.TransformerEncoder after replace_attention (training mode, so that its fast path is off and
    the module runs): scripted, outputs and gradients equal eager mode's bit for bit."""
    torch.manual_seed(3)
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(E, H, 32, dropout=0.0), 2)
    assert mha_torch.replace_attention(encoder) == 2
    x = torch.randn(L, B, E)
    eager = output_and_gradients(encoder, x)
    scripted = output_and_gradients(torch.jit.script(encoder), x)
    for a, b in zip([eager[0], eager[1], *eager[2]], [scripted[0], scripted[1], *scripted[2]]):
        assert_bitwise(a, b)


def test_dropout_masks_follow_torch_manual_seed_eager_and_scripted():
    """Training-mode dropout takes each call's seed from torch's generator (not from the pooled layer's own
    stream): torch.manual_seed repeats a call's output whichever pooled layer runs it, eager and scripted give
    the same bits after the same seed, and the next call draws another mask."""
    torch.manual_seed(0)
    module = mha_torch.MultiheadAttention(16, 4, dropout=0.5, batch_first=True)
    module.train()
    x = torch.randn(2, 5, 16)
    scripted = torch.jit.script(module)

    def call(m, seed):
        torch.manual_seed(seed)
        first = m(x, x, x, need_weights=False)[0]
        return first, m(x, x, x, need_weights=False)[0]

    a, a_next = call(module, 3)
    b, b_next = call(module, 3)
    s, s_next = call(scripted, 3)
    assert torch.equal(a, b) and torch.equal(a_next, b_next) and torch.equal(a, s) and torch.equal(a_next, s_next)
    assert not torch.equal(a, a_next)
    assert not torch.equal(call(module, 4)[0], a)
