"""mha.PagedKVCache with quantized storage (issue 33), dtype="int8" and dtype="float8_e4m3": each (token,
kv head) row of keys and of values is stored as one-byte payloads with a float32 scale of its own, and
keys() / values() return what it reads back. Checked against an oracle written here from the rules
(mha/paged_kv_cache.hpp, KVStorage), independently of the library's code: the int8 rounding is NumPy's
np.rint (ties to even) of x / s in float64; the float8 e4m3 rounding picks, among the values of all 256
bit patterns (derived here from the format's definition), the nearest one, ties to the even pattern.
Also checked without the oracle: an int8 element lies within half a step of its row's scale, and the
scale is max|row| / 127 to 17 significant bits.

Rows: random ones of every magnitude (float32's subnormals to FLT_MAX), all zero, one huge element among
small ones, NaN / Inf rows (read back as NaN, the other rows untouched); page sizes 1..256 with ragged
appends across page boundaries, forks at every position inside a page followed by different appends to
parent and child, release, every refusal (the cache unchanged), and a hypothesis state machine of
add / append / fork / release against a model of the rows read back, for both storages.

Legend: T tokens, h_kv (H) key/value heads, d_k (DK), d_v (DV), P page size.
"""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import mha

H, DK, DV = 2, 3, 5
STORAGES = ["int8", "float8_e4m3"]
QMAX = {"int8": 127.0, "float8_e4m3": 448.0}
FLT_MAX = float(np.finfo(np.float32).max)


# ---- the oracle -----------------------------------------------------------------------------------------

def e4m3_values():
    """The values of the 256 float8 e4m3 (fn) bit patterns S.EEEE.MMM: exponent bias 7, (1 + M/8) 2^(E-7)
    for E > 0, M/8 2^-6 for E = 0, S.1111.111 NaN (no infinities)."""
    values = np.empty(256)
    for bits in range(256):
        sign = -1.0 if bits & 0x80 else 1.0
        e, m = (bits >> 3) & 0xF, bits & 0x7
        if e == 0xF and m == 0x7:
            values[bits] = np.nan
        elif e == 0:
            values[bits] = sign * m / 8 * 2.0 ** -6
        else:
            values[bits] = sign * (1 + m / 8) * 2.0 ** (e - 7)
    return values


E4M3 = e4m3_values()
POSITIVE = E4M3[:0x7F]  # patterns 0x00..0x7E: 0 up to 448, increasing with the pattern


def e4m3_rounded(y):
    """y [...] (float64) to the nearest float8 e4m3 value, ties to the even pattern; |y| > 448 to +-448."""
    a = np.minimum(np.abs(y), 448.0)
    above = np.clip(np.searchsorted(POSITIVE, a, side="left"), 0, len(POSITIVE) - 1)  # first value >= a
    below = np.maximum(above - 1, 0)
    d_below, d_above = a - POSITIVE[below], POSITIVE[above] - a
    tie = np.where(below % 2 == 0, below, above)
    pick = np.where(d_below < d_above, below, np.where(d_above < d_below, above, tie))
    return np.copysign(POSITIVE[pick], y)


def scale_of(m, storage):
    """The scale stored for a row with max|row| = m > 0: m / qmax to 17 significant bits rounded down, or
    (below 2^-133) rounded up to a multiple of 2^-149, the smallest float32."""
    s = m / QMAX[storage]
    if s >= 2.0 ** -133:
        _, e = np.frexp(s)  # s = f 2^e, 0.5 <= f < 1
        unit = 2.0 ** (int(e) - 1 - 16)
        return np.float32(np.floor(s / unit) * unit)
    return np.float32(np.ceil(s / 2.0 ** -149) * 2.0 ** -149)


