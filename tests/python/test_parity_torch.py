"""Parity of mha.MultiheadAttention with torch.nn.MultiheadAttention (PyTorch 1.13).

Each of N_CONFIGS seeded random configurations is one test per kernel (flash, reference) whose id
spells the configuration out. Both modules hold the same weights (torch's state_dict is loaded into
ours) and see the same inputs.

The rule (as in flash-attention's tests), for the output and the weights separately:

    max|ours - torch_fp64| <= 2 * max|torch_fp32 - torch_fp64| + 1e-6

where torch_fp64 is the same torch module converted with .double() and fed the same inputs in
float64. Where torch returns NaN (a query row whose keys are all masked), the expected value is
mha's defined result instead: the per-head output is 0, so the layer's output row equals
out_proj.bias (0 without bias), and the row's weights are 0.

Legend: B batch, h heads, L queries, S keys, E = h * head_dim.
"""
import copy
import dataclasses
import functools
from typing import Optional

import numpy as np
import pytest
import torch

import mha
from mha_reference import error_bound, max_abs_diff

N_CONFIGS = 320  # L, S in 1..130
N_LONG = 24       # then a few with S up to 700, so that the flash kernel crosses several key tiles
LAYOUTS = ("batch_first", "seq_first", "unbatched")
MASK_KINDS = ("none", "bool2d", "bool3d", "float2d", "float3d")


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int
    layout: str            # how the inputs are laid out, see LAYOUTS
    batch_first: bool      # the modules' flag (ignored by both for unbatched input)
    B: int
    L: int
    S: int
    num_heads: int
    head_dim: int
    kdim: Optional[int]
    vdim: Optional[int]
    bias: bool
    add_bias_kv: bool
    add_zero_attn: bool
    self_attention: bool   # query, key and value are the same array
    mask_kind: str         # see MASK_KINDS
    key_padding: bool
    mask_p: float          # probability that a mask forbids a position
    float_inf: bool        # a float attn_mask also gets -inf entries
    full_rows: bool        # some query rows are fully masked on purpose
    need_weights: bool
    average: bool          # average_attn_weights
    check_fp64: bool       # also run a float64 module of ours

    @property
    def embed_dim(self):
        return self.num_heads * self.head_dim

    @property
    def extra_keys(self):
        return int(self.add_bias_kv) + int(self.add_zero_attn)

    @property
    def id(self):
        parts = [f"{self.seed:03d}", self.layout, f"B{self.B}", f"L{self.L}", f"S{self.S}",
                 f"h{self.num_heads}x{self.head_dim}"]
        if self.kdim is not None:
            parts.append(f"kdim{self.kdim}")
        if self.vdim is not None:
            parts.append(f"vdim{self.vdim}")
        if not self.bias:
            parts.append("nobias")
        if self.add_bias_kv:
            parts.append("biaskv")
        if self.add_zero_attn:
            parts.append("zeroattn")
        if self.self_attention:
            parts.append("self")
        if self.mask_kind != "none":
            parts.append(self.mask_kind + ("inf" if self.mask_kind.startswith("float") and self.float_inf else ""))
        if self.key_padding:
            parts.append("kpm")
        if self.mask_kind != "none" or self.key_padding:
            parts.append(f"p{self.mask_p:g}")
        if self.full_rows:
            parts.append("fullrows")
        if self.need_weights:
            parts.append("wavg" if self.average else "wheads")
        if self.check_fp64:
            parts.append("f64")
        return "-".join(parts)


