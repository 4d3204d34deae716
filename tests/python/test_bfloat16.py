"""bfloat16 from Python: mha.torch.MultiheadAttention in torch.bfloat16 and mha.MultiheadAttention(dtype="bfloat16").

The accuracy rule (issue 12): on seeded random configurations, every bfloat16 output and gradient of
mha.torch is compared with a float64 computation (torch's own module in float64, holding the same
parameters and inputs, already rounded to bfloat16, so that the only error measured is that of the
arithmetic). Its error must be at most

    max|ours - ref64| <= 2 * max|torch_bf16 - ref64| + one bfloat16 ulp of max|ref64|   (outputs, weights)
    max|ours - ref64| <= 3 * max|torch_bf16 - ref64| + one bfloat16 ulp of max|ref64|   (gradients)

where torch_bf16 is PyTorch 1.13's own torch.nn.MultiheadAttention in bfloat16. The absolute term:
every bfloat16 result is rounded once more when it is stored, an error of up to half an ulp of its
magnitude that no implementation avoids; torch's error on a given configuration can be accidentally
small (its roundings cancel), so the bound allows one ulp (2^-7 relative to the power of two below
the largest reference magnitude: bfloat16 keeps 8 significant bits), i.e. two final roundings. A
gradient whose reference is zero or tiny is given the ulp of 2^-8 of the case's largest gradient
instead (float32 residues of cancelling sums, where torch's op order may give exact zeros).

Also: the NumPy API in bfloat16 (float32 in and out, rounding to nearest even at the boundary, the
same bits as mha.torch), the boundary without copies, a bfloat16 TransformerEncoderLayer that
trains, bitwise determinism across runs and thread counts, and the refusals of mixed dtypes.

Legend: B batch, h heads, L queries, S keys, E = embed_dim, d = E / h.
"""
import copy
import pickle

import numpy as np
import pytest
import torch

import mha
import mha.torch
from mha_reference import causal_forbidden, round_to_bfloat16

BF16_SIGNIFICANT_BITS = 8  # 7 stored + the implicit one


def bf16_ulp(scale):
    """The spacing of bfloat16 numbers at `scale` (the ulp of the largest magnitude being compared)."""
    if scale == 0.0:
        return 0.0
    return 2.0 ** (np.floor(np.log2(scale)) - (BF16_SIGNIFICANT_BITS - 1))


def max_err(a, ref):
    """max |a - ref| in float64 over all elements (0 for empty tensors)."""
    a, ref = a.detach().double(), ref.detach().double()
    assert a.shape == ref.shape, (a.shape, ref.shape)
    return float((a - ref).abs().max()) if a.numel() else 0.0


def scale_of(ref):
    return float(ref.detach().abs().max()) if ref.numel() else 0.0


# ---- random configurations ---------------------------------------------------------------------------

def random_config(rng):
    """One configuration of the accuracy sweep, drawn from `rng` (a numpy Generator)."""
    E, h = [(8, 2), (12, 3), (16, 4), (16, 1), (24, 4), (32, 8), (40, 5), (48, 4)][rng.integers(8)]
    cross_width = rng.random() < 0.3
    c = dict(E=E, h=h, kdim=int(rng.choice([5, 12, 20])) if cross_width else E,
             vdim=int(rng.choice([7, 16])) if cross_width else E,
             B=int(rng.integers(1, 4)), L=int(rng.integers(1, 10)), S=int(rng.integers(1, 12)),
             unbatched=bool(rng.random() < 0.1), batch_first=bool(rng.random() < 0.5),
             add_bias_kv=bool(rng.random() < 0.15), add_zero_attn=bool(rng.random() < 0.15),
             attn_mask=str(rng.choice(["none", "bool2d", "bool3d", "float2d", "float3d"])),
             key_padding_mask=bool(rng.random() < 0.4), causal=bool(rng.random() < 0.3),
             need_weights=bool(rng.random() < 0.6), average_attn_weights=bool(rng.random() < 0.5),
             self_attention=False)
    if c["causal"] and c["L"] > c["S"]:  # bottom-right causal: query i < L - S would see no key
        c["L"], c["S"] = c["S"], c["L"]
    if not cross_width and rng.random() < 0.25:
        c["S"], c["self_attention"] = c["L"], True
    if c["unbatched"]:
        c["B"] = 1
    return c


