"""The NaN / Inf rule of scaled_dot_product_attention, as a table ("No silent wrong answers").

The rule:

* A NaN or Inf in a query row, in an allowed key or value, or in an allowed additive mask entry
  reaches exactly the outputs that depend on it, never as a finite number: the output row of every
  query that attends to the poisoned key (or whose q / mask entry is poisoned) is non-finite; every
  other output row is bitwise identical to the same call with the poison replaced by a finite value
  (0.5). A value at a masked or padded position changes nothing: every output is bitwise identical.
* Weights: in an affected row the allowed entries are non-finite and the masked entries exactly 0;
  other rows are bitwise those of the clean call. A value poisons the weights only through the
  logits: a poisoned value v[..., c] leaves weights and lse bitwise unchanged and makes out[..., c]
  non-finite in the rows that attend to it; the other components of those rows stay finite (equal to
  the clean call's up to rounding).
* lse: non-finite exactly in the affected rows.
* Only a row whose keys are all masked gets the defined result: output 0, weights 0, lse -inf, even
  with NaN in its q.
* Backward (dout all ones): dq rows of unaffected queries and dk / dv rows of keys that no affected
  row attends to are bitwise those of the clean call; dq of an affected row is non-finite; no gradient
  is finite where the IEEE fp64 reference (masked positions excluded, not multiplied by 0) is not;
  keys masked for every query get exactly 0 in dk and dv, and rows with no allowed key 0 in dq.
* A -inf additive entry forbids (it is no poison): the row is the reference with that position
  masked (finite), its weight exactly 0; a row whose entries all become -inf is a masked row.

Shapes: B=1, h=2, L=5, S=7, d=4 ("small") and L=S=300 ("tiled", flash float32 only: the poison sits
past the fused kernel's first query block (128) and first key block (256)). The poison is in head 1 of batch 0,
component 1; head 0 is a witness. Values elsewhere are finite, uniform in [-1, 1].

Legend: B batch, h heads, L queries, S keys, d the per-head width (d_k = d_v).
"""
import functools

import numpy as np
import pytest

import mha
from mha_reference import causal_forbidden

KERNELS = {"flash": mha.Kernel.flash, "reference": mha.Kernel.reference}
DTYPES = {"float32": np.float32, "float64": np.float64}
POISONS = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}
CLEAN = 0.5  # what the clean call has where the poisoned one has its poison

HEAD, COMPONENT, DEAD_ROW = 1, 1, 1
SHAPES = {
    #             poisoned query row, allowed key, masked key (padded: the last `pad` keys)
    "small": dict(B=1, h=2, L=5, S=7, d=4, q_row=2, key=3, masked_key=6, pad=2),
    "tiled": dict(B=1, h=2, L=300, S=300, d=4, q_row=260, key=270, masked_key=299, pad=10),
}


def attn_pattern(s):
    """The [L, S] forbidden pattern of the attn_mask kinds: key masked_key masked for every query,
    row DEAD_ROW with nothing allowed, key `key` allowed for some queries only."""
    L, S = s["L"], s["S"]
    forbid = np.zeros((L, S), bool)
    if L > 100:
        forbid |= np.random.default_rng(5).random((L, S)) < 0.1
        forbid[:150, s["key"]] = True
        forbid[s["q_row"], 0] = False
    else:
        forbid[0, 3] = forbid[2, 3] = forbid[4, 0] = True
    forbid[:, s["masked_key"]] = True
    forbid[DEAD_ROW, :] = True
    return forbid


# (mask kind, position, poison) combinations that make sense.
MASK_KINDS = ("none", "causal", "key_padding_mask", "key_lengths", "bool_attn_mask", "float_attn_mask",
              "float_key_padding_mask")
FLOAT_MASKS = ("float_attn_mask", "float_key_padding_mask")


def table():
    rows = []
    for kind in MASK_KINDS:
        positions = [("q", POISONS), ("k_allowed", POISONS), ("v_allowed", POISONS)]
        if kind in ("bool_attn_mask", "float_attn_mask"):
            positions.append(("q_of_masked_row", POISONS))
        if kind != "none":  # masked for every query (padded), or for all but the last one (causal)
            positions += [("k_masked", POISONS), ("v_masked", POISONS)]
        if kind in FLOAT_MASKS:
            positions += [("mask_entry", {"nan": np.nan, "+inf": np.inf}), ("mask_entry_forbids", {"-inf": -np.inf})]
        if kind == "float_attn_mask":
            positions.append(("mask_row_all_forbidden", {"-inf": -np.inf}))
        for position, poisons in positions:
            for poison in poisons:
                rows.append((kind, position, poison))
    return rows