def read_back(x, storage):
    """What a quantized cache reads back of rows x [..., d] (the values as appended): float32 x' [..., d],
    and each row's scale [...]."""
    x = np.asarray(x, np.float64)
    out, scales = np.empty(x.shape, np.float32), np.empty(x.shape[:-1], np.float32)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        if not np.all(np.abs(row) <= FLT_MAX):  # NaN, Inf, or beyond float32: the whole row NaN
            out[idx], scales[idx] = np.nan, np.nan
            continue
        m = np.abs(row).max(initial=0.0)
        if m == 0:
            out[idx], scales[idx] = 0, 0
            continue
        s = scale_of(m, storage)
        y = row / np.float64(s)
        q = np.clip(np.rint(y), -127, 127) if storage == "int8" else e4m3_rounded(y)
        out[idx], scales[idx] = q.astype(np.float32) * s, s  # float32 product, as the cache reads back
    return out, scales


# ---- helpers ---------------------------------------------------------------------------------------------

def cache_of(storage, page_size=4, tokens=64):
    return mha.PagedKVCache(H, DK, value_dim=DV, page_size=page_size, capacity_tokens=tokens, dtype=storage)


def rows(rng, n, width, kind="normal"):
    """n tokens of H rows [n, H, width] (float32) of one kind."""
    x = rng.standard_normal((n, H, width)).astype(np.float32)
    if kind == "tiny":  # float32 subnormals and values near FLT_MIN: scales of 2^-149 .. 2^-130
        x = (x * np.float32(2.0 ** -135)).astype(np.float32)
    elif kind == "huge":
        x = (x * np.float32(1e30)).astype(np.float32)
    elif kind == "zero":
        x[:] = 0
    return x


def assert_holds(cache, s, keys, values):
    """The cache's keys(s) [H, T, DK] / values(s) [H, T, DV] equal the model's [T, H, d], bitwise (NaN
    equal to NaN)."""
    assert cache.length(s) == len(keys)
    for got, expected in ((cache.keys(s), keys), (cache.values(s), values)):
        assert got.dtype == np.float32 and got.shape == expected.transpose(1, 0, 2).shape
        np.testing.assert_array_equal(got, expected.transpose(1, 0, 2))


def snapshot(cache):
    return ({s: (cache.page_table(s), cache.keys(s), cache.values(s)) for s in cache.sequences}, cache.free_pages)


def unchanged(cache, before):
    after = snapshot(cache)
    return after[1] == before[1] and after[0].keys() == before[0].keys() and all(
        a[0] == b[0] and np.array_equal(a[1], b[1], equal_nan=True) and np.array_equal(a[2], b[2], equal_nan=True)
        for a, b in ((after[0][s], before[0][s]) for s in after[0]))


# ---- the oracle's own checks (it must be right for the rest to mean anything) ----------------------------

def test_the_oracles_e4m3_table_has_the_formats_landmarks():
    assert E4M3[0x7E] == 448 and E4M3[0x08] == 2.0 ** -6 and E4M3[0x01] == 2.0 ** -9 and E4M3[0x38] == 1
    assert np.isnan(E4M3[0x7F]) and np.isnan(E4M3[0xFF]) and np.sum(np.isnan(E4M3)) == 2
    assert np.all(np.diff(POSITIVE) > 0) and np.array_equal(E4M3[0x80:0xFF], -POSITIVE)
    assert list(e4m3_rounded(np.array([2.0 ** -10, 1.0625, 1.1875, 1000.0, -449.0, 0.3]))) == [
        0.0, 1.0, 1.25, 448.0, -448.0, 0.3125]  # ties to even patterns: 0x00, 0x38, 0x3A


# ---- rows, one storage at a time ---------------------------------------------------------------------------

MAGNITUDES = [3 * 2.0 ** -149, 2.0 ** -140, 2.0 ** -133, 2.0 ** -126, 1e-20, 1.0, 1e10, 1e30, FLT_MAX]


