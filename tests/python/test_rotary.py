"""Rotary position embeddings: mha.apply_rotary and mha.apply_rotary_backward (include/mha/rotary.hpp).

The oracle, rope_reference, is written here from the paper's complex form (Su et al. 2021, section 3.2.1): each
pair (a, b) of a row is the complex number z = x_a + i x_b, multiplied by exp(i theta) with
theta = position * base^(-2i / r), all in float64. Against it:

* both pairings (GPT-NeoX "rotate half" and GPT-J interleaved), partial rotary_dim, the three forms of
  positions (None, [L], [B, L], int64 and int32), float32 / float64 / bfloat16;
* positions of 1e5 .. 1e6: the float32 result is within a few float32 ulps (of the pair's magnitude) of
  the float64 oracle, which a float32 angle misses by orders of magnitude (checked too, so the test
  can tell them apart);
* the backward is the transpose (<R x, y> = <x, R^T y>) and matches central finite differences;
* strided inputs (the layer's [B, L, h, d] transposed, reversed, broadcast, a non-unit last stride)
  give the bits of their contiguous copies; results do not depend on the thread count;
* hypothesis over shapes with empty dimensions, d = 2, every even rotary_dim, dtypes and pairings;
* every refusal names its argument; a NaN or Inf reaches exactly its pair's two outputs.

Legend: B batch, h heads, L positions, d head width, r rotary_dim.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mha

F32_EPS = 2.0**-24  # the unit roundoff of float32 (half an ulp of 1)
BF16_EPS = 2.0**-8  # half an ulp of 1 in bfloat16 (8 significant bits)


# ---- the oracle ------------------------------------------------------------------------------------------

def pair_indices(r, interleaved):
    """(a, b): the r/2 pairs of components rotated together."""
    i = np.arange(r // 2)
    return (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)


def positions_bl(positions, B, L):
    """positions as a float64 [B, L] array (None: 0..L-1 in every row; [L]: shared)."""
    if positions is None:
        return np.broadcast_to(np.arange(L, dtype=np.float64), (B, L))
    p = np.asarray(positions).astype(np.float64)
    return np.broadcast_to(p, (B, L)) if p.ndim == 1 else p


def rope_reference(x, positions=None, base=10000.0, rotary_dim=None, interleaved=False, inverse=False):
    """y = R x (inverse: R^T x) in float64, from the complex form: z_i = x_a + i x_b times exp(+-i theta_i)."""
    x = np.asarray(x, dtype=np.float64)
    B, h, L, d = x.shape
    r = d if rotary_dim is None else rotary_dim
    a, b = pair_indices(r, interleaved)
    inv_freq = base ** (-2.0 * np.arange(r // 2) / r)                      # [r/2]
    theta = positions_bl(positions, B, L)[:, None, :, None] * inv_freq     # [B, 1, L, r/2]
    z = (x[..., a] + 1j * x[..., b]) * np.exp((-1j if inverse else 1j) * theta)
    y = x.copy()
    y[..., a], y[..., b] = z.real, z.imag
    return y


def pair_magnitude(x, rotary_dim=None, interleaved=False):
    """|x_a| + |x_b| at each component of a pair (|x_c| for the components left alone): the scale of
    the rounding error a rotated component may carry."""
    x = np.abs(np.asarray(x, dtype=np.float64))
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    a, b = pair_indices(r, interleaved)
    m = x.copy()
    m[..., a] = m[..., b] = x[..., a] + x[..., b]
    return m


def random_x(shape, seed, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def as_dtype(x, dtype):
    """x for the library in `dtype` ("bfloat16": a BFloat16Bits) and the values it then holds, float64."""
    if dtype == "bfloat16":
        bits = mha.to_bfloat16(x)
        return bits, mha.from_bfloat16(bits).astype(np.float64)
    x = np.asarray(x, dtype=dtype)
    return x, x.astype(np.float64)


def values_of(y):
    """A result as float64 values (a BFloat16Bits through float32, exactly)."""
    return (mha.from_bfloat16(y) if isinstance(y, mha.BFloat16Bits) else y).astype(np.float64)


def max_angle(positions, L, base, rotary_dim, d):
    """The largest |theta| a call forms: the largest position times the largest inv_freq."""
    r = d if rotary_dim is None else rotary_dim
    if r == 0 or L == 0:
        return 0.0
    largest = (L - 1) if positions is None else (int(np.max(positions)) if np.size(positions) else 0)
    return largest * float(np.max(base ** (-2.0 * np.arange(r // 2) / r)))


def assert_matches_reference(got, x64, dtype, positions=None, base=10000.0, rotary_dim=None, interleaved=False,
                             inverse=False):
    """got against rope_reference(x64, ...) by the dtype's rule, in units of the pair's magnitude:
    float64 within 8 float64 roundoffs times (1 + the largest angle) (an angle of 1e6 is itself known
    only to 1e-10); float32 within 4 float32 unit roundoffs (the float64 angle's error is far below
    them); bfloat16 within one bfloat16 rounding of the reference (half an ulp, 2^-8 relative) plus the
    float32 arithmetic before it."""
    ref = rope_reference(x64, positions, base, rotary_dim, interleaved, inverse)
    scale = pair_magnitude(x64, rotary_dim, interleaved)
    if dtype == np.float64:
        bound = 8 * 2.0**-53 * (1 + max_angle(positions, x64.shape[2], base, rotary_dim, x64.shape[3])) * scale
    elif dtype == np.float32:
        bound = 4 * F32_EPS * scale
    else:
        bound = BF16_EPS * np.abs(ref) + 4 * F32_EPS * scale
    err = np.abs(got - ref)
    worst = np.argmax(err - bound) if err.size else 0
    assert np.all(err <= bound), f"error {err.flat[worst]:.3g} where the bound is {bound.flat[worst]:.3g}"


# ---- the oracle itself -----------------------------------------------------------------------------------

def test_oracle_by_hand():
    """d = 2, one position: the pair rotates by theta = position (inv_freq_0 = 1), as written out."""
    x = np.array([0.5, -2.0]).reshape(1, 1, 1, 2)
    y = rope_reference(x, np.array([3]))
    c, s = np.cos(3.0), np.sin(3.0)
    np.testing.assert_allclose(y.ravel(), [0.5 * c + 2.0 * s, -2.0 * c + 0.5 * s], rtol=0, atol=1e-15)


# ---- against the oracle ----------------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [None, 8, 2], ids=["r=d", "r=8", "r=2"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, "bfloat16"], ids=["f64", "f32", "bf16"])
def test_matches_reference(dtype, rotary_dim, interleaved):
    B, h, L, d = 2, 3, 7, 12
    x, x64 = as_dtype(random_x((B, h, L, d), 1), dtype)
    pos_shared = np.array([0, 3, 4, 9, 100, 101, 5000])
    pos_rows = np.array([[0, 0, 0, 1, 2, 3, 4], [7, 8, 9, 10, 11, 12, 13]])
    for positions in [None, pos_shared, pos_rows, pos_rows.astype(np.int32)]:
        for base in [10000.0, 500000.0, 1.0, 0.5]:
            kw = dict(base=base, rotary_dim=rotary_dim, interleaved=interleaved)
            got = values_of(mha.apply_rotary(x, positions, **kw))
            assert_matches_reference(got, x64, dtype, positions, **kw)
            back = values_of(mha.apply_rotary_backward(x, positions, **kw))
            assert_matches_reference(back, x64, dtype, positions, **kw, inverse=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, "bfloat16"], ids=["f64", "f32", "bf16"])
def test_components_past_rotary_dim_are_copied_bitwise(dtype):
    x, _ = as_dtype(random_x((2, 2, 5, 10), 2), dtype)
    y = mha.apply_rotary(x, rotary_dim=4)
    if dtype == "bfloat16":
        assert isinstance(y, mha.BFloat16Bits)
        np.testing.assert_array_equal(y.bits[..., 4:], x.bits[..., 4:])
    else:
        assert y.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(y[..., 4:], x[..., 4:])


def test_position_forms_agree():
    """None is 0..L-1; [L] is the same row for every batch row; int32 is int64; [B, L] per row."""
    B, h, L, d = 3, 2, 6, 8
    x = random_x((B, h, L, d), 3)
    arange = np.arange(L)
    y = mha.apply_rotary(x)
    np.testing.assert_array_equal(y, mha.apply_rotary(x, arange))
    np.testing.assert_array_equal(y, mha.apply_rotary(x, np.tile(arange, (B, 1))))
    np.testing.assert_array_equal(y, mha.apply_rotary(x, arange.astype(np.int32)))
    np.testing.assert_array_equal(y, mha.apply_rotary(x, list(range(L))))
    left_padded = np.array([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 1]])
    y_rows = mha.apply_rotary(x, left_padded)
    for b in range(B):  # each batch row rotated as if alone, with its own positions
        np.testing.assert_array_equal(y_rows[b:b + 1], mha.apply_rotary(x[b:b + 1], left_padded[b]))


def test_relative_position_property():
    """<R(m) q, R(n) k> depends on m - n only (the point of RoPE), in float64."""
    q, k = random_x((1, 1, 1, 16), 4), random_x((1, 1, 1, 16), 5)
    def score(m, n):
        return float(np.vdot(mha.apply_rotary(q, [m]), mha.apply_rotary(k, [n])))
    for m, n, t in [(5, 2, 1), (0, 9, 1000), (12345, 12000, 77777)]:
        assert score(m, n) == pytest.approx(score(m + t, n + t), rel=1e-11, abs=1e-11)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_large_positions_use_float64_angles(interleaved):
    """At positions 1e5 .. 1e6 a float32 angle is off by up to ~0.06 rad; ours is computed in float64, so
    the float32 result stays within a few float32 roundoffs of the float64 oracle."""
    B, h, L, d = 2, 2, 9, 64
    positions = np.array([[100_000, 123_457, 250_001, 399_999, 500_000, 654_321, 777_777, 999_983, 1_000_000],
                          [100_003, 200_000, 300_007, 400_000, 500_009, 600_000, 700_001, 800_000, 999_999]])
    x32 = random_x((B, h, L, d), 6, np.float32)
    x64 = x32.astype(np.float64)
    ref = rope_reference(x64, positions, interleaved=interleaved)
    scale = pair_magnitude(x64, interleaved=interleaved)
    got = mha.apply_rotary(x32, positions, interleaved=interleaved).astype(np.float64)
    assert np.all(np.abs(got - ref) <= 4 * F32_EPS * scale)
    assert_matches_reference(mha.apply_rotary(x64, positions, interleaved=interleaved), x64, np.float64, positions,
                             interleaved=interleaved)

    # The same rotation with the angle formed in float32: the test would see it.
    a, b = pair_indices(d, interleaved)
    inv_freq = (10000.0 ** (-2.0 * np.arange(d // 2) / d)).astype(np.float32)
    theta32 = (positions.astype(np.float32)[:, None, :, None] * inv_freq).astype(np.float64)
    naive = x64.copy()
    naive[..., a] = x64[..., a] * np.cos(theta32) - x64[..., b] * np.sin(theta32)
    naive[..., b] = x64[..., b] * np.cos(theta32) + x64[..., a] * np.sin(theta32)
    assert np.max(np.abs(naive - ref) / scale) > 1000 * 4 * F32_EPS


# ---- the backward ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [None, 6], ids=["r=d", "r=6"])
def test_backward_is_the_transpose(rotary_dim, interleaved):
    """<R x, y> = <x, R^T y> in float64, and R^T R x = x."""
    B, h, L, d = 2, 3, 5, 10
    x, y = random_x((B, h, L, d), 7), random_x((B, h, L, d), 8)
    positions = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 35]])
    kw = dict(rotary_dim=rotary_dim, interleaved=interleaved, base=300.0)
    rx = mha.apply_rotary(x, positions, **kw)
    rty = mha.apply_rotary_backward(y, positions, **kw)
    assert np.vdot(rx, y) == pytest.approx(np.vdot(x, rty), rel=1e-13)
    np.testing.assert_allclose(mha.apply_rotary_backward(rx, positions, **kw), x, rtol=0, atol=1e-14)


def test_backward_matches_finite_differences():
    """dLoss/dx for Loss = sum(w * R x), by central differences at every element, is R^T w."""
    B, h, L, d = 1, 2, 3, 6
    x, w = random_x((B, h, L, d), 9), random_x((B, h, L, d), 10)
    positions = np.array([0, 17, 123456])
    kw = dict(rotary_dim=4, interleaved=True)
    grad = mha.apply_rotary_backward(w, positions, **kw)
    eps = 1e-6
    numeric = np.zeros_like(x)
    for k in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[k] += eps
        minus[k] -= eps
        loss_plus = np.sum(w * mha.apply_rotary(plus, positions, **kw))
        loss_minus = np.sum(w * mha.apply_rotary(minus, positions, **kw))
        numeric[k] = (loss_plus - loss_minus) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, rtol=0, atol=1e-8)


# ---- strides and threads ---------------------------------------------------------------------------------

def strided_views(seed, dtype):
    """(name, view) pairs of [2, 3, 5, 8] arrays with unusual strides."""
    rng_x = random_x((2, 5, 3, 8), seed, dtype)  # the layer's [B, L, h, d]
    wide = random_x((2, 3, 5, 16), seed + 1, dtype)
    one_head = random_x((2, 1, 5, 8), seed + 2, dtype)
    return [
        ("transposed", rng_x.transpose(0, 2, 1, 3)),
        ("reversed", random_x((2, 3, 5, 8), seed + 3, dtype)[:, ::-1, ::-1, :]),
        ("reversed_last", random_x((2, 3, 5, 8), seed + 4, dtype)[..., ::-1]),
        ("broadcast_heads", np.broadcast_to(one_head, (2, 3, 5, 8))),
        ("every_other_component", wide[..., ::2]),
        ("fortran", np.asfortranarray(random_x((2, 3, 5, 8), seed + 5, dtype))),
    ]


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_strided_inputs_match_contiguous_copies(dtype, interleaved):
    positions = np.array([[5, 4, 3, 2, 1], [0, 10, 20, 30, 40]])
    for name, view in strided_views(11, dtype):
        contiguous = np.ascontiguousarray(view)
        for fn in (mha.apply_rotary, mha.apply_rotary_backward):
            for rotary_dim in (None, 4):
                got = fn(view, positions, rotary_dim=rotary_dim, interleaved=interleaved)
                want = fn(contiguous, positions, rotary_dim=rotary_dim, interleaved=interleaved)
                np.testing.assert_array_equal(got, want, err_msg=f"{name} {fn.__name__} r={rotary_dim}")


def test_strided_bfloat16_matches_contiguous_copy():
    bits = mha.to_bfloat16(random_x((2, 5, 3, 8), 12)).bits
    view = mha.BFloat16Bits(bits.transpose(0, 2, 1, 3))
    contiguous = mha.BFloat16Bits(np.ascontiguousarray(bits.transpose(0, 2, 1, 3)))
    np.testing.assert_array_equal(mha.apply_rotary(view).bits, mha.apply_rotary(contiguous).bits)


def test_strided_positions():
    x = random_x((2, 2, 4, 6), 13)
    positions = np.arange(16).reshape(2, 8)
    np.testing.assert_array_equal(mha.apply_rotary(x, positions[:, ::2]),
                                  mha.apply_rotary(x, np.ascontiguousarray(positions[:, ::2])))
    np.testing.assert_array_equal(mha.apply_rotary(x, positions[0, 3::-1]), mha.apply_rotary(x, [3, 2, 1, 0]))


def test_result_does_not_depend_on_the_thread_count():
    """A call large enough to run in parallel (over 5e6 flops) gives the bits of a one-thread call."""
    x = random_x((2, 8, 1024, 128), 14, np.float32)
    positions = np.arange(2 * 1024).reshape(2, 1024) * 7
    many = mha.apply_rotary(x, positions)
    saved = mha.num_threads()
    try:
        mha.set_num_threads(1)
        one = mha.apply_rotary(x, positions)
    finally:
        mha.set_num_threads(saved)
    np.testing.assert_array_equal(many, one)
    ref = rope_reference(x[:, :1, :64], positions[:, :64])
    assert np.all(np.abs(many[:, :1, :64] - ref) <= 4 * F32_EPS * pair_magnitude(x[:, :1, :64]))


# ---- hypothesis ------------------------------------------------------------------------------------------

@st.composite
def rotary_cases(draw):
    B, h, L = draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.integers(0, 6))
    d = draw(st.integers(2, 12))
    choices = ([None] if d % 2 == 0 else []) + list(range(2, d + 1, 2))
    rotary_dim = draw(st.sampled_from(choices))
    kind = draw(st.sampled_from(["none", "shared", "rows"]))
    values = st.integers(0, 2_000_000)
    positions = None
    if kind == "shared":
        positions = np.array(draw(st.lists(values, min_size=L, max_size=L)), dtype=np.int64)
    elif kind == "rows":
        positions = np.array(draw(st.lists(values, min_size=B * L, max_size=B * L)), dtype=np.int64).reshape(B, L)
    dtype = draw(st.sampled_from([np.float64, np.float32, "bfloat16"]))
    return (B, h, L, d), rotary_dim, positions, dtype, draw(st.booleans()), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=60, deadline=None)
@given(rotary_cases())
def test_hypothesis_against_reference(case):
    shape, rotary_dim, positions, dtype, interleaved, seed = case
    x, x64 = as_dtype(random_x(shape, seed), dtype)
    for inverse, fn in ((False, mha.apply_rotary), (True, mha.apply_rotary_backward)):
        got = values_of(fn(x, positions, rotary_dim=rotary_dim, interleaved=interleaved))
        assert got.shape == shape
        assert_matches_reference(got, x64, dtype, positions, rotary_dim=rotary_dim, interleaved=interleaved,
                                 inverse=inverse)


# ---- refusals --------------------------------------------------------------------------------------------

X = np.zeros((2, 3, 4, 8))


@pytest.mark.parametrize("call, name", [
    (lambda: mha.apply_rotary(np.zeros((3, 4, 8))), "x"),
    (lambda: mha.apply_rotary(np.zeros((1, 2, 3, 4, 8))), "x"),
    (lambda: mha.apply_rotary(np.zeros((2, 3, 4, 8), dtype=np.int64)), "x"),
    (lambda: mha.apply_rotary(np.zeros((2, 3, 4, 8), dtype=bool)), "x"),
    (lambda: mha.apply_rotary("not an array"), "x"),
    (lambda: mha.apply_rotary_backward(np.zeros((3, 4, 8))), "dy"),
    (lambda: mha.apply_rotary_backward(np.zeros((2, 3, 4, 8), dtype=np.int32)), "dy"),
    (lambda: mha.apply_rotary(X, rotary_dim=3), "rotary_dim"),
    (lambda: mha.apply_rotary(X, rotary_dim=10), "rotary_dim"),
    (lambda: mha.apply_rotary(X, rotary_dim=-2), "rotary_dim"),
    (lambda: mha.apply_rotary(X, rotary_dim=0), "rotary_dim"),
    (lambda: mha.apply_rotary(X, rotary_dim=2.0), "rotary_dim"),
    (lambda: mha.apply_rotary(np.zeros((2, 3, 4, 7))), "rotary_dim"),
    (lambda: mha.apply_rotary_backward(np.zeros((2, 3, 4, 7))), "rotary_dim"),
    (lambda: mha.apply_rotary(X, base=0.0), "base"),
    (lambda: mha.apply_rotary(X, base=-10000.0), "base"),
    (lambda: mha.apply_rotary(X, base=float("nan")), "base"),
    (lambda: mha.apply_rotary(X, base=float("inf")), "base"),
    (lambda: mha.apply_rotary(X, base="10000"), "base"),
    (lambda: mha.apply_rotary(X, base=None), "base"),
    # base > 0 whose angles overflow: for d = 64, inv_freq up to 1e-300^(-62/64) = 4e290, times 2^62.
    (lambda: mha.apply_rotary(np.zeros((1, 1, 4, 64)), np.full(4, 2**62), base=1e-300), "base"),
    (lambda: mha.apply_rotary(X, np.arange(4.0)), "positions"),
    (lambda: mha.apply_rotary(X, np.arange(4) > 1), "positions"),
    (lambda: mha.apply_rotary(X, np.arange(4, dtype=np.int16)), "positions"),
    (lambda: mha.apply_rotary(X, np.arange(4, dtype=np.uint64)), "positions"),
    (lambda: mha.apply_rotary(X, mha.to_bfloat16(np.arange(4.0))), "positions"),
    (lambda: mha.apply_rotary(X, "0123"), "positions"),
    (lambda: mha.apply_rotary(X, np.arange(5)), "positions"),
    (lambda: mha.apply_rotary(X, np.arange(3)), "positions"),
    (lambda: mha.apply_rotary(X, np.int64(3)), "positions"),
    (lambda: mha.apply_rotary(X, np.zeros((3, 4), dtype=np.int64)), "positions"),
    (lambda: mha.apply_rotary(X, np.zeros((2, 4, 1), dtype=np.int64)), "positions"),
    (lambda: mha.apply_rotary(X, np.array([0, 1, -1, 2])), "positions"),
    (lambda: mha.apply_rotary(X, np.array([[0, 1, 2, 3], [0, 0, 0, -5]], dtype=np.int32)), "positions"),
    (lambda: mha.apply_rotary_backward(X, np.array([0, 1, -1, 2])), "positions"),
    (lambda: mha.apply_rotary(X, interleaved=np.array([True, False])), "interleaved"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_refusals_name_the_argument(call, name):
    with pytest.raises(mha.Error, match=rf"^{name}\b"):
        call()


def test_refusal_messages_say_what_was_expected():
    shape_message = r"positions: expected shape \[L\] = \[4\].*\[B, L\] = \[2, 4\], got int64 \[3\]"
    with pytest.raises(mha.Error, match=shape_message):
        mha.apply_rotary(X, np.arange(3))
    with pytest.raises(mha.Error, match=r"positions: expected positions >= 0, got -5 at \[1, 3\]"):
        mha.apply_rotary(X, np.array([[0, 1, 2, 3], [0, 0, 0, -5]]))
    with pytest.raises(mha.Error, match=r"rotary_dim: .*\[2, d = 8\].*got 9"):
        mha.apply_rotary(X, rotary_dim=9)
    with pytest.raises(mha.Error, match=r"x: expected rank 4 \[B, h, L, d\], got rank 3"):
        mha.apply_rotary(np.zeros((3, 4, 8)))


def test_accepted_edges():
    """base 1 (every angle = the position), an odd d with an even rotary_dim, d = 0, positions 0."""
    x = random_x((1, 2, 3, 8), 15)
    np.testing.assert_allclose(mha.apply_rotary(x, base=1.0), rope_reference(x, base=1.0), rtol=0, atol=1e-15)
    odd = random_x((1, 1, 2, 7), 16)
    np.testing.assert_allclose(mha.apply_rotary(odd, rotary_dim=6), rope_reference(odd, rotary_dim=6), atol=1e-15)
    assert mha.apply_rotary(np.zeros((2, 3, 4, 0))).shape == (2, 3, 4, 0)
    np.testing.assert_array_equal(mha.apply_rotary(x, np.zeros(3, dtype=np.int64)), x)


# ---- NaN and Inf -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("fn", [mha.apply_rotary, mha.apply_rotary_backward], ids=["forward", "backward"])
def test_nonfinite_reaches_exactly_its_pair(fn, interleaved, bad):
    B, h, L, d, r = 2, 2, 3, 10, 8
    x = random_x((B, h, L, d), 17)
    positions = np.array([0, 5, 1_000_000])  # position 0: cos 1, sin 0, where Inf * 0 is NaN
    clean = fn(x, positions, rotary_dim=r, interleaved=interleaved)
    a, b = pair_indices(r, interleaved)
    partner = dict(zip(a, b)) | dict(zip(b, a))
    for component in [0, 3, 4, 7, 9]:  # each index of a pair, and one left alone (9 >= r)
        for l in range(L):
            dirty = x.copy()
            dirty[1, 0, l, component] = bad
            y = fn(dirty, positions, rotary_dim=r, interleaved=interleaved)
            expected = np.zeros(x.shape, dtype=bool)
            expected[1, 0, l, component] = True
            if component in partner:
                expected[1, 0, l, partner[component]] = True
            assert np.array_equal(~np.isfinite(y), expected), f"component {component}, l {l}"
            np.testing.assert_array_equal(y[~expected], clean[~expected])