def config_name(c):
    return (f"E{c['E']}h{c['h']}k{c['kdim']}v{c['vdim']}-B{'u' if c['unbatched'] else c['B']}L{c['L']}S{c['S']}"
            f"{'-bf' if c['batch_first'] else ''}{'-biaskv' if c['add_bias_kv'] else ''}"
            f"{'-zero' if c['add_zero_attn'] else ''}-{c['attn_mask']}{'-kpm' if c['key_padding_mask'] else ''}"
            f"{'-causal' if c['causal'] else ''}{'-self' if c['self_attention'] else ''}"
            f"{'-w' if c['need_weights'] else ''}{'avg' if c['need_weights'] and c['average_attn_weights'] else ''}")


def make_case(c, seed):
    """The three modules (torch bf16, torch float64, ours bf16) holding the same bf16 parameters, and
    the inputs and masks for each: {"theirs": kwargs, "ref": kwargs, "ours": kwargs} of forward."""
    torch.manual_seed(seed)
    kwargs = dict(embed_dim=c["E"], num_heads=c["h"], kdim=c["kdim"], vdim=c["vdim"],
                  batch_first=c["batch_first"], add_bias_kv=c["add_bias_kv"], add_zero_attn=c["add_zero_attn"])
    theirs = torch.nn.MultiheadAttention(**kwargs)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.5)  # nonzero biases, so that they are exercised
    theirs = theirs.bfloat16()
    ref = copy.deepcopy(theirs).double()  # the same (bf16) values in float64
    ours = mha.torch.MultiheadAttention(**kwargs, dtype=torch.bfloat16)
    ours.load_state_dict(theirs.state_dict())

    B, L, S, h = c["B"], c["L"], c["S"], c["h"]

    def sequence(n, width):
        shape = (n, width) if c["unbatched"] else (B, n, width) if c["batch_first"] else (n, B, width)
        return torch.randn(shape).bfloat16()

    query = sequence(L, c["E"])
    key = query if c["self_attention"] else sequence(S, c["kdim"])
    value = query if c["self_attention"] else sequence(S, c["vdim"])

    # Masks; column 0 is always allowed, so that no query row is fully masked (torch gives NaN there).
    mask_shape = (L, S) if c["attn_mask"].endswith("2d") else ((1 if c["unbatched"] else B) * h, L, S)
    attn_mask = None
    if c["attn_mask"].startswith("bool"):
        attn_mask = torch.rand(mask_shape) < 0.3
        attn_mask[..., 0] = False
    elif c["attn_mask"].startswith("float"):
        attn_mask = torch.randn(mask_shape)
        attn_mask[torch.rand(mask_shape) < 0.2] = -float("inf")
        attn_mask[..., 0] = torch.randn(mask_shape[:-1])
        attn_mask = attn_mask.bfloat16()  # torch's bf16 module takes float masks in its dtype
    kpm = None
    if c["key_padding_mask"]:
        kpm = torch.rand((S,) if c["unbatched"] else (B, S)) < 0.3
        kpm[..., 0] = False

    # torch 1.13 has no is_causal: it gets the causal rule inside its attn_mask.
    torch_mask = attn_mask
    if c["causal"]:
        causal = torch.from_numpy(causal_forbidden(L, S))
        if attn_mask is None:
            torch_mask = causal
        elif attn_mask.dtype == torch.bool:
            torch_mask = attn_mask | causal
        else:
            torch_mask = attn_mask.masked_fill(causal, -float("inf"))

    flags = dict(need_weights=c["need_weights"], average_attn_weights=c["average_attn_weights"])

    def inputs(dtype):
        """query, key, value as new leaves of `dtype` (one leaf for self-attention)."""
        q = query.to(dtype, copy=True).requires_grad_()
        k = q if key is query else key.to(dtype, copy=True).requires_grad_()
        v = q if value is query else value.to(dtype, copy=True).requires_grad_()
        return q, k, v

    cases = {
        "theirs": (theirs, dict(zip(("query", "key", "value"), inputs(torch.bfloat16)), attn_mask=torch_mask,
                                key_padding_mask=kpm, **flags)),
        "ref": (ref, dict(zip(("query", "key", "value"), inputs(torch.float64)),
                          attn_mask=torch_mask if torch_mask is None or torch_mask.dtype == torch.bool
                          else torch_mask.double(), key_padding_mask=kpm, **flags)),
        "ours": (ours, dict(zip(("query", "key", "value"), inputs(torch.bfloat16)), attn_mask=attn_mask,
                            key_padding_mask=kpm, is_causal=c["causal"], **flags)),
    }
    return cases


