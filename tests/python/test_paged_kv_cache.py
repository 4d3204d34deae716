"""mha.PagedKVCache against a plain Python model of what each sequence holds: hypothesis runs random
programs of add / append / fork / release (appends of any size, some refused for want of pages) and
checks after every step that each sequence's keys and values are exactly its model's, that pages are
shared only as forks make them and counted right, and that a refused call changed nothing; a decode of
any set of sequences agrees with a float64 reference computed from the model. A bfloat16 cache takes
float32 arrays and must hold them rounded to nearest even (its model rounds them with
mha_reference.round_to_bfloat16) and return them as float32.

The same programs run again while two other threads decode and read one more sequence of the cache
(forked by the program, never written) and check every result bitwise: the threads contract (a decode
runs without the GIL; writes wait for it), under which decode once read page tables that another
thread's fork or release was freeing."""
import threading
import time

import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import mha
from mha_reference import round_to_bfloat16

H, DK, DV = 2, 3, 4
HEADS = 2 * H  # query heads of a decode: two per key/value head


def decode_reference(q, keys, values):
    """q [n, HEADS, DK] float64; keys[s] [T, H, DK], values[s] [T, H, DV]: one new query per sequence,
    seeing every position; query head i reads kv head i // 2."""
    out = np.zeros((len(keys), HEADS, DV))
    for s, (k, v) in enumerate(zip(keys, values)):
        for head in range(HEADS):
            logits = k[:, head // 2].astype(np.float64) @ q[s, head] / np.sqrt(DK)
            p = np.exp(logits - logits.max())
            out[s, head] = p @ v[:, head // 2].astype(np.float64) / p.sum()
    return out


class PagedCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.page_size = None
        self.model = {}  # sequence id -> (keys [T, H, DK], values [T, H, DV]) as appended
        self.rng = np.random.default_rng(0)
        self.read_only = set()  # sequences the program must not write (the threaded machine's)

    def writable(self):
        return sorted(self.model.keys() - self.read_only)

    @precondition(lambda self: self.page_size is None)
    @rule(page_size=st.integers(1, 5), pages=st.integers(1, 12), dtype=st.sampled_from(["float32", "float64", "bfloat16"]))
    def create(self, page_size, pages, dtype):
        # A bfloat16 cache is fed float32 arrays and returns float32 ones.
        self.page_size, self.dtype = page_size, np.dtype(np.float32 if dtype == "bfloat16" else dtype)
        self.stored = round_to_bfloat16 if dtype == "bfloat16" else (lambda a: a)  # what the cache holds of a
        self.cache = mha.PagedKVCache(H, DK, value_dim=DV, page_size=page_size,
                                      capacity_tokens=pages * page_size, dtype=dtype)

    @precondition(lambda self: self.page_size is not None)
    @rule()
    def add(self):
        s = self.cache.add_sequence()
        assert s not in self.model
        self.model[s] = (np.zeros((0, H, DK), self.dtype), np.zeros((0, H, DV), self.dtype))

    @precondition(lambda self: self.writable())
    @rule(data=st.data(), n=st.integers(0, 9), transposed=st.booleans())
    def append(self, data, n, transposed):
        s = data.draw(st.sampled_from(self.writable()))
        k = self.rng.standard_normal((n, H, DK)).astype(self.dtype)
        v = self.rng.standard_normal((n, H, DV)).astype(self.dtype)
        if transposed:  # the same values through other strides
            k = np.ascontiguousarray(k.transpose(2, 1, 0)).transpose(2, 1, 0)
        before = self.snapshot()
        try:
            self.cache.append(s, k, v)
        except mha.Error as e:
            assert "free pages" in str(e), str(e)
            assert self.snapshot_equal(before), "a refused append changed the cache"
            return
        keys, values = self.model[s]
        self.model[s] = (np.concatenate([keys, self.stored(k)]), np.concatenate([values, self.stored(v)]))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.model)))
        child = self.cache.fork(parent)
        self.model[child] = tuple(a.copy() for a in self.model[parent])

    @precondition(lambda self: self.writable())
    @rule(data=st.data())
    def release(self, data):
        s = data.draw(st.sampled_from(self.writable()))
        self.cache.release(s)
        del self.model[s]
        with pytest.raises(mha.Error, match="released"):
            self.cache.length(s)

    @precondition(lambda self: any(len(k) for k, _ in self.model.values()))
    @rule(data=st.data())
    def decode(self, data):
        held = [s for s in sorted(self.model) if len(self.model[s][0])]
        ids = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=4))  # repeats allowed
        q = self.stored(self.rng.standard_normal((len(ids), 1, HEADS, DK)).astype(self.dtype))
        got = mha.decode_attention(q, self.cache, ids)
        expected = decode_reference(q[:, 0].astype(np.float64), *zip(*(self.model[s] for s in ids)))
        tolerance = {np.dtype(np.float64): 1e-12}.get(self.dtype, 1e-5)
        if self.stored is round_to_bfloat16:
            tolerance = 2.0 ** -7  # the result rounded to bfloat16 once: half an ulp of |out| <= 4
        np.testing.assert_allclose(got[:, 0], expected, rtol=tolerance, atol=tolerance)

    def snapshot(self):
        return {s: (self.cache.page_table(s), self.cache.keys(s).copy(), self.cache.values(s).copy())
                for s in self.cache.sequences}, self.cache.free_pages

    def snapshot_equal(self, before):
        after = self.snapshot()
        if after[1] != before[1] or after[0].keys() != before[0].keys():
            return False
        return all(a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])
                   for a, b in ((after[0][s], before[0][s]) for s in after[0]))

    @invariant()
    def every_sequence_holds_its_model(self):
        if self.page_size is None:
            return
        assert sorted(self.cache.sequences) == sorted(self.model)
        users = {}
        for s, (keys, values) in self.model.items():
            assert self.cache.length(s) == len(keys)
            for got, expected in ((self.cache.keys(s), keys), (self.cache.values(s), values)):
                assert got.dtype == self.dtype
                np.testing.assert_array_equal(got, expected.transpose(1, 0, 2))
            table = self.cache.page_table(s)
            assert len(table) == -(-len(keys) // self.page_size)
            for page in table:
                users[page] = users.get(page, 0) + 1
        for page, count in users.items():  # each page counted once per sequence that uses it
            assert self.cache.page_users(page) == count
        assert self.cache.pages_in_use == len(users)
        assert self.cache.free_pages == self.cache.page_count - len(users)


TestPagedCache = PagedCacheMachine.TestCase
TestPagedCache.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


class ThreadedPagedCacheMachine(PagedCacheMachine):
    """The programs above while two threads decode and read one sequence (`anchor`, 2 pages and a bit,
    never written by the program but forked by it at will) over and over, checking each result bitwise
    against the one computed before they started."""

    @precondition(lambda self: self.page_size is None)
    @rule(page_size=st.integers(1, 5), pages=st.integers(1, 12), dtype=st.sampled_from(["float32", "float64", "bfloat16"]))
    def create(self, page_size, pages, dtype):
        super().create(page_size, pages + 3, dtype)
        anchor = self.cache.add_sequence()
        n = 2 * page_size + 1
        k = self.rng.standard_normal((n, H, DK)).astype(self.dtype)
        v = self.rng.standard_normal((n, H, DV)).astype(self.dtype)
        self.cache.append(anchor, k, v)
        self.model[anchor] = (self.stored(k), self.stored(v))
        self.read_only = {anchor}
        q = self.stored(self.rng.standard_normal((1, 1, HEADS, DK)).astype(self.dtype))
        expected = (mha.decode_attention(q, self.cache, [anchor]), self.cache.keys(anchor))
        self.stop, self.failures = threading.Event(), []

        def read_over_and_over():
            while not self.stop.is_set():
                try:
                    got = (mha.decode_attention(q, self.cache, [anchor]), self.cache.keys(anchor))
                    if not all(np.array_equal(a, b) for a, b in zip(got, expected)):
                        self.failures.append("a result changed")
                except Exception as e:  # noqa: BLE001 (any error is a failure, reported in teardown)
                    self.failures.append(repr(e))

        self.readers = [threading.Thread(target=read_over_and_over) for _ in range(2)]
        for t in self.readers:
            t.start()

    def teardown(self):
        if self.page_size is not None:
            self.stop.set()
            for t in self.readers:
                t.join()
            assert not self.failures, self.failures[:3]


TestThreadedPagedCache = ThreadedPagedCacheMachine.TestCase
TestThreadedPagedCache.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_decode_in_one_thread_while_another_forks_and_releases_a_long_sequence():
    """The crash the threads contract fixes, as a user met it: one thread decodes while another forks a
    long sequence, appends to the child and releases it, for a bounded time; every decode is bitwise the
    first, and the pages all come back."""
    cache = mha.PagedKVCache(H, DK, value_dim=DV, page_size=4, capacity_tokens=4 * 400)
    rng = np.random.default_rng(1)
    base = cache.add_sequence()
    cache.append(base, rng.standard_normal((1001, H, DK)).astype(np.float32),
                 rng.standard_normal((1001, H, DV)).astype(np.float32))
    q = rng.standard_normal((1, 1, HEADS, DK)).astype(np.float32)
    expected = mha.decode_attention(q, cache, [base])
    stop, failures, decodes = threading.Event(), [], [0]

    def decode():
        while not stop.is_set():
            if not np.array_equal(mha.decode_attention(q, cache, [base]), expected):
                failures.append("decode changed")
            decodes[0] += 1

    reader = threading.Thread(target=decode)
    reader.start()
    try:
        deadline, rounds = time.monotonic() + 1.5, 0
        while time.monotonic() < deadline or rounds < 20:
            child = cache.fork(base)
            cache.append(child, rng.standard_normal((5, H, DK)).astype(np.float32),
                         rng.standard_normal((5, H, DV)).astype(np.float32))
            cache.release(child)
            rounds += 1
    finally:
        stop.set()
        reader.join()
    assert not failures and decodes[0] > 0
    assert cache.sequences == [base] and cache.pages_in_use == 251


def test_bad_arguments_name_the_cause():
    cache = mha.PagedKVCache(H, DK, page_size=4, capacity_tokens=8)
    s = cache.add_sequence()
    with pytest.raises(mha.Error, match=r"keys: expected \[n, num_kv_heads, head_dim\] = \[n, 2, 3\]"):
        cache.append(s, np.zeros((1, H, DK + 1), np.float32), np.zeros((1, H, DK), np.float32))
    with pytest.raises(mha.Error, match="expected the cache's dtype float32, got float64"):
        cache.append(s, np.zeros((1, H, DK)), np.zeros((1, H, DK)))
    with pytest.raises(mha.Error, match="never added"):
        cache.fork(5)
    with pytest.raises(mha.Error, match=r'dtype: expected float32, float64 or "bfloat16", got float16'):
        mha.PagedKVCache(H, DK, capacity_tokens=8, dtype="float16")
    with pytest.raises(mha.Error, match=r'dtype: expected float32, float64 or "bfloat16", got \'bf16\''):
        mha.PagedKVCache(H, DK, capacity_tokens=8, dtype="bf16")
    with pytest.raises(mha.Error, match="page_size: expected >= 1"):
        mha.PagedKVCache(H, DK, page_size=0, capacity_tokens=8)


def test_bfloat16_cache_rounds_float32_to_nearest_even_and_takes_bits_in_place():
    cache = mha.PagedKVCache(1, 2, page_size=2, capacity_tokens=4, dtype="bfloat16")
    s = cache.add_sequence()
    # 1 + 2^-8 lies halfway between the bfloat16 neighbours 1 and 1 + 2^-7: ties go to the even one (1);
    # 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: to the even 1 + 2^-6.
    keys = np.array([[[1 + 2**-8, 1 + 3 * 2**-8]]], np.float32)
    cache.append(s, keys, np.array([[[-2.0, 0.5]]]))  # float64 values are rounded as well
    np.testing.assert_array_equal(cache.keys(s), [[[1.0, 1 + 2**-6]]])
    np.testing.assert_array_equal(cache.values(s), [[[-2.0, 0.5]]])
    # bfloat16 bit patterns (0x3FC0 = 1.5, 0xC000 = -2) appended as they are
    bits = mha.BFloat16Bits(np.array([[[0x3FC0, 0x3FC0]]], np.uint16))
    cache.append(s, bits, mha.BFloat16Bits(np.array([[[0xC000, 0x3FC0]]], np.uint16).view(np.int16)))
    np.testing.assert_array_equal(cache.keys(s)[0, 1], [1.5, 1.5])
    np.testing.assert_array_equal(cache.values(s)[0, 1], [-2.0, 1.5])
    with pytest.raises(mha.Error, match="keys: expected the cache's dtype float32, got bfloat16"):
        f32 = mha.PagedKVCache(1, 2, capacity_tokens=4)
        f32.append(f32.add_sequence(), bits, bits)


# ---- sizes that overflow, dtype None, sizes of the wrong type (issue 30) --------------------------------

OVERFLOWING = [  # (sizes, the argument the message must name)
    (dict(num_kv_heads=1, head_dim=4, page_size=2**63 - 1, capacity_tokens=10), "page_size"),
    (dict(num_kv_heads=1, head_dim=2**62, page_size=16, capacity_tokens=10), "head_dim"),
    (dict(num_kv_heads=1, head_dim=2**62, value_dim=2**62, page_size=1, capacity_tokens=1), "value_dim"),
    (dict(num_kv_heads=2**62, head_dim=4, page_size=4, capacity_tokens=4), "num_kv_heads"),
    (dict(num_kv_heads=1, head_dim=4, page_size=2**62, capacity_tokens=2**62 + 1), "page_size"),
    (dict(num_kv_heads=1, head_dim=4, page_size=1, capacity_tokens=2**63 - 1), "capacity_tokens"),
    (dict(num_kv_heads=3, head_dim=2**40, page_size=2**20, capacity_tokens=1), "head_dim"),
]


@pytest.mark.parametrize("sizes, names", OVERFLOWING, ids=[f"{n}-{i}" for i, (_, n) in enumerate(OVERFLOWING)])
def test_sizes_whose_products_overflow_are_refused_by_name(sizes, names):
    sizes = dict(sizes)
    with pytest.raises(mha.Error) as raised:
        mha.PagedKVCache(sizes.pop("num_kv_heads"), sizes.pop("head_dim"), **sizes)
    message = str(raised.value)
    assert names in message and "larger than a tensor may be" in message, message
    assert not re.search(r"(^|[^\w])-\d", message), "a negative size in the message: " + message  # no wrapped product


def test_dtype_none_is_refused_not_read_as_float64():
    with pytest.raises(mha.Error, match=r'dtype: expected float32, float64 or "bfloat16", got None'):
        mha.PagedKVCache(H, DK, capacity_tokens=8, dtype=None)


NOT_AN_INT64 = st.one_of(st.integers(min_value=2**63, max_value=2**200), st.integers(min_value=-2**200,
                         max_value=-2**63 - 1), st.floats(), st.text(max_size=4), st.none())


@settings(max_examples=60, deadline=None)
@given(argument=st.sampled_from(["num_kv_heads", "head_dim", "value_dim", "page_size", "capacity_tokens"]),
       value=NOT_AN_INT64)
def test_sizes_of_the_wrong_type_or_beyond_int64_are_refused_by_name(argument, value):
    sizes = dict(num_kv_heads=H, head_dim=DK, value_dim=DV, page_size=4, capacity_tokens=8)
    sizes[argument] = value
    with pytest.raises(mha.Error, match=rf"^PagedKVCache: {argument}: expected an integer"):
        mha.PagedKVCache(sizes.pop("num_kv_heads"), sizes.pop("head_dim"), **sizes)


@settings(max_examples=60, deadline=None)
@given(method=st.sampled_from(["append", "fork", "release", "length", "page_table", "keys", "values"]),
       value=NOT_AN_INT64)
def test_sequence_ids_of_the_wrong_type_or_beyond_int64_are_refused_by_name(method, value):
    cache = mha.PagedKVCache(H, DK, page_size=4, capacity_tokens=8)
    s = cache.add_sequence()
    args = (np.zeros((1, H, DK), np.float32),) * 2 if method == "append" else ()
    with pytest.raises(mha.Error, match=r"^sequence: expected an integer"):
        getattr(cache, method)(value, *args)
    assert cache.sequences == [s] and cache.length(s) == 0  # nothing changed
    assert value not in cache  # `in` answers False, as a dict does, for what cannot be an id
    with pytest.raises(mha.Error, match=r"^(PagedKVCache: )?page"):
        cache.page_users(value if isinstance(value, int) else 2**31)
    assert cache.length(np.int64(s)) == 0 and np.int32(s) in cache  # NumPy integers are ids
