"""mha.varlen_attention and mha.varlen_attention_backward: packed variable-length batches, FlashAttention's
flash_attn_varlen_func layout (q [total_q, h, d_k], k [total_k, h_kv, d_k], v [total_k, h_kv, d_v],
cu_seqlens_q / cu_seqlens_k the [n + 1] prefix sums of the sequence lengths).

Checked against
  - reference_varlen, written here in NumPy: a loop over the sequences of
        softmax(cap(q_i k_i^T * scale) - slope * |r' - j| + masks, with the sink) v_i,   r' = r + S_i - L_i
    and its analytic gradients (themselves checked by central differences in float64). The rule is the
    suite's: in float32 our error against the float64 reference is at most mha_reference.error_bound
    (2x + 1e-6) of the same reference's own error in float32, and for gradients test_backward.py's
    grad_bound (2x + 1e-5 of the largest gradient); in bfloat16 at most 2x (outputs) / 3x (gradients)
    the error of the reference computed as plain bfloat16 arithmetic does it (each stored intermediate
    rounded to bfloat16) plus one bfloat16 ulp, as test_bfloat16.py's rule; float64 within 1e-10;
  - mha.scaled_dot_product_attention (and its backward) run on each sequence alone: bit for bit (the
    same kernel on the same per-sequence shapes);
  - dropout: one call of mha.scaled_dot_product_attention over the whole pack, [1, h, total_q, total_k]
    with a block-diagonal mask, draws the same mask (each sequence's at its packed positions); the same
    seed repeats bit for bit, whatever the threads; equal sequences at other positions draw other masks.
Plus strided inputs (bit for bit the contiguous ones) and every refusal, naming the argument.

Legend: n sequences, h query heads, h_kv key/value heads, L_i / S_i the queries / keys of sequence i,
total_q = sum L_i, total_k = sum S_i, d_k, d_v head widths.
"""
import numpy as np
import pytest

import mha
from mha_reference import error_bound, max_abs_diff, round_to_bfloat16

KERNELS = {"flash": mha.Kernel.flash, "reference": mha.Kernel.reference}
BF16 = "bfloat16"


# ---- the reference ------------------------------------------------------------------------------------

def reference_sequence(q, k, v, dout, scale, causal, window, alibi, softcap, sinks, dtype, rnd):
    """One sequence: q [L, h, d_k], k [S, h_kv, d_k], v [S, h_kv, d_v], dout [L, h, d_v] ->
    out [L, h, d_v], lse [h, L], dq, dk, dv, computed in `dtype`, each stored intermediate passed
    through `rnd` (identity, or rounding to bfloat16)."""
    q, k, v, dout = (np.asarray(x, dtype) for x in (q, k, v, dout))
    L, h, _ = q.shape
    S, h_kv, _ = k.shape
    g = h // h_kv
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [S, h, d]: query head i reads i // g
    raw = rnd(np.einsum("lhd,shd->hls", q, kk) * dtype(scale))  # [h, L, S]
    logits = softcap * np.tanh(raw / softcap) if softcap else raw
    distance = (np.arange(L)[:, None] + S - L) - np.arange(S)[None, :]  # r' - j, [L, S]
    if alibi is not None:
        logits = logits - np.asarray(alibi, dtype)[:, None, None] * np.abs(distance).astype(dtype)
    forbidden = np.zeros((L, S), bool)
    if causal:
        forbidden |= distance < 0
    if window is not None:
        left, right = window
        forbidden |= ((left >= 0) & (distance > left)) | ((right >= 0) & (-distance > right))
    logits = np.where(forbidden, -np.inf, logits)
    sink = np.full((h, 1, 1), -np.inf, dtype) if sinks is None else np.asarray(sinks, dtype)[:, None, None]
    row_max = np.maximum(logits.max(axis=-1, keepdims=True), sink) if S else np.broadcast_to(sink, (h, L, 1))
    dead = np.isneginf(row_max)  # no allowed key and no sink: output 0, lse -inf
    shift = np.where(dead, 0, row_max)
    e = np.where(forbidden, 0, np.exp(logits - shift))
    total = e.sum(axis=-1, keepdims=True) + np.exp(sink - shift)
    p = rnd(np.where(dead, 0, e / np.where(dead, 1, total)))  # [h, L, S]
    lse = np.where(dead, -np.inf, shift + np.log(np.where(dead, 1, total)))[..., 0]
    out = rnd(np.einsum("hls,shd->lhd", p, vv))
    # backward (FlashAttention-2's): dP = dO V^T, dS = P * (dP - rowsum(dP * P)), through the cap
    dp = rnd(np.einsum("lhd,shd->hls", dout, vv))
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    if softcap:
        ds = ds * (1 - np.tanh(raw / softcap) ** 2)
    ds = rnd(ds)
    dq = np.einsum("hls,shd->lhd", ds, kk) * dtype(scale)
    dk = (np.einsum("hls,lhd->shd", ds, q) * dtype(scale)).reshape(S, h_kv, g, k.shape[2]).sum(axis=2)
    dv = np.einsum("hls,lhd->shd", p, dout).reshape(S, h_kv, g, v.shape[2]).sum(axis=2)
    return out, lse, rnd(dq), rnd(dk), rnd(dv)