def run_case(module, kwargs, cotangent):
    """(out, weights or None, {gradient name: gradient}) of one module on one case."""
    module.zero_grad()
    out, weights = module(**kwargs)
    out.backward(cotangent.to(out.dtype))
    grads = {"query": kwargs["query"].grad}
    if kwargs["key"] is not kwargs["query"]:
        grads["key"] = kwargs["key"].grad
        grads["value"] = kwargs["value"].grad
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out, weights, grads


ACCURACY_CONFIGS = 120
_ratios = []  # (name, ours / torch error) for the summary test


def accuracy_case(index):
    rng = np.random.default_rng(1000 + index)
    c = random_config(rng)
    cases = make_case(c, seed=index)
    results = {}
    cotangent = None
    for who in ("ref", "theirs", "ours"):
        module, kwargs = cases[who]
        if cotangent is None:  # a bf16-exact dLoss/dout shared by all three
            with torch.no_grad():
                shape = module(**{**kwargs, "need_weights": False})[0].shape
            cotangent = torch.randn(shape).bfloat16().double()
        results[who] = run_case(module, kwargs, cotangent)
    return c, results


@pytest.mark.parametrize("index", range(ACCURACY_CONFIGS))
def test_accuracy_against_torch_bf16(index, one_mha_thread):
    c, results = accuracy_case(index)
    (ref_out, ref_w, ref_g), (t_out, t_w, t_g), (o_out, o_w, o_g) = (results[w] for w in ("ref", "theirs", "ours"))
    assert o_out.dtype == torch.bfloat16 and o_out.shape == ref_out.shape
    compared = [("out", o_out, t_out, ref_out, 2.0)]
    if c["need_weights"]:
        assert o_w.dtype == torch.bfloat16
        compared.append(("weights", o_w, t_w, ref_w, 2.0))
    else:
        assert o_w is None and t_w is None
    assert o_g.keys() == ref_g.keys()
    for name in ref_g:
        assert o_g[name].dtype == torch.bfloat16, name
        compared.append(("grad " + name, o_g[name], t_g[name], ref_g[name], 3.0))
    failures = []
    grad_scale = max(scale_of(ref) for what, _, _, ref, _ in compared if what.startswith("grad"))
    for what, ours, theirs, ref, factor in compared:
        err_ours, err_torch = max_err(ours, ref), max_err(theirs, ref)
        # A gradient that is (mathematically) zero or tiny is judged at 2^-8 of the case's largest
        # gradient: ours accumulates in float32 and leaves float32 residues where torch's op order
        # happens to give exact zeros (e.g. d query with S = 1, where softmax is constant).
        scale = max(scale_of(ref), grad_scale * 2.0**-BF16_SIGNIFICANT_BITS if what.startswith("grad") else 0.0)
        bound = factor * err_torch + bf16_ulp(scale)
        _ratios.append((what, err_ours / err_torch if err_torch > 0 else (0.0 if err_ours == 0 else np.inf)))
        if not err_ours <= bound:
            failures.append(f"{what}: ours {err_ours:.3g} > {bound:.3g} (torch bf16 {err_torch:.3g}, "
                            f"scale {scale_of(ref):.3g})")
    assert not failures, config_name(c) + "\n" + "\n".join(failures)


def test_accuracy_summary():
    """Runs after the sweep (same file, in order): prints the distribution of ours / torch's error."""
    if not _ratios:
        pytest.skip("the sweep did not run")
    for kind in ("out", "weights", "grad"):
        r = np.array([x for what, x in _ratios if what.startswith(kind) and np.isfinite(x)])
        if r.size:
            print(f"{kind}: {r.size} compared, ours/torch error ratio median {np.median(r):.2f}, "
                  f"90th percentile {np.percentile(r, 90):.2f}, max {r.max():.2f}")
    assert len(_ratios) >= ACCURACY_CONFIGS * 5  # out and at least four gradients per configuration