def as_source(x, source):
    """x [...] (float64) as the array appended and the values it holds: float32, float64, or bfloat16
    bit patterns (the top halves of the float32 values)."""
    if source == "float64":
        return x, x
    x32 = x.astype(np.float32)
    if source == "float32":
        return x32, x32.astype(np.float64)
    bits = (x32.view(np.uint32) >> 16).astype(np.uint16)
    return mha.BFloat16Bits(bits), (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def check_int8_within_half_a_step(got, x):
    """Every element of an int8 row within s / 2 of x. Where m / 127 >= 2^-133 (m = max|row|) s is read
    from the cache, without the oracle (the row's largest element reads back as 127 s), and must be
    m / 127 to 17 significant bits, rounded down; below, the scale is the oracle's (rounded up to a
    multiple of 2^-149, so the largest payload may be below 127)."""
    for idx in np.ndindex(x.shape[:-1]):
        row, back = x[idx], got[idx].astype(np.float64)
        m = np.abs(row).max()
        if m == 0:
            assert np.all(back == 0)
            continue
        if m / 127 >= 2.0 ** -133:
            s = np.abs(back).max() / 127
            assert m / 127 * (1 - 2.0 ** -16) <= s <= m / 127, (m, s)
        else:
            s = np.float64(scale_of(m, "int8"))
            assert m / 127 <= s < m / 127 + 2.0 ** -149, (m, s)
        assert np.all(np.abs(back - row) <= s / 2), (idx, row, back, s)


@pytest.mark.parametrize("source", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("magnitude", MAGNITUDES, ids=[f"{m:.3g}" for m in MAGNITUDES])
@pytest.mark.parametrize("storage", STORAGES)
def test_rows_of_every_magnitude_read_back_the_independent_rounding_times_their_scale(storage, magnitude, source):
    rng = np.random.default_rng(len(source) * 1000 + MAGNITUDES.index(magnitude))
    x = {w: rng.uniform(-1, 1, (40, H, w)) * magnitude for w in (DK, DV)}
    for w in x:
        x[w][::3, 0, 1] = magnitude  # rows whose largest element is the magnitude itself
        x[w][1::5, 1, :] *= rng.uniform(0, 2.0 ** -20, (w,))  # and rows far below it
    (keys, k_held), (values, v_held) = as_source(x[DK], source), as_source(x[DV], source)
    cache = cache_of(storage, page_size=16, tokens=64)
    s = cache.add_sequence()
    cache.append(s, keys, values)
    got_k, got_v = cache.keys(s).transpose(1, 0, 2), cache.values(s).transpose(1, 0, 2)
    assert got_k.dtype == np.float32 and np.all(np.isfinite(got_k)) and np.all(np.isfinite(got_v))
    np.testing.assert_array_equal(got_k, read_back(k_held, storage)[0])
    np.testing.assert_array_equal(got_v, read_back(v_held, storage)[0])
    if storage == "int8":
        check_int8_within_half_a_step(got_k, k_held)
        check_int8_within_half_a_step(got_v, v_held)


@pytest.mark.parametrize("storage", STORAGES)
def test_all_zero_rows_read_back_zero(storage):
    cache = cache_of(storage)
    s = cache.add_sequence()
    keys = np.zeros((3, H, DK), np.float32)
    keys[1] = -0.0
    values = np.ones((3, H, DV), np.float32)
    values[2, 1] = 0
    cache.append(s, keys, values)
    assert np.all(cache.keys(s) == 0) and not np.any(np.isnan(cache.keys(s)))
    np.testing.assert_array_equal(cache.values(s).transpose(1, 0, 2), read_back(values, storage)[0])
    assert np.all(cache.values(s)[1, 2] == 0) and np.all(cache.values(s)[0, 2] > 0)  # the zero row, its neighbour


@pytest.mark.parametrize("huge", [1e30, FLT_MAX, -FLT_MAX])
@pytest.mark.parametrize("storage", STORAGES)
def test_a_row_with_one_huge_element(storage, huge):
    cache = cache_of(storage)
    s = cache.add_sequence()
    keys = np.full((1, H, DK), 1.0, np.float32)
    keys[0, 0] = [np.float32(huge), 1.0, np.float32(-abs(huge) / 50)]  # 1.0 quantizes to 0, -huge / 50 to -3 or -9
    cache.append(s, keys, np.zeros((1, H, DV), np.float32))
    got = cache.keys(s)[0, 0]
    expected = read_back(keys, storage)[0][0, 0]
    np.testing.assert_array_equal(got, expected)
    assert np.isfinite(got[0]) and abs(got[0] - np.float32(huge)) <= abs(huge) * 2.0 ** -7
    assert got[1] == 0 and got[2] < 0
    back = cache.keys(s)[1, 0]  # the other head's row: its own scale, 1 - 2^-16 <= 127 s (or 448 s) <= 1
    assert np.all(back == back[0]) and 1 - 2.0 ** -16 <= back[0] <= 1
    if storage == "int8":
        check_int8_within_half_a_step(cache.keys(s).transpose(1, 0, 2), keys.astype(np.float64))


@pytest.mark.parametrize("storage", STORAGES)
def test_tiny_rows_stay_accurate(storage):
    """Rows whose max|row| / qmax underflows float32 (subnormal scales, down to max|row| = 2^-149): every
    element finite; int8 within half a step; each row as the oracle says."""
    cache = cache_of(storage, page_size=8, tokens=200)
    s = cache.add_sequence()
    tiny = np.float32(2.0 ** -149)
    keys = np.zeros((24, H, DK), np.float32)
    for t in range(24):  # max |row| = k 2^-149 for k = 1 .. about 2^23 (FLT_MIN), signs mixed
        k = np.float32(2 ** t + t)
        keys[t] = np.array([k, -k / 3, k / 7], np.float32) * tiny
    keys[:, 1] = [2.0 ** -149, -2.0 ** -148, 127 * 2.0 ** -149]  # m / 127 = 2^-149: s = 2^-149
    cache.append(s, keys, keys[:, :, [0, 1, 2, 0, 1]])
    got = cache.keys(s).transpose(1, 0, 2)
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got, read_back(keys, storage)[0])
    if storage == "int8":
        check_int8_within_half_a_step(got, keys.astype(np.float64))
        assert np.array_equal(got[:, 1], keys[:, 1])  # multiples of s = 2^-149, payloads 1, -2, 127


@pytest.mark.parametrize("storage", STORAGES)
def test_nan_and_inf_rows_read_back_nan_and_other_rows_are_untouched(storage):
    rng = np.random.default_rng(5)
    cache = cache_of(storage, page_size=3)
    s = cache.add_sequence()
    keys, values = rows(rng, 6, DK), rows(rng, 6, DV)
    keys[0, 0, 1], keys[2, 1, 0], keys[4, 0, 2] = np.nan, np.inf, -np.inf
    values[3, 1, 4] = np.nan
    cache.append(s, keys, values)
    for got, given in ((cache.keys(s).transpose(1, 0, 2), keys), (cache.values(s).transpose(1, 0, 2), values)):
        bad = ~np.all(np.isfinite(given), axis=-1)  # [T, H]: the rows holding a NaN or an Inf
        assert np.all(np.isnan(got[bad])) and np.all(np.isfinite(got[~bad]))
        np.testing.assert_array_equal(got[~bad], read_back(given[~bad], storage)[0])
    # float64 beyond float32's range counts as infinite: the row reads back NaN, never a finite number
    far = np.ones((1, H, DK))
    far[0, 1, 0] = 1e300
    cache.append(s, far, np.ones((1, H, DV)))
    assert np.all(np.isnan(cache.keys(s)[1, 6]))
    np.testing.assert_array_equal(cache.keys(s)[0, 6], read_back(far[0, 0], storage)[0])


# ---- pages: sizes, ragged appends, forks, release -----------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 2, 3, 5, 16, 64, 127, 256])
@pytest.mark.parametrize("storage", STORAGES)
def test_page_sizes_and_ragged_appends_across_page_boundaries(storage, page_size):
    rng = np.random.default_rng(page_size)
    P = page_size
    sizes = [0, 1, P - 1, P, P + 1, 0, 2 * P + 3, 1]
    cache = cache_of(storage, page_size=P, tokens=3 * sum(sizes) + 3 * P)
    model = {cache.add_sequence(): [np.zeros((0, H, DK), np.float32), np.zeros((0, H, DV), np.float32)]
             for _ in range(3)}
    for n in sizes:
        for i, s in enumerate(model):  # interleaved, each sequence a different size
            m = max(0, n - i)
            keys, values = rows(rng, m, DK, ["normal", "tiny", "huge"][i]), rows(rng, m, DV)
            if i == 1:  # other strides: a transposed copy read through its strides
                keys = np.ascontiguousarray(keys.transpose(2, 1, 0)).transpose(2, 1, 0)
            cache.append(s, keys, values)
            model[s][0] = np.concatenate([model[s][0], read_back(keys, storage)[0]])
            model[s][1] = np.concatenate([model[s][1], read_back(values, storage)[0]])
    for s, (keys, values) in model.items():
        assert_holds(cache, s, keys, values)
        assert len(cache.page_table(s)) == -(-len(keys) // P)


@pytest.mark.parametrize("page_size", [4, 5])
@pytest.mark.parametrize("storage", STORAGES)
def test_forks_at_every_position_inside_a_page_keep_each_sequences_own_rows(storage, page_size):
    P = page_size
    for k in range(0, 2 * P + 1):
        rng = np.random.default_rng(k)
        cache = cache_of(storage, page_size=P, tokens=8 * P)
        parent = cache.add_sequence()
        pk, pv = rows(rng, k, DK), rows(rng, k, DV)
        cache.append(parent, pk, pv)
        child = cache.fork(parent)
        assert cache.page_table(child) == cache.page_table(parent)
        model = {s: [read_back(pk, storage)[0], read_back(pv, storage)[0]] for s in (parent, child)}
        for s, n, kind in ((child, P + 1, "huge"), (parent, 2, "tiny"), (child, 1, "normal"), (parent, P, "zero")):
            keys, values = rows(rng, n, DK, kind), rows(rng, n, DV, kind)
            cache.append(s, keys, values)
            model[s] = [np.concatenate([model[s][0], read_back(keys, storage)[0]]),
                        np.concatenate([model[s][1], read_back(values, storage)[0]])]
            for seq in (parent, child):
                assert_holds(cache, seq, *model[seq])
        full = k // P  # the full pages before the fork stay shared; the partly filled one was copied
        assert cache.page_table(child)[:full] == cache.page_table(parent)[:full]
        assert not set(cache.page_table(child)[full:]) & set(cache.page_table(parent)[full:])
        cache.release(parent)
        assert_holds(cache, child, *model[child])
        assert cache.pages_in_use == len(cache.page_table(child))
        cache.release(child)
        assert cache.pages_in_use == 0 and cache.free_pages == cache.page_count


# ---- refusals -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float8", "float8_e5m2", "int16", "uint8", "int4", np.int32])
def test_other_dtypes_are_refused_by_name(dtype):
    with pytest.raises(mha.Error, match=r'dtype: expected float32, float64 or "bfloat16", got .*'
                                        r'\(or, quantized, "int8" or "float8_e4m3"\)'):
        mha.PagedKVCache(H, DK, capacity_tokens=8, dtype=dtype)


@pytest.mark.parametrize("storage", STORAGES)
def test_storage_is_reported_and_the_dtype_is_float32(storage):
    cache = cache_of(storage)
    assert cache.storage == storage and cache_of("float32").storage == "native"
    assert mha.PagedKVCache(H, DK, capacity_tokens=4, dtype=np.int8).storage == "int8"
    s = cache.add_sequence()
    cache.append(s, np.ones((1, H, DK)), np.ones((1, H, DV), np.float32))
    assert cache.keys(s).dtype == np.float32 and cache.values(s).dtype == np.float32


@pytest.mark.parametrize("storage", STORAGES)
def test_every_refused_append_leaves_the_cache_unchanged(storage):
    rng = np.random.default_rng(1)
    cache = cache_of(storage, page_size=4, tokens=12)
    s, other = cache.add_sequence(), cache.add_sequence()
    cache.append(s, rows(rng, 5, DK), rows(rng, 5, DV))
    cache.fork(s)
    refused = [
        (s, np.zeros((1, H, DK + 1), np.float32), np.zeros((1, H, DV), np.float32),
         r"keys: expected \[n, num_kv_heads, head_dim\] = \[n, 2, 3\]"),
        (s, np.zeros((1, H, DK), np.float32), np.zeros((1, H + 1, DV), np.float32),
         r"values: expected \[n, num_kv_heads, value_dim\] = \[n, 2, 5\]"),
        (s, np.zeros((2, H, DK), np.float32), np.zeros((1, H, DV), np.float32), "expected as many tokens"),
        (s, np.zeros((H, DK), np.float32), np.zeros((H, DV), np.float32), "keys: expected"),
        (s, np.zeros((1, H, DK), np.int32), np.zeros((1, H, DV), np.float32), "keys"),
        (s, rows(rng, 9, DK), rows(rng, 9, DV), "free pages"),  # 3 more pages and the copy of the shared one
        (other, rows(rng, 9, DK), rows(rng, 9, DV), "free pages"),
        (99, np.zeros((1, H, DK), np.float32), np.zeros((1, H, DV), np.float32), "never added"),
    ]
    for seq, keys, values, message in refused:
        before = snapshot(cache)
        with pytest.raises(mha.Error, match=message):
            cache.append(seq, keys, values)
        assert unchanged(cache, before), message
    cache.release(other)
    with pytest.raises(mha.Error, match="released"):
        cache.append(other, np.zeros((1, H, DK), np.float32), np.zeros((1, H, DV), np.float32))


# ---- a state machine: add / append / fork / release against a model of the rows read back -------------------

class QuantizedCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.model = {}  # sequence id -> (keys [T, H, DK], values [T, H, DV]) as read back
        self.rng = np.random.default_rng(0)

    @precondition(lambda self: self.cache is None)
    @rule(storage=st.sampled_from(STORAGES), page_size=st.sampled_from([1, 2, 3, 4, 7, 16]),
          pages=st.integers(1, 10))
    def create(self, storage, page_size, pages):
        self.storage, self.page_size = storage, page_size
        self.cache = cache_of(storage, page_size=page_size, tokens=pages * page_size)

    @precondition(lambda self: self.cache is not None)
    @rule()
    def add(self):
        s = self.cache.add_sequence()
        self.model[s] = (np.zeros((0, H, DK), np.float32), np.zeros((0, H, DV), np.float32))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(0, 9), kind=st.sampled_from(["normal", "tiny", "huge", "zero", "nan"]),
          source=st.sampled_from(["float32", "float64", "bfloat16"]))
    def append(self, data, n, kind, source):
        s = data.draw(st.sampled_from(sorted(self.model)))
        x = {w: rows(self.rng, n, w, "normal" if kind == "nan" else kind).astype(np.float64) for w in (DK, DV)}
        if kind == "nan" and n:
            x[DK][self.rng.integers(n), self.rng.integers(H), self.rng.integers(DK)] = np.nan
            x[DV][self.rng.integers(n), self.rng.integers(H), self.rng.integers(DV)] = -np.inf
        (keys, k_held), (values, v_held) = as_source(x[DK], source), as_source(x[DV], source)
        before = snapshot(self.cache)
        try:
            self.cache.append(s, keys, values)
        except mha.Error as e:
            assert "free pages" in str(e), str(e)
            assert unchanged(self.cache, before), "a refused append changed the cache"
            return
        k, v = self.model[s]
        self.model[s] = (np.concatenate([k, read_back(k_held, self.storage)[0]]),
                         np.concatenate([v, read_back(v_held, self.storage)[0]]))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.model)))
        self.model[self.cache.fork(parent)] = tuple(a.copy() for a in self.model[parent])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):
        s = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.release(s)
        del self.model[s]

    @invariant()
    def every_sequence_holds_its_model(self):
        if self.cache is None:
            return
        assert sorted(self.cache.sequences) == sorted(self.model)
        users = {}
        for s, (keys, values) in self.model.items():
            assert_holds(self.cache, s, keys, values)
            for page in self.cache.page_table(s):
                users[page] = users.get(page, 0) + 1
        for page, count in users.items():
            assert self.cache.page_users(page) == count
        assert self.cache.pages_in_use == len(users)


TestQuantizedCache = QuantizedCacheMachine.TestCase
TestQuantizedCache.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