def reference_varlen(q, k, v, dout, cu_q, cu_k, scale=None, causal=False, window=None, alibi=None, softcap=0.0,
                     sinks=None, dtype=np.float64, rnd=lambda x: x):
    """The pack, one sequence at a time: (out [total_q, h, d_v], lse [h, total_q], dq, dk, dv)."""
    scale = 1.0 / np.sqrt(q.shape[2]) if scale is None else scale
    out = np.zeros(q.shape[:2] + (v.shape[2],), dtype)
    lse = np.zeros((q.shape[1], q.shape[0]), dtype)
    dq, dk, dv = np.zeros(q.shape, dtype), np.zeros(k.shape, dtype), np.zeros(v.shape, dtype)
    for qb, qe, kb, ke in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        o, l_, gq, gk, gv = reference_sequence(q[qb:qe], k[kb:ke], v[kb:ke], dout[qb:qe], scale, causal, window,
                                               alibi, softcap, sinks, dtype, rnd)
        out[qb:qe], lse[:, qb:qe], dq[qb:qe], dk[kb:ke], dv[kb:ke] = o, l_, gq, gk, gv
    return out, lse, dq, dk, dv


# ---- configurations -------------------------------------------------------------------------------------

def draw_case(seed):
    """One seeded configuration: lengths with empty and one-token sequences, L_i != S_i, grouped heads,
    the score's variants, a dtype and a kernel."""
    r = np.random.default_rng(seed)
    h = int(r.choice([1, 2, 4, 6]))
    h_kv = int(r.choice(sorted({1, 2 if h % 2 == 0 else 1, h})))

    def length():
        u = r.random()
        # empty, one token, over the fused kernel's blocks (128 queries, 256 keys), short
        return 0 if u < 0.15 else 1 if u < 0.3 else int(r.integers(120, 300)) if u < 0.34 else int(r.integers(2, 24))
    n = 0 if seed % 60 == 0 else int(r.integers(1, 6))
    L = [length() for _ in range(n)]
    S = [length() if r.random() < 0.6 else L[i] for i in range(n)]
    return dict(seed=seed, h=h, h_kv=h_kv, L=L, S=S, d_k=int(r.choice([1, 5, 16])), d_v=int(r.choice([1, 7, 16])),
                dtype=str(r.choice(["float32", "float32", "float64", BF16])),
                kernel=str(r.choice(["flash", "reference"])), causal=bool(r.random() < 0.5),
                window=[None, None, (0, 0), (3, -1), (-1, 2), (5, 5)][r.integers(6)],
                alibi=bool(r.random() < 0.3), softcap=float(r.choice([0.0, 0.0, 0.5, 4.0])),
                sinks=bool(r.random() < 0.3), scale=None if r.random() < 0.7 else 0.3)


def case_id(seed):
    c = draw_case(seed)
    parts = [c["dtype"], c["kernel"], f"h{c['h']}kv{c['h_kv']}", f"n{len(c['L'])}"]
    parts += [name for name in ("causal", "alibi", "sinks") if c[name]]
    parts += [f"window{c['window'][0]}_{c['window'][1]}"] if c["window"] else []
    parts += [f"softcap{c['softcap']:g}"] if c["softcap"] else []
    return f"{seed}-" + "-".join(parts)