TABLE = [(shape,) + row for shape in SHAPES for row in table()]


def parameters():
    """Every table row x kernel x dtype x pass; the tiled shape for flash in float32 only (the tiles
    are flash's; flash runs float64 through the reference kernel, which has none)."""
    params = []
    for row in TABLE:
        for kernel in KERNELS:
            for dtype in DTYPES:
                if row[0] == "tiled" and (kernel, dtype) != ("flash", "float32"):
                    continue
                for pass_ in ("forward", "backward"):
                    params.append(pytest.param(*row, kernel, dtype, pass_,
                                               id="-".join(row + (kernel, dtype, pass_))))
    return params


def build(shape, kind, position, poison, dtype, poisoned):
    """q, k, v, library options, allowed [B, h, L, S] and the additive mask [B, h, L, S] (fp64) of the
    poisoned (poisoned=True) or the clean call."""
    s = SHAPES[shape]
    B, h, L, S, d = s["B"], s["h"], s["L"], s["S"], s["d"]
    rng = np.random.default_rng(7)
    q, k, v = (rng.uniform(-1, 1, size).astype(dtype) for size in ((B, h, L, d), (B, h, S, d), (B, h, S, d)))
    forbid = np.zeros((B, h, L, S), bool)
    add = np.zeros((B, h, L, S))
    opts = {}
    padded = np.zeros((B, S), bool)
    padded[:, S - s["pad"]:] = True
    if kind == "causal":
        opts["is_causal"] = True
        forbid |= causal_forbidden(L, S)
    elif kind == "key_padding_mask":
        opts["key_padding_mask"] = padded
        forbid |= padded[:, None, None, :]
    elif kind == "key_lengths":
        opts["key_lengths"] = [S - s["pad"]] * B
        forbid |= padded[:, None, None, :]
    elif kind == "bool_attn_mask":
        opts["attn_mask"] = attn_pattern(s)
        forbid |= attn_pattern(s)
    elif kind == "float_attn_mask":
        opts["attn_mask"] = np.where(attn_pattern(s), -np.inf, rng.uniform(-1, 1, (L, S))).astype(dtype)
    elif kind == "float_key_padding_mask":
        opts["key_padding_mask"] = np.where(padded, -np.inf, rng.uniform(-1, 1, (B, S))).astype(dtype)
    value = POISONS[poison] if poisoned else CLEAN
    target = {"q": (q, s["q_row"]), "q_of_masked_row": (q, DEAD_ROW), "k_allowed": (k, s["key"]),
              "v_allowed": (v, s["key"]), "k_masked": (k, s["masked_key"]), "v_masked": (v, s["masked_key"])}
    if position in target:
        array, row = target[position]
        array[0, HEAD, row, COMPONENT] = value
    elif position in ("mask_entry", "mask_entry_forbids"):
        if kind == "float_attn_mask":
            opts["attn_mask"][s["q_row"], 0] = value
        else:
            opts["key_padding_mask"][0, s["key"]] = value
    elif position == "mask_row_all_forbidden":
        if poisoned:
            opts["attn_mask"][s["q_row"], :] = -np.inf
    else:
        raise AssertionError(position)
    if kind == "float_attn_mask":
        add = add + opts["attn_mask"].astype(np.float64)
    elif kind == "float_key_padding_mask":
        add = add + opts["key_padding_mask"].astype(np.float64)[:, None, None, :]
    allowed = ~forbid & ~np.isneginf(add)
    return q, k, v, opts, allowed, add