@pytest.fixture
def one_mha_thread():
    """One mha thread for many tiny calls (OpenMP barriers cost more than the work there)."""
    threads = mha.num_threads()
    mha.set_num_threads(1)
    yield
    mha.set_num_threads(threads)


# ---- the NumPy API in bfloat16 --------------------------------------------------------------------------

def bf16_pair(seed=0, **kwargs):
    """(torch's bf16 module, mha.torch bf16, mha.MultiheadAttention bf16), all holding the same parameters."""
    torch.manual_seed(seed)
    theirs = torch.nn.MultiheadAttention(**kwargs)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.5)
    theirs = theirs.bfloat16()
    ours_torch = mha.torch.MultiheadAttention(**kwargs).bfloat16()
    ours_torch.load_state_dict(theirs.state_dict())
    ours_numpy = mha.MultiheadAttention(**kwargs, dtype="bfloat16")
    ours_numpy.load_state_dict(theirs.state_dict())  # torch bf16 tensors
    return theirs, ours_torch, ours_numpy


@pytest.mark.parametrize("kwargs", [dict(embed_dim=16, num_heads=4),
                                    dict(embed_dim=12, num_heads=3, kdim=5, vdim=7, batch_first=True,
                                         add_bias_kv=True)],
                         ids=["packed", "kdim-vdim-biaskv"])
def test_numpy_api_gives_mha_torch_bits_in_float32(kwargs):
    _, ours_torch, ours_numpy = bf16_pair(**kwargs)
    B, L, S = 2, 5, 7
    E, kdim, vdim = ours_torch.embed_dim, ours_torch.kdim, ours_torch.vdim
    seq = (lambda n, w: torch.randn(B, n, w)) if ours_torch.batch_first else (lambda n, w: torch.randn(n, B, w))
    q, k, v = (x.bfloat16() for x in (seq(L, E), seq(S, kdim), seq(S, vdim)))
    mask = torch.from_numpy(causal_forbidden(L, S))
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    out_t, w_t = ours_torch(qt, kt, vt, attn_mask=mask)
    dout = torch.randn(out_t.shape).bfloat16()
    out_t.backward(dout)

    # float32 arrays holding the same bf16 values: the same computation, the same bits
    out_n, w_n = ours_numpy(*(x.float().numpy() for x in (q, k, v)), attn_mask=mask.numpy())
    assert out_n.dtype == np.float32 and w_n.dtype == np.float32
    np.testing.assert_array_equal(out_n, out_t.float().detach().numpy())
    np.testing.assert_array_equal(w_n, w_t.float().numpy())
    grads = ours_numpy.backward(dout.float().numpy())
    for name, x in (("query", qt), ("key", kt), ("value", vt)):
        assert grads[name].dtype == np.float32
        np.testing.assert_array_equal(grads[name], x.grad.float().numpy(), err_msg=name)
    for name, p in ours_torch.named_parameters():
        np.testing.assert_array_equal(grads[name], p.grad.float().numpy(), err_msg=name)


def test_numpy_api_rounds_float32_and_float64_inputs_to_nearest_even():
    _, _, layer = bf16_pair(embed_dim=8, num_heads=2)
    layer.eval()
    x = np.random.default_rng(3).standard_normal((4, 2, 8)).astype(np.float32)
    assert not np.array_equal(round_to_bfloat16(x), x)  # the rounding matters here
    expected, _ = layer(round_to_bfloat16(x), round_to_bfloat16(x), round_to_bfloat16(x))
    np.testing.assert_array_equal(layer(x, x, x)[0], expected)
    x64 = x.astype(np.float64)  # float32 values: rounding them from float64 is the same rounding
    np.testing.assert_array_equal(layer(x64, x64, x64)[0], expected)
    # a tie: 1 + 2^-8 is halfway between 1 and 1 + 2^-7, and goes to the even 1
    tie = np.full((1, 1, 8), 1 + 2**-8, np.float32)
    np.testing.assert_array_equal(layer(tie, tie, tie)[0], layer(np.ones_like(tie), np.ones_like(tie),
                                                                 np.ones_like(tie))[0])