def cumulative(lengths):
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def arrays_of(c, r):
    """q, k, v, dout as float64 arrays holding exactly what the library is given (float32 or bfloat16
    values for those dtypes), the slopes and sinks, the offsets."""
    cu_q, cu_k = cumulative(c["L"]), cumulative(c["S"])
    shapes = [(cu_q[-1], c["h"], c["d_k"]), (cu_k[-1], c["h_kv"], c["d_k"]), (cu_k[-1], c["h_kv"], c["d_v"]),
              (cu_q[-1], c["h"], c["d_v"])]
    xs = [r.normal(size=s).astype(np.float32) for s in shapes]
    if c["dtype"] == BF16:
        xs = [round_to_bfloat16(x) for x in xs]
    alibi = r.uniform(0.05, 0.8, c["h"]) if c["alibi"] else None
    sinks = r.uniform(-1.0, 2.0, c["h"]) if c["sinks"] else None
    return [x.astype(np.float64) for x in xs], alibi, sinks, cu_q, cu_k


def to_library(x, dtype):
    """A float64 array as the library's input of `dtype` (bfloat16: BFloat16Bits of exact values)."""
    return mha.to_bfloat16(x) if dtype == BF16 else np.asarray(x, dtype)


def from_library(x):
    return mha.from_bfloat16(x) if isinstance(x, mha.BFloat16Bits) else np.asarray(x)


def bf16_ulp(scale):
    """The spacing of bfloat16 numbers at `scale` (8 significant bits), 0 for 0."""
    return 0.0 if scale == 0.0 else 2.0 ** (np.floor(np.log2(scale)) - 7)


def grad_bound(err32, ref64):
    """test_backward.py's gradient tolerance: 2 * float32's error + 1e-5 of the largest gradient."""
    return 2.0 * err32 + 1e-5 * max(1.0, float(np.max(np.abs(ref64))) if np.size(ref64) else 1.0)


