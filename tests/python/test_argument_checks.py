"""Arguments of the Python API that used to give a confusing error or a crash (issue 10): set_num_threads
beyond any useful count; and the scope set_num_threads has."""
import threading

import pytest

import mha


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