def test_numpy_api_parameters_are_float32_copies_and_round_trip():
    theirs, _, layer = bf16_pair(embed_dim=8, num_heads=2, add_bias_kv=True)
    assert layer.dtype == "bfloat16" and "dtype=bfloat16" in repr(layer)
    state = layer.state_dict()
    assert list(state) == list(theirs.state_dict())
    for name, value in theirs.state_dict().items():
        assert state[name].dtype == np.float32
        np.testing.assert_array_equal(state[name], value.float().numpy(), err_msg=name)
    for name in ("in_proj_weight", "bias_k"):
        assert getattr(layer, name).dtype == np.float32
    assert layer.out_proj.weight.dtype == np.float32
    # float32 values that are not bfloat16 are rounded on loading; float64 too
    noisy = {n: v + np.float32(1e-3) for n, v in state.items()}
    layer.load_state_dict(noisy)
    for name, value in layer.state_dict().items():
        np.testing.assert_array_equal(value, round_to_bfloat16(noisy[name]), err_msg=name)
    layer.load_state_dict({n: v.astype(np.float64) for n, v in state.items()})
    again = mha.MultiheadAttention(8, 2, add_bias_kv=True, dtype="bfloat16")
    again.load_state_dict(layer.state_dict())
    for (n1, a), (n2, b) in zip(again.state_dict().items(), state.items()):
        assert n1 == n2
        np.testing.assert_array_equal(a, b, err_msg=n1)
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert copied.dtype == "bfloat16"
        for name, value in copied.state_dict().items():
            np.testing.assert_array_equal(value, state[name], err_msg=name)


def test_numpy_api_kv_cache_in_bfloat16_matches_the_causal_forward():
    _, _, layer = bf16_pair(embed_dim=16, num_heads=4, batch_first=True)
    layer.eval()
    x = np.random.default_rng(8).standard_normal((2, 6, 16)).astype(np.float32)  # [B, T, E]
    full, _ = layer(x, x, x, is_causal=True, need_weights=False)
    cache, steps = mha.KeyValueCache(), []
    for t in range(x.shape[1]):
        step = x[:, t:t + 1]
        layer.append_to_cache(cache, step, step)
        steps.append(layer.forward_cached(step, cache, is_causal=True, need_weights=False)[0])
    assert steps[0].dtype == np.float32
    np.testing.assert_array_equal(np.concatenate(steps, axis=1), full)


def test_numpy_api_save_and_load_keep_bfloat16(tmp_path):
    _, _, layer = bf16_pair(embed_dim=8, num_heads=2)
    layer.save(tmp_path / "layer.safetensors")
    loaded = mha.load(tmp_path / "layer.safetensors")
    assert loaded.dtype == "bfloat16"
    for (n1, a), (n2, b) in zip(loaded.state_dict().items(), layer.state_dict().items()):
        assert n1 == n2
        np.testing.assert_array_equal(a, b, err_msg=n1)


def test_bad_dtype_strings_list_the_valid_ones():
    for bad in ("bf16", "float16", "int8"):
        with pytest.raises(mha.Error, match=r'dtype: expected numpy.float32, numpy.float64 or "bfloat16", got'):
            mha.MultiheadAttention(8, 2, dtype=bad)
    with pytest.raises(mha.Error, match=r"dtype: expected torch.float32, torch.float64 or torch.bfloat16, "
                                        r"got torch.float16"):
        mha.torch.MultiheadAttention(8, 2, dtype=torch.float16)


# ---- the boundary: bf16 torch memory crosses without copies ----------------------------------------------