def finite_diff(a, b):
    """max |a - b| where the reference is finite; the infinities (lse of a row with nothing to see) must match."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.array_equal(np.isinf(a), np.isinf(b)) and np.array_equal(a[np.isinf(a)], b[np.isinf(b)])
    finite = np.isfinite(b)
    return max_abs_diff(a[finite], b[finite])


def check_against_reference(name, got, ref64, ref_low, dtype, gradient):
    """The suite's rule for one result (see the module's docstring)."""
    err, err_low = finite_diff(got, ref64), finite_diff(ref_low, ref64)
    scale = float(np.max(np.abs(ref64[np.isfinite(ref64)]))) if np.isfinite(ref64).any() else 0.0
    if dtype == "float64":
        bound = 1e-10 * max(1.0, scale)
    elif dtype == "float32":
        bound = grad_bound(err_low, ref64) if gradient else error_bound(err_low)
    else:
        bound = (3.0 if gradient else 2.0) * err_low + bf16_ulp(scale)
    assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g} (plain {dtype}: {err_low:.3g})"


def options_of(c, alibi, sinks):
    return dict(is_causal=c["causal"], scale=c["scale"], window=c["window"], alibi_slopes=alibi,
                softcap=c["softcap"], sinks=sinks, kernel=KERNELS[c["kernel"]])


# ---- the reference sweep: float64 truth, float32 / bfloat16 rule, per-sequence bits ----------------------

@pytest.mark.parametrize("seed", range(300), ids=case_id)
def test_varlen_matches_the_reference_and_each_sequence_alone(seed):
    c = draw_case(seed)
    (q, k, v, dout), alibi, sinks, cu_q, cu_k = arrays_of(c, np.random.default_rng(seed))
    dtype, opts = c["dtype"], options_of(c, alibi, sinks)
    lq, lk, lv, ldout = (to_library(x, dtype) for x in (q, k, v, dout))
    out, lse = mha.varlen_attention(lq, lk, lv, cu_q, cu_k, need_lse=True, **opts)
    assert type(out) is type(lq) and lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    grads = mha.varlen_attention_backward(ldout, lq, lk, lv, out, lse, cu_q, cu_k, **opts)
    assert len(grads) == (3 if sinks is None else 4)  # with sinks: dsinks [h] last (test_sinks.py checks it)
    grads = grads[:3]
    got = [from_library(out), lse] + [from_library(g) for g in grads]
    assert [g.shape for g in got] == [(cu_q[-1], c["h"], c["d_v"]), (c["h"], cu_q[-1]), q.shape, k.shape, v.shape]

    variants = dict(scale=c["scale"], causal=c["causal"], window=c["window"], alibi=alibi, softcap=c["softcap"],
                    sinks=sinks)
    ref64 = reference_varlen(q, k, v, dout, cu_q, cu_k, **variants)
    low = dict(dtype=np.float32, rnd=round_to_bfloat16 if dtype == BF16 else (lambda x: x))
    ref_low = reference_varlen(q, k, v, dout, cu_q, cu_k, **variants, **low)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        check_against_reference(name, got[i], ref64[i], ref_low[i], dtype, gradient=i >= 2)

    # each sequence alone through scaled_dot_product_attention: the same bits
    def heads_first(x, begin, end):  # rows [begin, end) of [total, heads, d] as [1, heads, end - begin, d]
        if isinstance(x, mha.BFloat16Bits):
            return mha.BFloat16Bits(x.bits[begin:end].transpose(1, 0, 2)[None])
        return x[begin:end].transpose(1, 0, 2)[None]
    for qb, qe, kb, ke in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        if qe == qb:  # no queries: its keys' gradients are 0 (and the flash backward aborts on L = S = 0)
            assert not got[3][kb:ke].any() and not got[4][kb:ke].any()
            continue
        qi, di = heads_first(lq, qb, qe), heads_first(ldout, qb, qe)
        ki, vi = heads_first(lk, kb, ke), heads_first(lv, kb, ke)
        out_i, lse_i = mha.scaled_dot_product_attention(qi, ki, vi, need_lse=True, **opts)
        grads_i = mha.scaled_dot_product_attention_backward(di, qi, ki, vi, out_i, lse_i, **opts)[:3]  # (no dsinks)
        alone = [from_library(out_i)[0].transpose(1, 0, 2), lse_i[0]] + [from_library(g)[0].transpose(1, 0, 2)
                                                                        for g in grads_i]
        packed = [got[0][qb:qe], got[1][:, qb:qe], got[2][qb:qe], got[3][kb:ke], got[4][kb:ke]]
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), packed, alone):
            assert np.array_equal(a, b), f"{name} of sequence ({qb}:{qe}, {kb}:{ke}) differs from its own call"


@pytest.mark.parametrize("seed", range(12))
def test_reference_gradients_match_central_differences(seed):
    """reference_varlen's analytic gradients (the truth above) against central differences in float64."""
    r = np.random.default_rng(1000 + seed)
    h_kv = int(r.choice([1, 2]))
    h = h_kv * int(r.choice([1, 2]))
    L, S = [int(r.integers(0, 4)) for _ in range(3)], [int(r.integers(0, 4)) for _ in range(3)]
    cu_q, cu_k = cumulative(L), cumulative(S)
    q, k, v = (r.normal(size=s) for s in ((cu_q[-1], h, 3), (cu_k[-1], h_kv, 3), (cu_k[-1], h_kv, 2)))
    dout = r.normal(size=(cu_q[-1], h, 2))
    variants = dict(causal=bool(seed % 2), window=(1, -1) if seed % 3 == 0 else None,
                    alibi=r.uniform(0.1, 0.5, h) if seed % 4 < 2 else None, softcap=0.7 if seed % 3 == 1 else 0.0,
                    sinks=r.normal(size=h) if seed % 2 == 0 else None)
    _, _, dq, dk, dv = reference_varlen(q, k, v, dout, cu_q, cu_k, **variants)
    step = 1e-6

    def loss(q_, k_, v_):
        return float(np.sum(reference_varlen(q_, k_, v_, dout, cu_q, cu_k, **variants)[0] * dout))
    for x, analytic in ((q, dq), (k, dk), (v, dv)):
        numeric = np.zeros_like(x)
        for index in np.ndindex(*x.shape):
            saved = x[index]
            x[index] = saved + step
            up = loss(q, k, v)
            x[index] = saved - step
            down = loss(q, k, v)
            x[index] = saved
            numeric[index] = (up - down) / (2 * step)
        assert max_abs_diff(analytic, numeric) <= 1e-7


# ---- dropout ----------------------------------------------------------------------------------------------

