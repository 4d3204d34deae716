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