def test_bf16_tensors_cross_without_copies(monkeypatch):
    seen = {}
    real_forward, real_backward = mha.MultiheadAttention.forward, mha.MultiheadAttention.backward

    def spy_forward(self, query, key, value, **kwargs):
        seen["inputs"] = [x.bits.__array_interface__["data"][0] for x in (query, key, value)]
        result = real_forward(self, query, key, value, **kwargs)
        seen["outputs"] = [r.bits.__array_interface__["data"][0] for r in result]
        return result

    def spy_backward(self, grad_out):
        seen["grad_out"] = grad_out.bits.__array_interface__["data"][0]
        grads = real_backward(self, grad_out)
        seen["grads"] = {n: g.bits.__array_interface__["data"][0] for n, g in grads.items()}
        return grads

    monkeypatch.setattr(mha.MultiheadAttention, "forward", spy_forward)
    monkeypatch.setattr(mha.MultiheadAttention, "backward", spy_backward)
    monkeypatch.setattr(mha.torch, "_OPERATORS_LOADED", False)  # the NumPy path; the operator reads tensors in place
    m = mha.torch.MultiheadAttention(8, 2, kdim=4).bfloat16()
    q_leaf = torch.randn(2, 3, 8).bfloat16().requires_grad_()
    q = q_leaf.transpose(0, 1)  # [L, B, E], strided: still a view
    k, v = torch.randn(5, 2, 4).bfloat16(), torch.randn(5, 2, 8).bfloat16()
    out, weights = m(q, k, v)
    assert seen["inputs"] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    assert seen["outputs"] == [out.data_ptr(), weights.data_ptr()]
    grad_out = torch.randn(out.shape).bfloat16()
    out.backward(grad_out)
    assert seen["grad_out"] == grad_out.data_ptr()
    assert q_leaf.grad.dtype == torch.bfloat16 and m.q_proj_weight.grad.dtype == torch.bfloat16
    assert seen["grads"]["out_proj.weight"] == m.out_proj.weight.grad.data_ptr()  # autograd kept it


def test_describe_view_of_bfloat16_bits():
    bits = np.arange(24, dtype=np.uint16).reshape(2, 3, 4).transpose(2, 0, 1)
    seen = mha._core._describe_view(mha.BFloat16Bits(bits))
    assert seen["dtype"] == "bfloat16" and seen["data"] == bits.__array_interface__["data"][0]
    assert seen["shape"] == (4, 2, 3) and seen["strides"] == (1, 12, 4)
    with pytest.raises(mha.Error, match="BFloat16Bits: bits: expected an int16 or uint16 array .* got float32"):
        mha.BFloat16Bits(np.zeros(3, np.float32))


# ---- training inside torch.nn.TransformerEncoderLayer -----------------------------------------------------

def train_encoder_layer(layer, steps=40, dtype=torch.float32):
    """Adam on a tiny task (predict each position's running sum's sign); returns the losses."""
    torch.manual_seed(5)
    head = torch.nn.Linear(16, 2).to(dtype)
    opt = torch.optim.Adam(list(layer.parameters()) + list(head.parameters()), lr=1e-2)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(steps, 4, 9, 16, generator=g)  # [steps, B, T, E]
    target = (x[..., 0].cumsum(-1) > 0).long()  # [steps, B, T]: needs attention to the past
    mask = torch.from_numpy(causal_forbidden(9, 9))
    losses = []
    for step in range(steps):
        logits = head(layer(x[step].to(dtype), src_mask=mask))
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 2), target[step].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


def test_bf16_transformer_encoder_layer_trains_like_float32():
    torch.manual_seed(4)
    reference = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    ours = copy.deepcopy(reference).bfloat16()
    ours.self_attn = mha.torch.MultiheadAttention(16, 4, batch_first=True, dtype=torch.bfloat16)
    ours.self_attn.load_state_dict(reference.self_attn.state_dict())  # float32 state rounded to bf16
    theirs_bf16 = copy.deepcopy(reference).bfloat16()
    curves = {"float32": train_encoder_layer(reference),
              "torch bf16": train_encoder_layer(theirs_bf16, dtype=torch.bfloat16),
              "ours bf16": train_encoder_layer(ours, dtype=torch.bfloat16)}
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    f32, ours_curve = curves["float32"], curves["ours bf16"]
    assert ours_curve[-5:].mean() < 0.6 * ours_curve[:5].mean(), curves  # it learns
    # as much as float32 and torch's bf16 layer do: the last losses within 5% of the first loss
    assert abs(ours_curve[-5:].mean() - f32[-5:].mean()) < 0.05 * f32[0], curves
    assert abs(ours_curve[-5:].mean() - curves["torch bf16"][-5:].mean()) < 0.05 * f32[0], curves


# ---- determinism --------------------------------------------------------------------------------------------