def make_config(seed):
    """The configuration of test `seed`; layout and mask kind cycle, the rest is random."""
    rng = np.random.default_rng(seed)
    layout = LAYOUTS[seed % len(LAYOUTS)]
    mask_kind = MASK_KINDS[(seed // len(LAYOUTS)) % len(MASK_KINDS)]
    num_heads = int(rng.choice([1, 2, 3, 4, 8]))
    head_dim = int(rng.choice([1, 2, 4, 5, 8, 13, 16]))
    B = 1 if layout == "unbatched" else int(rng.integers(1, 5))

    def length():  # mostly short (fast), sometimes up to 130
        return int(rng.integers(1, 25)) if rng.random() < 0.7 else int(rng.integers(1, 131))

    L, S = length(), length()
    kdim = int(rng.integers(1, 41)) if rng.random() < 0.3 else None
    vdim = int(rng.integers(1, 41)) if rng.random() < 0.3 else None
    self_attention = kdim is None and vdim is None and rng.random() < 0.2
    if self_attention:
        S = L
    if seed >= N_CONFIGS:
        S = int(rng.integers(257, 701))
        L = S if self_attention else int(rng.integers(1, 300))
    key_padding = bool(rng.random() < 0.4)
    full_rows = bool(rng.random() < 0.25) and (mask_kind != "none" or key_padding)
    return Config(
        seed=seed, layout=layout,
        batch_first=layout == "batch_first" or (layout == "unbatched" and bool(rng.random() < 0.5)),
        B=B, L=L, S=S, num_heads=num_heads, head_dim=head_dim, kdim=kdim, vdim=vdim,
        bias=bool(rng.random() < 0.8), add_bias_kv=bool(rng.random() < 0.2),
        add_zero_attn=bool(rng.random() < 0.2), self_attention=self_attention,
        mask_kind=mask_kind, key_padding=key_padding, mask_p=float(rng.choice([0.05, 0.15, 0.3])),
        float_inf=bool(rng.random() < 0.6), full_rows=full_rows,
        need_weights=bool(rng.random() < 0.75), average=bool(rng.random() < 0.5),
        check_fp64=bool(rng.random() < 0.1))


CONFIGS = [make_config(seed) for seed in range(N_CONFIGS + N_LONG)]


def make_masks(cfg, rng):
    """(attn_mask or None, key_padding_mask or None, fully_masked [B, L] bool), batched shapes.

    Rows are fully masked only on purpose (cfg.full_rows), and then for every head at once, so the
    defined result of such a row is known without torch: output out_proj.bias, weights 0. Rows that
    the random masks happen to close completely are reopened at one random key.
    """
    B, h, L, S = cfg.B, cfg.num_heads, cfg.L, cfg.S
    padding = rng.random((B, S)) < cfg.mask_p if cfg.key_padding else None
    if padding is not None:  # a batch entry padded completely only on purpose (below)
        for b in np.flatnonzero(padding.all(axis=1)):
            padding[b, int(rng.integers(S))] = False
    forbid = None  # the -inf / True pattern of attn_mask
    if cfg.mask_kind != "none":
        shape = (L, S) if cfg.mask_kind.endswith("2d") else (B * h, L, S)
        random_part = cfg.mask_kind.startswith("bool") or cfg.float_inf
        forbid = (rng.random(shape) < cfg.mask_p) if random_part else np.zeros(shape, bool)

    designated = np.zeros((B, L), bool)  # rows closed on purpose, for every head
    if cfg.full_rows:
        if forbid is not None:
            for _ in range(int(rng.integers(1, max(1, L // 4) + 1))):
                i = int(rng.integers(L))
                if forbid.ndim == 2:
                    forbid[i, :] = True
                    designated[:, i] = True
                else:
                    b = int(rng.integers(B))
                    forbid[b * h:(b + 1) * h, i, :] = True
                    designated[b, i] = True
        else:
            b = int(rng.integers(B))
            padding[b, :] = True
            designated[b, :] = True

    pad = padding if padding is not None else np.zeros((B, S), bool)

    def forbidden():  # [B, h, L, S]
        f = np.broadcast_to(pad[:, None, None, :], (B, h, L, S))
        if forbid is not None:
            f = f | (forbid if forbid.ndim == 2 else forbid.reshape(B, h, L, S))
        return f

    # Reopen the rows that the random masks closed by chance.
    full = forbidden().all(axis=-1)  # [B, h, L]
    for b, head, i in np.argwhere(full):
        if designated[b, i]:
            continue
        j = int(rng.choice(np.flatnonzero(~pad[b])))  # a key open in this batch entry
        if forbid.ndim == 2:
            forbid[i, j] = False
        else:
            forbid[b * h + head, i, j] = False
    full = forbidden().all(axis=-1)
    assert (full.all(axis=1) == designated).all() and (full.any(axis=1) == designated).all()
    fully_masked = full[:, 0, :] if cfg.extra_keys == 0 else np.zeros((B, L), bool)

    attn_mask = None
    if forbid is not None:
        if cfg.mask_kind.startswith("bool"):
            attn_mask = forbid
        else:
            attn_mask = rng.normal(0.0, 2.0, forbid.shape).astype(np.float32)
            attn_mask[forbid] = -np.inf
    return attn_mask, padding, fully_masked


def unbatch(cfg, x, batch_axis):
    return x if x is None or cfg.layout != "unbatched" else x.take(0, axis=batch_axis)


def run_torch(module, dtype, cfg, query, key, value, key_padding_mask, attn_mask):
    """torch's (out, weights) as NumPy arrays; separate tensor objects keep torch off its fast path."""
    def tensor(x):
        return torch.from_numpy(np.array(x, dtype=dtype if x.dtype.kind == "f" else x.dtype))

    with torch.no_grad():
        out, weights = module(
            tensor(query), tensor(key), tensor(value),
            key_padding_mask=None if key_padding_mask is None else torch.from_numpy(key_padding_mask),
            need_weights=cfg.need_weights,
            attn_mask=None if attn_mask is None else tensor(attn_mask),
            average_attn_weights=cfg.average)
    return out.numpy(), None if weights is None else weights.numpy()


def canonical_out(cfg, out):
    """Any layout -> [B, L, E]."""
    if cfg.layout == "seq_first":
        return out.transpose(1, 0, 2)
    if cfg.layout == "unbatched":
        return out[None]
    return out


def canonical_weights(cfg, weights):
    """-> [B, L, S'] (averaged) or [B, h, L, S'] (per head)."""
    return weights[None] if cfg.layout == "unbatched" else weights


def expected_with_defined_rows(cfg, out64, weights64, fully_masked, out_proj_bias):
    """torch_fp64's results with the fully masked rows (NaN in torch) set to mha's defined result."""
    out = out64.copy()
    out[fully_masked] = out_proj_bias if out_proj_bias is not None else 0.0
    weights = None
    if weights64 is not None:
        weights = weights64.copy()
        rows = weights if cfg.average else np.moveaxis(weights, 1, 2)  # [B, L, (h,) S']
        rows[fully_masked] = 0.0
    return out, weights


def open_rows(cfg, x, fully_masked):
    """The elements of x outside the fully masked rows (where torch is defined)."""
    if cfg.need_weights and x.ndim == 4:  # per-head weights [B, h, L, S']
        x = np.moveaxis(x, 1, 2)
    return x[~fully_masked]


KERNELS = {"flash": mha.Kernel.flash, "reference": mha.Kernel.reference}


@functools.lru_cache(maxsize=2)  # the two kernels' tests of a config run one after the other
def inputs_and_torch_results(cfg):
    """The config's inputs (laid out as it says), masks, fully masked rows, torch's state_dict and
    torch's float32 and float64 (out, weights)."""
    rng = np.random.default_rng([cfg.seed, 1])
    E, h = cfg.embed_dim, cfg.num_heads
    kdim = E if cfg.kdim is None else cfg.kdim
    vdim = E if cfg.vdim is None else cfg.vdim

    # Batch-first data, then laid out as the config says.
    query = rng.normal(size=(cfg.B, cfg.L, E)).astype(np.float32)
    if cfg.self_attention:
        key = value = query
    else:
        key = rng.normal(size=(cfg.B, cfg.S, kdim)).astype(np.float32)
        value = rng.normal(size=(cfg.B, cfg.S, vdim)).astype(np.float32)
    attn_mask, key_padding_mask, fully_masked = make_masks(cfg, rng)
    if cfg.layout == "seq_first":
        query, key, value = (np.ascontiguousarray(x.transpose(1, 0, 2)) for x in (query, key, value))
        if cfg.self_attention:
            key = value = query
    query, key, value = (unbatch(cfg, x, 0) for x in (query, key, value))
    if cfg.self_attention:
        key = value = query
    key_padding_mask = unbatch(cfg, key_padding_mask, 0)

    # torch, float32 and float64, with random biases so that every parameter matters.
    torch.manual_seed(cfg.seed)
    t32 = torch.nn.MultiheadAttention(E, h, dropout=0.0, bias=cfg.bias, add_bias_kv=cfg.add_bias_kv,
                                      add_zero_attn=cfg.add_zero_attn, kdim=cfg.kdim, vdim=cfg.vdim,
                                      batch_first=cfg.batch_first)
    with torch.no_grad():
        for name, p in t32.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.5)
    t32.eval()
    t64 = copy.deepcopy(t32).double()
    state = {name: value_.numpy() for name, value_ in t32.state_dict().items()}
    out32, w32 = run_torch(t32, np.float32, cfg, query, key, value, key_padding_mask, attn_mask)
    out64, w64 = run_torch(t64, np.float64, cfg, query, key, value, key_padding_mask, attn_mask)
    return (query, key, value, attn_mask, key_padding_mask, fully_masked, state), (out32, w32, out64, w64)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.id for c in CONFIGS])
def test_parity_with_torch(cfg, kernel):
    E, h = cfg.embed_dim, cfg.num_heads
    inputs, torch_results = inputs_and_torch_results(cfg)
    query, key, value, attn_mask, key_padding_mask, fully_masked, state = inputs
    out32, w32, out64, w64 = torch_results

    # ours
    ours = mha.MultiheadAttention(E, h, bias=cfg.bias, add_bias_kv=cfg.add_bias_kv,
                                  add_zero_attn=cfg.add_zero_attn, kdim=cfg.kdim, vdim=cfg.vdim,
                                  batch_first=cfg.batch_first, seed=cfg.seed).eval()
    ours.kernel = KERNELS[kernel]
    ours.load_state_dict(state)
    out, weights = ours(query, key, value, key_padding_mask=key_padding_mask,
                        need_weights=cfg.need_weights, attn_mask=attn_mask,
                        average_attn_weights=cfg.average)

    # Shapes and dtypes exactly as torch's.
    assert out.shape == out32.shape and out.dtype == np.float32
    if cfg.need_weights:
        assert weights is not None and weights.shape == w32.shape and weights.dtype == np.float32
    else:
        assert weights is None and w32 is None

    out, out32, out64 = (canonical_out(cfg, x) for x in (out, out32, out64))
    if cfg.need_weights:
        weights, w32, w64 = (canonical_weights(cfg, x) for x in (weights, w32, w64))
    # torch is NaN exactly on the rows the generator closed (a check of the generator itself).
    np.testing.assert_array_equal(np.isnan(out64).any(axis=-1), fully_masked)

    expected_out, expected_w = expected_with_defined_rows(cfg, out64, w64, fully_masked,
                                                          state.get("out_proj.bias"))
    assert np.isfinite(out).all(), "ours has non-finite outputs"
    err32 = max_abs_diff(open_rows(cfg, out32, fully_masked), open_rows(cfg, out64, fully_masked))
    err = max_abs_diff(out, expected_out)
    assert err <= error_bound(err32), f"output: ours {err:.3g} vs torch fp32 {err32:.3g}"
    if cfg.need_weights:
        assert np.isfinite(weights).all(), "ours has non-finite weights"
        err32 = max_abs_diff(open_rows(cfg, w32, fully_masked), open_rows(cfg, w64, fully_masked))
        err = max_abs_diff(weights, expected_w)
        assert err <= error_bound(err32), f"weights: ours {err:.3g} vs torch fp32 {err32:.3g}"

    if cfg.check_fp64:  # the same computation in float64 agrees with torch's float64 to rounding
        ours64 = mha.MultiheadAttention(E, h, bias=cfg.bias, add_bias_kv=cfg.add_bias_kv,
                                        add_zero_attn=cfg.add_zero_attn, kdim=cfg.kdim, vdim=cfg.vdim,
                                        batch_first=cfg.batch_first, dtype=np.float64).eval()
        ours64.kernel = KERNELS[kernel]
        ours64.load_state_dict(state)
        as64 = (lambda x: x.astype(np.float64))
        q64 = as64(query)
        k64, v64 = (q64, q64) if cfg.self_attention else (as64(key), as64(value))
        out_d, weights_d = ours64(q64, k64, v64, key_padding_mask=key_padding_mask,
                                  need_weights=cfg.need_weights, attn_mask=attn_mask,
                                  average_attn_weights=cfg.average)
        assert out_d.dtype == np.float64
        assert max_abs_diff(canonical_out(cfg, out_d), expected_out) <= 1e-11
        if cfg.need_weights:
            assert max_abs_diff(canonical_weights(cfg, weights_d), expected_w) <= 1e-12


def test_configurations_cover_the_space():
    """The sweep reaches every feature the parity rule is meant to check, several times."""
    def count(predicate):
        return sum(1 for c in CONFIGS if predicate(c))

    assert len(CONFIGS) >= 300
    assert count(lambda c: c.S > 256) >= 20
    for layout in LAYOUTS:
        assert count(lambda c: c.layout == layout) >= 90
    for kind in MASK_KINDS:
        assert count(lambda c: c.mask_kind == kind) >= 50
    for heads in (1, 2, 3, 4, 8):
        assert count(lambda c: c.num_heads == heads) >= 30
    for head_dim in (1, 5, 13):
        assert count(lambda c: c.head_dim == head_dim) >= 20
    assert count(lambda c: c.L != c.S) >= 200
    assert count(lambda c: max(c.L, c.S) > 64) >= 40
    assert {c.B for c in CONFIGS} == {1, 2, 3, 4}
    assert count(lambda c: not c.bias) >= 30
    assert count(lambda c: c.add_bias_kv) >= 30
    assert count(lambda c: c.add_zero_attn) >= 30
    assert count(lambda c: c.kdim is not None and c.kdim != c.embed_dim) >= 50
    assert count(lambda c: c.vdim is not None and c.vdim != c.embed_dim) >= 50
    assert count(lambda c: c.self_attention) >= 20
    assert count(lambda c: c.key_padding) >= 80
    assert count(lambda c: c.mask_kind.startswith("float") and c.float_inf) >= 30
    assert count(lambda c: c.full_rows and c.extra_keys == 0) >= 30
    assert count(lambda c: c.need_weights and c.average) >= 80
    assert count(lambda c: c.need_weights and not c.average) >= 80
    assert count(lambda c: not c.need_weights) >= 40
    assert count(lambda c: c.check_fp64) >= 15
