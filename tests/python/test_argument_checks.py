"""Arguments of the Python API that used to give a confusing error or a crash (issue 10): key_lengths as a
NumPy array, and set_num_threads beyond any useful count; and the scope set_num_threads has."""
import threading

import numpy as np
import pytest

import mha

B, h, L, S, E, d = 2, 2, 3, 4, 8, 4


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, h, L, d)).astype(np.float32)
    k = rng.standard_normal((B, h, S, d)).astype(np.float32)
    v = rng.standard_normal((B, h, S, d)).astype(np.float32)
    return q, k, v


# ---- key_lengths: any sequence or 1-D integer array ----------------------------------------------

LENGTHS_AS = {
    "list": [2, 3],
    "tuple": (2, 3),
    "int64 array": np.array([2, 3]),
    "int32 array": np.array([2, 3], np.int32),
    "uint8 array": np.array([2, 3], np.uint8),
    "list of numpy ints": [np.int64(2), np.int32(3)],
}


@pytest.mark.parametrize("lengths", LENGTHS_AS.values(), ids=LENGTHS_AS.keys())
def test_key_lengths_take_any_integer_sequence(lengths):
    q, k, v = _inputs()
    expected = mha.scaled_dot_product_attention(q, k, v, key_lengths=[2, 3])
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, key_lengths=lengths), expected)
    dout = np.ones_like(expected)
    out, lse = mha.scaled_dot_product_attention(q, k, v, key_lengths=lengths, need_lse=True)
    grads = mha.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, key_lengths=lengths)
    for a, b in zip(grads, mha.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, key_lengths=[2, 3])):
        np.testing.assert_array_equal(a, b)

    layer = mha.MultiheadAttention(E, h, batch_first=True, seed=1).eval()
    x = np.random.default_rng(2).standard_normal((B, S, E)).astype(np.float32)
    for a, b in zip(layer(x, x, x, key_lengths=lengths), layer(x, x, x, key_lengths=[2, 3])):
        np.testing.assert_array_equal(a, b)
    cache = mha.KeyValueCache()
    layer.append_to_cache(cache, x, x)
    for a, b in zip(layer.forward_cached(x[:, -1:], cache, key_lengths=lengths),
                    layer.forward_cached(x[:, -1:], cache, key_lengths=[2, 3])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("lengths", [np.array([2.0, 3.0]), [2.5, 3], np.array([True, False]), np.array([[2, 3]]),
                                     np.int64(2), "23", [2, None], np.array([2**64 - 1, 3], np.uint64)],
                         ids=["float array", "float list", "bool array", "2-D", "scalar", "str", "None inside",
                              "uint64 beyond int64"])
def test_key_lengths_that_are_not_integer_sequences_are_refused_by_name(lengths):
    q, k, v = _inputs()
    with pytest.raises(mha.Error, match="^key_lengths"):
        mha.scaled_dot_product_attention(q, k, v, key_lengths=lengths)
    layer = mha.MultiheadAttention(E, h, batch_first=True, seed=1).eval()
    x = np.zeros((B, S, E), np.float32)
    with pytest.raises(mha.Error, match="^key_lengths"):
        layer(x, x, x, key_lengths=lengths)


def test_empty_key_lengths_mean_none():
    q, k, v = _inputs()
    expected = mha.scaled_dot_product_attention(q, k, v)
    for empty in (None, [], (), np.array([], np.int64), np.array([])):
        np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, key_lengths=empty), expected)


# ---- set_num_threads: bounded, and the calling thread's ------------------------------------------

@pytest.fixture
def restore_threads():
    saved = mha.num_threads()
    yield
    mha.set_num_threads(saved)


def test_set_num_threads_refuses_counts_beyond_the_bound(restore_threads):
    bound = mha.max_num_threads()
    assert bound >= 64
    before = mha.num_threads()
    for n in (bound + 1, 100000, 2**31 - 1):
        with pytest.raises(mha.Error, match=rf"threads: {n} .*at most {bound}"):
            mha.set_num_threads(n)
        assert mha.num_threads() == before
    mha.set_num_threads(bound)
    assert mha.num_threads() == bound
    with pytest.raises(TypeError):  # beyond C int: pybind11 refuses it before the library sees it
        mha.set_num_threads(2**40)


def test_set_num_threads_applies_to_the_calling_thread_only(restore_threads):
    def in_a_new_thread(action):
        seen = []
        worker = threading.Thread(target=lambda: seen.append(action()))
        worker.start()
        worker.join()
        return seen[0]

    default = in_a_new_thread(mha.num_threads)
    mha.set_num_threads(3)
    assert mha.num_threads() == 3
    assert in_a_new_thread(mha.num_threads) == default  # another thread keeps its own count

    def set_and_read():
        mha.set_num_threads(5)
        return mha.num_threads()

    assert in_a_new_thread(set_and_read) == 5
    assert mha.num_threads() == 3  # ... and setting it there leaves this thread's alone
