"""mha.PagedKVCache against a plain Python model of what each sequence holds: hypothesis runs random
programs of add / append / fork / release (appends of any size, some refused for want of pages) and
checks after every step that each sequence's keys and values are exactly its model's, that pages are
shared only as forks make them and counted right, and that a refused call changed nothing. A bfloat16
cache takes float32 arrays and must hold them rounded to nearest even (its model rounds them with
mha_reference.round_to_bfloat16) and return them as float32."""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import mha
from mha_reference import round_to_bfloat16

H, DK, DV = 2, 3, 4


class PagedCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.page_size = None
        self.model = {}  # sequence id -> (keys [T, H, DK], values [T, H, DV]) as appended
        self.rng = np.random.default_rng(0)

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

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(0, 9), transposed=st.booleans())
    def append(self, data, n, transposed):
        s = data.draw(st.sampled_from(sorted(self.model)))
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

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):
        s = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.release(s)
        del self.model[s]
        with pytest.raises(mha.Error, match="released"):
            self.cache.length(s)

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