def block_diagonal_forbidden(cu_q, cu_k, causal, window):
    """[total_q, total_k] bool, True where the packed query may not see the packed key: outside its own
    sequence, and within it as causal and window say (bottom-right aligned per sequence)."""
    forbidden = np.ones((cu_q[-1], cu_k[-1]), bool)
    for qb, qe, kb, ke in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        distance = (np.arange(qe - qb)[:, None] + (ke - kb) - (qe - qb)) - np.arange(ke - kb)[None, :]
        block = np.zeros(distance.shape, bool)
        if causal:
            block |= distance < 0
        if window is not None:
            block |= ((window[0] >= 0) & (distance > window[0])) | ((window[1] >= 0) & (-distance > window[1]))
        forbidden[qb:qe, kb:ke] = block
    return forbidden


@pytest.mark.parametrize("seed", range(24))
def test_dropout_draws_each_sequence_at_its_packed_positions(seed):
    c = draw_case(5000 + seed)
    c.update(dtype="float64" if seed % 4 == 0 else "float32", alibi=False)  # ALiBi's positions are per sequence
    if not c["L"]:
        c.update(L=[3], S=[4])
    (q, k, v, dout), _, sinks, cu_q, cu_k = arrays_of(c, np.random.default_rng(seed))
    q, k, v, dout = (x.astype(c["dtype"]) for x in (q, k, v, dout))
    opts = dict(options_of(c, None, sinks), dropout_p=0.4, dropout_seed=1234 + seed)
    out, lse = mha.varlen_attention(q, k, v, cu_q, cu_k, need_lse=True, **opts)
    dq, dk, dv = mha.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, **opts)[:3]

    forbidden = block_diagonal_forbidden(cu_q, cu_k, c["causal"], c["window"])
    whole = dict(opts, window=None, is_causal=False, attn_mask=forbidden)
    heads_first = [x.transpose(1, 0, 2)[None] for x in (q, k, v, dout)]
    out_w, lse_w = mha.scaled_dot_product_attention(*heads_first[:3], need_lse=True, **whole)
    grads_w = mha.scaled_dot_product_attention_backward(heads_first[3], *heads_first[:3], out_w, lse_w, **whole)[:3]
    tol = 1e-12 if c["dtype"] == "float64" else 1e-5
    for name, a, b in (("out", out, out_w), ("dq", dq, grads_w[0]), ("dk", dk, grads_w[1]), ("dv", dv, grads_w[2])):
        b = b[0].transpose(1, 0, 2)
        assert max_abs_diff(a, b) <= tol * max(1.0, float(np.abs(b).max()) if b.size else 1.0), name
    assert finite_diff(lse, lse_w[0]) <= tol * 10


def test_dropout_repeats_bit_for_bit_and_each_sequence_draws_its_own_mask():
    r = np.random.default_rng(7)
    L, S, h, d = 9, 13, 3, 8
    one = [r.normal(size=s).astype(np.float32) for s in ((L, h, d), (S, h, d), (S, h, d), (L, h, d))]
    q, k, v, dout = (np.concatenate([x, x]) for x in one)  # the same sequence twice
    cu_q, cu_k = np.array([0, L, 2 * L], np.int32), np.array([0, S, 2 * S], np.int32)

    def run(q_=q, seed=11, threads=None):
        if threads is not None:
            mha.set_num_threads(threads)
        out, lse = mha.varlen_attention(q_, k, v, cu_q, cu_k, dropout_p=0.5, dropout_seed=seed, need_lse=True)
        return [out, lse] + list(mha.varlen_attention_backward(dout, q_, k, v, out, lse, cu_q, cu_k,
                                                               dropout_p=0.5, dropout_seed=seed))
    saved_threads = mha.num_threads()
    try:
        first, again, one_thread = run(), run(), run(threads=1)
    finally:
        mha.set_num_threads(saved_threads)
    for a, b, c in zip(first, again, one_thread):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    out = first[0]
    assert not np.array_equal(out[:L], out[L:])  # the same sequence at other positions: another mask
    no_dropout, _ = mha.varlen_attention(q, k, v, cu_q, cu_k)
    assert np.array_equal(no_dropout[:L], no_dropout[L:])
    assert not np.array_equal(run(seed=12)[0], out)
    changed = q.copy()
    changed[:L] += 1.0  # the first sequence's queries change; the second's results do not
    other = run(q_=changed)
    assert not np.array_equal(other[0][:L], out[:L])
    assert np.array_equal(other[0][L:], out[L:]) and np.array_equal(other[1][:, L:], first[1][:, L:])
    assert np.array_equal(other[2][L:], first[2][L:]) and np.array_equal(other[3][S:], first[3][S:])