def test_bf16_results_are_bitwise_identical_across_runs_and_thread_counts():
    torch.manual_seed(7)
    m = mha.torch.MultiheadAttention(64, 4, batch_first=True, dtype=torch.bfloat16)
    x = torch.randn(2, 256, 64).bfloat16()  # [B, L, E]: several row blocks per thread
    dout = torch.randn(2, 256, 64).bfloat16()
    threads = mha.num_threads()

    def run(n):
        mha.set_num_threads(n)
        xr = x.clone().requires_grad_()
        m.zero_grad()
        out, _ = m(xr, xr, xr, is_causal=True, need_weights=False)
        out.backward(dout)
        return [out.detach().view(torch.int16)] + [t.grad.view(torch.int16) for t in [xr, *m.parameters()]]

    try:
        runs = [run(2), run(2), run(1)]
    finally:
        mha.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


# ---- mixed dtypes are refused, naming both ----------------------------------------------------------------

def test_mixed_dtypes_are_refused_naming_both():
    m = mha.torch.MultiheadAttention(8, 2).bfloat16()
    x32, x16 = torch.randn(3, 2, 8), torch.randn(3, 2, 8).bfloat16()
    with pytest.raises(mha.Error, match=r"query: expected torch.bfloat16 \(the layer's dtype\), got torch.float32"):
        m(x32, x32, x32)
    with pytest.raises(mha.Error, match=r"key: expected torch.bfloat16 \(the layer's dtype\), got torch.float32"):
        m(x16, x32, x32)
    f32 = mha.torch.MultiheadAttention(8, 2)
    with pytest.raises(mha.Error, match=r"query: expected torch.float32 \(the layer's dtype\), got torch.bfloat16"):
        f32(x16, x16, x16)
    m.out_proj.weight = torch.nn.Parameter(m.out_proj.weight.float())
    with pytest.raises(mha.Error, match=r"out_proj.weight: expected every parameter in one of torch.float32, "
                                        r"torch.float64 or torch.bfloat16, got torch.float32 \(and torch.bfloat16"):
        m(x16, x16, x16)
    # the NumPy API: a float32 layer refuses bfloat16 bits, naming both dtypes
    bits = mha.BFloat16Bits(x16.view(torch.int16).numpy())
    with pytest.raises(mha.Error, match=r"query: expected float32 \(the layer's dtype\), got bfloat16"):
        mha.MultiheadAttention(8, 2)(bits, bits, bits)


def test_scaled_dot_product_attention_in_bfloat16_from_python():
    """mha.to_bfloat16 rounds like an independent rounding; the core takes BFloat16Bits (batched and
    unbatched), returns BFloat16Bits and a float32 lse, and equals float32 attention on the same
    bf16 numbers within bf16 precision; the backward takes them too."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, n, 16)).astype(np.float32) for n in (7, 9, 9))
    bq, bk, bv = (mha.to_bfloat16(x) for x in (q, k, v))
    for x, b in ((q, bq), (k, bk), (v, bv)):
        np.testing.assert_array_equal(mha.from_bfloat16(b), round_to_bfloat16(x))
    mask = rng.uniform(-2, 2, (7, 9))  # float64: added in float32, the bf16 core's logits' dtype
    out, lse = mha.scaled_dot_product_attention(bq, bk, bv, attn_mask=mask, is_causal=True, need_lse=True)
    assert isinstance(out, mha.BFloat16Bits) and out.shape == (2, 3, 7, 16)
    assert lse.dtype == np.float32
    want = mha.scaled_dot_product_attention(*(mha.from_bfloat16(b) for b in (bq, bk, bv)), attn_mask=mask,
                                            is_causal=True)
    got = mha.from_bfloat16(out)
    assert np.abs(got - want).max() <= 2.0 ** -7 * np.abs(want).max()
    unbatched = mha.scaled_dot_product_attention(mha.BFloat16Bits(bq.bits[1]), mha.BFloat16Bits(bk.bits[1]),
                                                 mha.BFloat16Bits(bv.bits[1]), attn_mask=mask, is_causal=True)
    np.testing.assert_array_equal(unbatched.bits, out.bits[1])
    dout = mha.to_bfloat16(rng.standard_normal((2, 3, 7, 16)))
    dq, dk, dv = mha.scaled_dot_product_attention_backward(dout, bq, bk, bv, out, lse, attn_mask=mask, is_causal=True)
    assert all(isinstance(g, mha.BFloat16Bits) for g in (dq, dk, dv)) and dk.shape == (2, 3, 9, 16)