def ieee_reference(q, k, v, allowed, add, dout):
    """fp64 softmax(q k^T / sqrt(d) + add) v and its gradients, IEEE arithmetic throughout, with masked
    positions excluded (never multiplied by 0); rows with nothing allowed: out 0, lse -inf, dq 0."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    scale = 1.0 / np.sqrt(q.shape[-1])
    with np.errstate(all="ignore"):
        qk = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(axis=-1)
        logits = np.where(allowed, qk * scale + add, -np.inf)
        dead = ~allowed.any(axis=-1)
        row_max = np.where(dead, 0.0, logits.max(axis=-1))
        e = np.where(allowed, np.exp(logits - row_max[..., None]), 0.0)
        total = e.sum(axis=-1)
        p = np.where(allowed, e / total[..., None], 0.0)
        lse = np.where(dead, -np.inf, row_max + np.log(total))
        m = allowed[..., None]
        out = np.where(m, p[..., None] * v[:, :, None, :, :], 0.0).sum(axis=-2)
        dp = np.where(allowed, (dout[:, :, :, None, :] * v[:, :, None, :, :]).sum(axis=-1), 0.0)
        ds = np.where(allowed, p * (dp - (dout * out).sum(axis=-1)[..., None]), 0.0)
        dq = np.where(m, ds[..., None] * k[:, :, None, :, :], 0.0).sum(axis=-2) * scale
        dk = np.where(m, ds[..., None] * q[:, :, :, None, :], 0.0).sum(axis=-3) * scale
        dv = np.where(m, p[..., None] * dout[:, :, :, None, :], 0.0).sum(axis=-3)
    return out, p, lse, (dq, dk, dv)


@functools.lru_cache(maxsize=None)
def reference_for(shape, kind, position, poison, dtype_name):
    q, k, v, opts, allowed, add = build(shape, kind, position, poison, DTYPES[dtype_name], True)
    return ieee_reference(q, k, v, allowed, add, np.ones(q.shape[:-1] + (v.shape[-1],)))


def affected_rows(shape, position, kind, allowed):
    """[B, h, L]: the rows whose result depends on the poison (q, k, v, mask entry positions)."""
    s = SHAPES[shape]
    rows = np.zeros(allowed.shape[:-1], bool)
    if position in ("q", "q_of_masked_row"):
        row = s["q_row"] if position == "q" else DEAD_ROW
        rows[0, HEAD, row] = allowed[0, HEAD, row].any()
    elif position in ("k_allowed", "v_allowed", "k_masked", "v_masked"):
        key = s["key"] if position.endswith("allowed") else s["masked_key"]
        rows[0, HEAD] = allowed[0, HEAD, :, key]
    elif position == "mask_entry" and kind == "float_attn_mask":
        rows[:, :, s["q_row"]] = allowed[:, :, s["q_row"], 0]
    elif position == "mask_entry":
        rows[0] = allowed[0, :, :, s["key"]]
    else:
        raise AssertionError(position)
    return rows


# ---- assertions ----------------------------------------------------------------------------------

def bits(a):
    return np.ascontiguousarray(a).view(np.uint8 if a.dtype.itemsize == 1 else f"u{a.dtype.itemsize}")


def assert_bitwise(name, got, clean, where):
    """got[where] and clean[where] have the same bits (where: a boolean index of leading axes)."""
    g, c = bits(got)[where], bits(clean)[where]
    if not np.array_equal(g, c):
        first = tuple(np.argwhere(where)[np.argwhere((g != c).reshape(len(g), -1).any(axis=-1))[0][0]]) \
            if g.ndim > 1 else tuple(np.argwhere(where)[np.argwhere(g != c)[0][0]])
        raise AssertionError(f"{name}: differs from the clean call where the poison cannot reach, first at "
                             f"{first}: {got[first]!r} vs clean {clean[first]!r}")


def assert_nonfinite(name, got, where, what, ref=None):
    """got[where] holds no finite number. ref (the IEEE fp64 reference) only enriches the message."""
    sel = got[where]
    if np.isfinite(sel).any():
        bad = tuple(np.argwhere(where)[np.argwhere(np.isfinite(sel).reshape(len(sel), -1).any(axis=-1))[0][0]]) \
            if sel.ndim > 1 else tuple(np.argwhere(where)[np.argwhere(np.isfinite(sel))[0][0]])
        note = ""
        if ref is not None and np.isfinite(ref[bad]).all():
            note = (" (the IEEE fp64 reference is finite there too: an infinite key or query component "
                    "can make the poisoned logit -inf, which IEEE softmax turns into weight 0)")
        raise AssertionError(f"{name}: {what} must be non-finite, is finite at {bad}: {got[bad]!r}{note}")


def assert_nonfinite_where_reference_is(name, got, ref):
    silent = ~np.isfinite(ref) & np.isfinite(got)
    if silent.any():
        first = tuple(np.argwhere(silent)[0])
        raise AssertionError(f"{name}: finite where the IEEE fp64 reference is not ({int(silent.sum())} entries), "
                             f"first at {first}: {got[first]!r} (reference {ref[first]!r})")


def assert_close(name, got, ref, dtype, atol32, atol64):
    atol = atol32 if dtype == np.float32 else atol64
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{name}: finite where the reference is")
    np.testing.assert_array_equal(got[~finite], ref[~finite].astype(dtype), err_msg=name)
    np.testing.assert_allclose(got[finite], ref[finite], rtol=0, atol=atol, err_msg=name)


def check_forward(position, affected, changed, allowed, clean, poisoned, ref):
    """The forward rule. affected: rows the poison must reach; changed: rows a -inf entry legitimately
    changes (finite, the reference with the entry masked)."""
    out, plain, w, lse = poisoned
    out_c, plain_c, w_c, lse_c = clean
    ref_out, ref_w, ref_lse, _ = ref
    dtype = out.dtype
    dead = ~allowed.any(axis=-1)
    for name, o, oc in (("out", out, out_c), ("out (need_weights=False)", plain, plain_c)):
        if position.startswith("v_"):  # a value reaches its own component only
            assert_nonfinite(name, o[..., COMPONENT], affected, "out[..., c] of a row attending to the poisoned value",
                             ref_out[..., COMPONENT])
            assert_bitwise(name, o, oc, ~affected)
            others = np.delete(o[affected], COMPONENT, axis=-1)  # do not depend on the poison: finite
            assert_close(name + " (other components of affected rows)", others,
                         np.delete(oc[affected], COMPONENT, axis=-1).astype(np.float64), dtype, 2e-6, 1e-12)
        else:
            assert_nonfinite(name, o, affected, "every entry of an affected row", ref_out)
            assert_bitwise(name, o, oc, ~affected & ~changed)
        assert_nonfinite_where_reference_is(name, o, ref_out)
        assert (o[dead] == 0).all(), f"{name}: a row with every key masked must be 0"
        assert_close(name + " (changed rows)", o[changed], ref_out[changed], dtype, 2e-6, 1e-12)
    if position.startswith("v_"):  # weights and lse do not depend on v
        assert_bitwise("weights", w, w_c, np.ones(w.shape[:-1], bool))
        assert_bitwise("lse", lse, lse_c, np.ones(lse.shape, bool))
    else:
        w_aff, allowed_aff = w[affected], allowed[affected]
        finite_allowed = np.isfinite(w_aff) & allowed_aff
        if finite_allowed.any():
            raise AssertionError(f"weights: an affected row (attending to the poison) has finite weights at "
                                 f"{int(finite_allowed.sum())} allowed entries, e.g. "
                                 f"{w_aff[finite_allowed][:4]!r}; the output there is "
                                 f"{'non-finite' if not np.isfinite(out[affected]).all() else 'finite'}")
        masked_nonzero = (w_aff != 0) & ~allowed_aff
        assert not masked_nonzero.any(), (f"weights: masked entries of an affected row must be exactly 0, "
                                          f"{int(masked_nonzero.sum())} are {w_aff[masked_nonzero][:4]!r}")
        assert_bitwise("weights", w, w_c, ~affected & ~changed)
        assert_nonfinite("lse", lse, affected, "lse of an affected row", ref_lse)
        assert_bitwise("lse", lse, lse_c, ~affected & ~changed)
    assert_nonfinite_where_reference_is("weights", w, ref_w)
    assert_nonfinite_where_reference_is("lse", lse, ref_lse)
    assert (w[dead] == 0).all(), "weights: a row with every key masked must be 0"
    assert np.isneginf(lse[dead]).all(), "lse: a row with every key masked must be -inf"
    assert (w[~allowed] == 0).all(), "weights: masked entries must be exactly 0"
    assert_close("weights (changed rows)", w[changed], ref_w[changed], dtype, 2e-6, 1e-12)
    assert_close("lse (changed rows)", lse[changed], ref_lse[changed], dtype, 2e-6, 1e-12)


def check_backward(affected, changed, allowed, allowed_clean, clean, poisoned, ref):
    dq, dk, dv = poisoned
    dq_c, dk_c, dv_c = clean
    ref_dq, ref_dk, ref_dv = ref[3]
    dtype = dq.dtype
    touched_rows = affected | changed
    touched_keys = (touched_rows[..., None] & (allowed | allowed_clean)).any(axis=-2)
    assert_bitwise("dq", dq, dq_c, ~touched_rows)
    assert_bitwise("dk", dk, dk_c, ~touched_keys)
    assert_bitwise("dv", dv, dv_c, ~touched_keys)
    if affected.any():
        rows = dq[affected]
        finite_rows = np.isfinite(rows).all(axis=-1)
        if finite_rows.any():
            first = tuple(np.argwhere(affected)[np.argwhere(finite_rows)[0][0]])
            raise AssertionError(f"dq: an affected row is finite at {first}: {dq[first]!r}")
    for name, g, r in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert_nonfinite_where_reference_is(name, g, r)
    nobody = ~allowed.any(axis=-2)  # keys no query may see
    assert (dk[nobody] == 0).all() and (dv[nobody] == 0).all(), "dk / dv of a key masked for every query must be 0"
    nobody_c = ~allowed_clean.any(axis=-2)
    assert (dk_c[nobody_c] == 0).all() and (dv_c[nobody_c] == 0).all(), "dk / dv (clean call) of a masked key must be 0"
    dead = ~allowed.any(axis=-1)
    assert (dq[dead] == 0).all(), "dq of a row with every key masked must be 0"
    assert_close("dq (changed rows)", dq[changed], ref_dq[changed], dtype, 2e-5, 1e-10)


def forward(q, k, v, opts, kernel):
    out, w, lse = mha.scaled_dot_product_attention(q, k, v, need_weights=True, need_lse=True, kernel=kernel, **opts)
    plain = mha.scaled_dot_product_attention(q, k, v, kernel=kernel, **opts)
    return out, plain, w, lse


@pytest.mark.parametrize("shape,kind,position,poison,kernel,dtype,pass_", parameters())
def test_nan_rule(shape, kind, position, poison, kernel, dtype, pass_):
    np_dtype = DTYPES[dtype]
    q, k, v, opts, allowed, _ = build(shape, kind, position, poison, np_dtype, True)
    qc, kc, vc, opts_c, allowed_c, _ = build(shape, kind, position, poison, np_dtype, False)
    ref = reference_for(shape, kind, position, poison, dtype)
    if position.startswith("mask_") and position != "mask_entry":  # -inf forbids: rows change, finitely
        affected = np.zeros(allowed.shape[:-1], bool)
        changed = (allowed != allowed_c).any(axis=-1)
        assert changed.any()
    else:
        assert (allowed == allowed_c).all()
        affected = affected_rows(shape, position, kind, allowed)
        changed = np.zeros_like(affected)
        if position.startswith("k_") and np.isinf(POISONS[poison]):
            # An infinite key component gives each attending row the logit +inf or -inf (or NaN), by
            # the sign of its q component. A -inf logit is weight 0 in IEEE arithmetic (as in PyTorch):
            # the output no longer depends on that key, so the row changes, finitely, exactly as the
            # fp64 reference says; the rows with +inf or NaN are the affected ones.
            finite_in_reference = np.isfinite(ref[0]).all(axis=-1)
            changed = affected & finite_in_reference
            affected = affected & ~finite_in_reference
    kernel = KERNELS[kernel]
    poisoned_fwd, clean_fwd = forward(q, k, v, opts, kernel), forward(qc, kc, vc, opts_c, kernel)
    if pass_ == "forward":
        check_forward(position, affected, changed, allowed, clean_fwd, poisoned_fwd, ref)
        return
    dout = np.ones(q.shape[:-1] + (v.shape[-1],), np_dtype)
    grads = mha.scaled_dot_product_attention_backward(dout, q, k, v, poisoned_fwd[0], poisoned_fwd[3],
                                                      kernel=kernel, **opts)
    grads_c = mha.scaled_dot_product_attention_backward(dout, qc, kc, vc, clean_fwd[0], clean_fwd[3],
                                                        kernel=kernel, **opts_c)
    check_backward(affected, changed, allowed, allowed_c, grads_c, grads, ref)


# ---- the defects the issue names, as cases of their own ------------------------------------------

def small_inputs(dtype, seed=11):
    r = np.random.default_rng(seed)
    return tuple(r.uniform(-1, 1, size).astype(dtype) for size in ((1, 2, 5, 4), (1, 2, 7, 4), (1, 2, 7, 4)))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_nan_in_a_query_row_gives_nan_not_zero(kernel, dtype):
    """Flash returned an output row of zeros and weights of zeros for a query row holding NaN."""
    q, k, v = small_inputs(DTYPES[dtype])
    q[0, 1, 2, :] = np.nan
    out, w, lse = mha.scaled_dot_product_attention(q, k, v, need_weights=True, need_lse=True, kernel=KERNELS[kernel])
    assert np.isnan(out[0, 1, 2]).all(), f"out row of the NaN query: {out[0, 1, 2]!r}"
    assert np.isnan(w[0, 1, 2]).all(), f"weights row of the NaN query: {w[0, 1, 2]!r}"
    assert np.isnan(lse[0, 1, 2]), f"lse of the NaN query: {lse[0, 1, 2]!r}"
    dq, _, _ = mha.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, out, lse, kernel=KERNELS[kernel])
    assert not np.isfinite(dq[0, 1, 2]).any(), f"dq row of the NaN query: {dq[0, 1, 2]!r}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_nan_in_an_allowed_key_is_not_lost(kernel, dtype):
    """Flash dropped a NaN in an allowed key: every query attends to it, so every row of that head is NaN."""
    q, k, v = small_inputs(DTYPES[dtype])
    k[0, 1, 3, 1] = np.nan
    out, w, lse = mha.scaled_dot_product_attention(q, k, v, need_weights=True, need_lse=True, kernel=KERNELS[kernel])
    assert np.isnan(out[0, 1]).all(), f"out of the poisoned head: {out[0, 1]!r}"
    assert np.isnan(w[0, 1]).all() and np.isnan(lse[0, 1]).all()
    assert np.isfinite(out[0, 0]).all() and np.isfinite(w[0, 0]).all()  # the other head is untouched


@pytest.mark.parametrize("signs", ["positive", "mixed", "negative"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_logits_that_overflow_are_not_zero(kernel, dtype, signs):
    """Finite q and k so large that q k^T overflows: flash returned 0 where the reference gave NaN.
    positive: every logit +inf; mixed: +inf and -inf; negative: every logit -inf. No key is masked,
    so no row may take the masked rows' defined result (0, lse -inf): every output is non-finite."""
    np_dtype = DTYPES[dtype]
    big = 1e20 if np_dtype == np.float32 else 1e160
    r = np.random.default_rng(12)
    q_range, k_range = {"positive": ((0.5, 1), (0.5, 1)), "mixed": ((-1, 1), (-1, 1)),
                        "negative": ((-1, -0.5), (0.5, 1))}[signs]
    q = (r.uniform(*q_range, (1, 2, 5, 4)) * big).astype(np_dtype)
    k = (r.uniform(*k_range, (1, 2, 7, 4)) * big).astype(np_dtype)
    v = r.uniform(-1, 1, (1, 2, 7, 4)).astype(np_dtype)
    assert np.isfinite(q).all() and np.isfinite(k).all()
    out, w, lse = mha.scaled_dot_product_attention(q, k, v, need_weights=True, need_lse=True, kernel=KERNELS[kernel])
    assert not np.isfinite(out).any(), (f"overflowing logits gave finite outputs in "
                                        f"{int(np.isfinite(out).all(axis=-1).sum())} of 10 rows: {out[0, 0]!r}")
    assert not np.isfinite(lse).any(), f"lse: {lse!r}"
    assert not np.isfinite(w).all(axis=-1).any(), f"a row of finite weights next to a non-finite output: {w[0, 0]!r}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_inf_in_a_float_mask_gives_nonfinite_weights_like_the_output(kernel, dtype):
    """+inf in an allowed float attn_mask entry: the output row was NaN but the weights 0."""
    np_dtype = DTYPES[dtype]
    q, k, v = small_inputs(np_dtype)
    mask = np.zeros((5, 7), np_dtype)
    mask[2, 4] = np.inf
    out, w, lse = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=True, need_lse=True,
                                                   kernel=KERNELS[kernel])
    assert not np.isfinite(out[0, :, 2]).any(), f"out row 2: {out[0, :, 2]!r}"
    assert not np.isfinite(w[0, :, 2]).any(), f"weights row 2 (the output row is non-finite): {w[0, :, 2]!r}"
    assert not np.isfinite(lse[0, :, 2]).any(), f"lse row 2: {lse[0, :, 2]!r}"
    others = np.ones(5, bool)
    others[2] = False
    assert np.isfinite(out[0][:, others]).all() and np.isfinite(w[0][:, others]).all()