# ---- layouts -------------------------------------------------------------------------------------------

def strided_copy(x, layout):
    """x [T, heads, d] (contiguous) copied into a strided view holding the same elements: "transposed"
    (a [heads, T, d] array seen as [T, heads, d]), "columns" (every other column of a wider array) or
    "rows" (every other row of a longer one)."""
    if layout == "transposed":
        return np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)
    if layout == "columns":
        base = np.zeros(x.shape[:2] + (2 * x.shape[2],), x.dtype)
        base[:, :, ::2] = x
        return base[:, :, ::2]
    base = np.zeros((2 * x.shape[0],) + x.shape[1:], x.dtype)
    base[::2] = x
    return base[::2]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", ["float32", "float64", BF16])
def test_strided_inputs_give_the_bits_of_contiguous_ones(dtype, kernel):
    r = np.random.default_rng(3)
    cu_q, cu_k, h, h_kv, d_k, d_v = np.array([0, 5, 5, 12]), np.array([0, 7, 9, 9]), 4, 2, 6, 5
    shapes = ((cu_q[-1], h, d_k), (cu_k[-1], h_kv, d_k), (cu_k[-1], h_kv, d_v), (cu_q[-1], h, d_v))
    values = [r.normal(size=shape) for shape in shapes]
    if dtype == BF16:  # bfloat16 bit patterns, laid out like the float arrays
        contiguous = [mha.to_bfloat16(x).bits for x in values]
        wrap = mha.BFloat16Bits
    else:
        contiguous = [x.astype(dtype) for x in values]
        wrap = lambda x: x  # noqa: E731
    layouts = ("transposed", "columns", "rows", "transposed")  # q, k, v, dout
    strided = [strided_copy(x, layout) for x, layout in zip(contiguous, layouts)]
    for s, c in zip(strided, contiguous):
        assert not s.flags.c_contiguous and np.array_equal(s, c)
    strided, contiguous = [wrap(x) for x in strided], [wrap(x) for x in contiguous]
    cu_q_strided = np.repeat(cu_q.astype(np.int32), 2)[::2]  # int32 offsets with stride 2
    opts = dict(is_causal=True, kernel=KERNELS[kernel], softcap=2.0, window=(4, 1))
    out_s, lse_s = mha.varlen_attention(*strided[:3], cu_q_strided, cu_k, need_lse=True, **opts)
    out_c, lse_c = mha.varlen_attention(*contiguous[:3], cu_q, cu_k, need_lse=True, **opts)
    lse_t = np.ascontiguousarray(lse_c.T).T  # [h, total_q] as a transposed view
    grads_s = mha.varlen_attention_backward(strided[3], *strided[:3], out_s, lse_t, cu_q_strided, cu_k, **opts)
    grads_c = mha.varlen_attention_backward(contiguous[3], *contiguous[:3], out_c, lse_c, cu_q, cu_k, **opts)
    for a, b in zip([out_s, lse_s, *grads_s], [out_c, lse_c, *grads_c]):
        assert np.array_equal(from_library(a), from_library(b))


def test_offsets_as_int32_int64_or_lists_give_the_same_bits_and_empty_packs_work():
    r = np.random.default_rng(5)
    q, k, v = (r.normal(size=s).astype(np.float32) for s in ((6, 2, 4), (8, 1, 4), (8, 1, 3)))
    offsets = [([0, 2, 6], [0, 5, 8])]  # lists, then int32 and int64 arrays
    offsets += [(np.array([0, 2, 6], t), np.array([0, 5, 8], t)) for t in (np.int32, np.int64)]
    results = [mha.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, need_lse=True) for cu_q, cu_k in offsets]
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1])
    out, lse = mha.varlen_attention(q[:0], k[:0], v[:0], [0], [0], need_lse=True)  # no sequences
    assert out.shape == (0, 2, 3) and lse.shape == (2, 0)
    out, lse = mha.varlen_attention(q[:3], k[:0], v[:0], [0, 3], [0, 0], need_lse=True)  # no keys: 0 and -inf
    assert np.array_equal(out, np.zeros((3, 2, 3), np.float32)) and np.all(np.isneginf(lse))
    out, lse = mha.varlen_attention(q[:3], k[:0], v[:0], [0, 3], [0, 0], sinks=np.array([0.5, -1.0]), need_lse=True)
    assert np.array_equal(out, np.zeros((3, 2, 3), np.float32)) and np.array_equal(lse, [[0.5] * 3, [-1.0] * 3])
    dq, dk, dv = mha.varlen_attention_backward(np.ones_like(out), q[:3], k[:0], v[:0], out, lse, [0, 3], [0, 0])
    assert np.array_equal(dq, np.zeros_like(dq)) and dk.shape == (0, 1, 4) and dv.shape == (0, 1, 3)


# ---- refusals --------------------------------------------------------------------------------------------

_Q, _K, _V = np.zeros((7, 4, 8), np.float32), np.zeros((9, 2, 8), np.float32), np.zeros((9, 2, 5), np.float32)
_CU_Q, _CU_K = [0, 3, 3, 7], [0, 4, 6, 9]
_OUT, _LSE = np.zeros((7, 4, 5), np.float32), np.zeros((4, 7), np.float32)


def _forward(cu_q=_CU_Q, cu_k=_CU_K, q=_Q, k=_K, **kwargs):
    return lambda: mha.varlen_attention(q, k, _V, cu_q, cu_k, **kwargs)


def _backward(lse=_LSE, dout=_OUT, cu_q=_CU_Q, **kwargs):
    return lambda: mha.varlen_attention_backward(dout, _Q, _K, _V, _OUT, lse, cu_q, _CU_K, **kwargs)


REFUSALS = {
    "cu_q_not_from_0": (_forward(cu_q=[3, 3, 3, 7]),
                        r"^cu_seqlens_q: expected prefix sums starting at 0, got cu_seqlens_q\[0\] = 3$"),
    "cu_q_decreasing": (_forward(cu_q=[0, 4, 3, 7]), r"^cu_seqlens_q: expected non-decreasing .*cu_seqlens_q\[2\] = 3"),
    "cu_q_negative": (_forward(cu_q=[0, -1, 3, 7]), r"^cu_seqlens_q: expected non-decreasing"),
    "cu_q_wrong_end": (_forward(cu_q=[0, 3, 3, 6]), r"^cu_seqlens_q: .*ending at total_q = 7.*cu_seqlens_q\[3\] = 6"),
    "cu_k_wrong_end": (_forward(cu_k=[0, 4, 6, 10]), r"^cu_seqlens_k: .*ending at total_k = 9.*cu_seqlens_k\[3\] = 10"),
    "cu_q_float": (_forward(cu_q=np.array(_CU_Q, np.float32)), r"^cu_seqlens_q: expected an int32 or int64 .*float32"),
    "cu_k_uint8": (_forward(cu_k=np.array(_CU_K, np.uint8)), r"^cu_seqlens_k: expected an int32 or int64 .*uint8"),
    "cu_q_rank2": (_forward(cu_q=np.array([_CU_Q])), r"^cu_seqlens_q: expected an int32 or int64 .*rank 2 \[1, 4\]"),
    "cu_q_scalar": (_forward(cu_q=np.int64(7)), r"^cu_seqlens_q: .*rank 0"),
    "cu_q_none": (_forward(cu_q=None), r"^cu_seqlens_q: "),
    "cu_q_empty": (_forward(cu_q=np.zeros(0, np.int64)), r"^cu_seqlens_q: expected \[n \+ 1\] offsets"),
    "cu_k_other_n": (_forward(cu_k=[0, 9]), r"^cu_seqlens_k: expected n \+ 1 = 4 offsets, as cu_seqlens_q has, got 2"),
    "attn_mask": (_forward(attn_mask=np.zeros((7, 9), bool)), r"^attn_mask: not taken by varlen_attention: .*\[B, S\]"),
    "key_padding_mask": (_forward(key_padding_mask=np.zeros((3, 4), bool)), r"^key_padding_mask: not taken by varlen"),
    "key_lengths": (_forward(key_lengths=[4, 2, 3]), r"^key_lengths: not taken by varlen_attention"),
    "need_weights": (_forward(need_weights=True), r"^need_weights: not taken by varlen_attention: .*\[B, h, L, S\]"),
    "q_rank4": (_forward(q=_Q[None]), r"^q: expected rank 3 \[total_q, h, d_k\] \(packed sequences\)"),
    "k_heads_do_not_divide": (_forward(k=np.zeros((9, 3, 8), np.float32)), r"^k: expected a number of key/value heads"),
    "k_float64": (_forward(k=_K.astype(np.float64)), r"^k: expected float32 like q"),
    "window": (_forward(window=(-2, 0)), r"^window: "),
    "dropout_p": (_forward(dropout_p=1.0), r"^dropout_p: "),
    "backward_lse_batched_layout": (_backward(lse=np.zeros((1, 4, 7), np.float32)),
                                    r"^lse: expected shape \[h, total_q\] = \[4, 7\]"),
    "backward_lse_transposed": (_backward(lse=np.zeros((7, 4), np.float32)), r"^lse: expected shape \[h, total_q\]"),
    "backward_dout_shape": (_backward(dout=np.zeros((7, 4, 6), np.float32)),
                            r"^dout: expected shape \[total_q, h, d_v\]"),
    "backward_cu_q": (_backward(cu_q=[0, 3, 3, 8]), r"^cu_seqlens_q: .*total_q = 7"),
    "backward_mask": (_backward(attn_mask=np.zeros((7, 9), bool)), r"^attn_mask: not taken by varlen_attention"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_name_the_argument(name):
    call, message = REFUSALS[name]
    with pytest.raises(mha.Error, match=message):
        call()


def test_a_pack_of_many_short_sequences_gives_each_its_own_bits_whatever_the_threads():
    """varlen runs the short sequences of a pack many at a time, one thread each, and a long one alone with
    every thread (varlen_schedule.hpp): the split changes no bit. One thread and three give the same results,
    each sequence's rows are those of scaled_dot_product_attention on it alone, and the thread count set
    before the call is the one after it."""
    r = np.random.default_rng(21)
    lengths = [200] + [int(x) for x in r.integers(1, 13, 30)] + [0, 5]
    cu = cumulative(lengths)
    h, h_kv, d = 4, 2, 8
    q, dout = (r.normal(size=(cu[-1], h, d)).astype(np.float32) for _ in range(2))
    k, v = (r.normal(size=(cu[-1], h_kv, d)).astype(np.float32) for _ in range(2))
    sinks = np.array([0.5, -1.0, 0.0, 2.0], np.float32)
    options = dict(is_causal=True, sinks=sinks, window=(7, 0))

    def run():
        out, lse = mha.varlen_attention(q, k, v, cu, cu, need_lse=True, **options)
        return [out, lse] + list(mha.varlen_attention_backward(dout, q, k, v, out, lse, cu, cu, **options))
    saved_threads = mha.num_threads()
    try:
        mha.set_num_threads(1)
        one = run()
        mha.set_num_threads(3)
        three = run()
        assert mha.num_threads() == 3
        alone = []
        for i in range(len(lengths)):
            rows = slice(cu[i], cu[i + 1])
            x = [a[rows].transpose(1, 0, 2)[None] for a in (q, k, v, dout)]
            out, lse = mha.scaled_dot_product_attention(*x[:3], need_lse=True, **options)
            alone.append((out, lse, mha.scaled_dot_product_attention_backward(x[3], *x[:3], out, lse, **options)))
    finally:
        mha.set_num_threads(saved_threads)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), one, three):
        assert np.array_equal(a, b), name
    out, lse, dq, dk, dv, dsinks = three
    for i, (out_i, lse_i, grads_i) in enumerate(alone):
        rows = slice(cu[i], cu[i + 1])
        assert np.array_equal(out[rows], out_i[0].transpose(1, 0, 2)), i
        assert np.array_equal(lse[:, rows], lse_i[0]), i
        for name, packed, g in (("dq", dq, grads_i[0]), ("dk", dk, grads_i[1]), ("dv", dv, grads_i[2])):
            assert np.array_equal(packed[rows], g[0].transpose(1, 0, 2)), (name, i)
    summed = np.sum([np.asarray(g[3], np.float64) for _, _, g in alone], axis=0)  # d sinks: one sum per sequence
    np.testing.assert_allclose(dsinks, summed, rtol=1e-5, atol=1e-6)
