"""Incremental decoding from Python: mha.KeyValueCache with MultiheadAttention.append_to_cache and
forward_cached, against forward over the whole sequence (ours, float64: equal to rounding) and
against PyTorch's nn.MultiheadAttention with a causal mask (float32, under the project's rule)."""
import numpy as np
import pytest
import torch

import mha


@pytest.mark.parametrize("batch_first", [True, False])
def test_step_by_step_equals_causal_forward_float64(batch_first):
    rng = np.random.default_rng(3)
    B, T, E, h = 2, 9, 12, 3
    layer = mha.MultiheadAttention(E, h, batch_first=batch_first, dtype=np.float64, seed=4).eval()
    x = rng.standard_normal((B, T, E) if batch_first else (T, B, E))
    full, _ = layer(x, x, x, is_causal=True, need_weights=False)
    cache = mha.KeyValueCache()
    steps = []
    for t in range(T):
        xt = x[:, t:t + 1] if batch_first else x[t:t + 1]
        layer.append_to_cache(cache, xt, xt)
        out, _ = layer.forward_cached(xt, cache, is_causal=True, need_weights=False)
        steps.append(out)
    assert len(cache) == T and cache.batch == B
    incremental = np.concatenate(steps, axis=1 if batch_first else 0)
    np.testing.assert_allclose(incremental, full, rtol=0, atol=1e-12)


def test_cross_attention_with_padding_matches_torch():
    torch.manual_seed(5)
    B, L, S, E, h = 3, 6, 8, 16, 4
    ref = torch.nn.MultiheadAttention(E, h, batch_first=True).eval()
    layer = mha.MultiheadAttention(E, h, batch_first=True, seed=0).eval()
    layer.load_state_dict({k: v.detach().numpy() for k, v in ref.state_dict().items()})
    memory = torch.randn(B, S, E)
    query = torch.randn(B, L, E)
    lengths = [8, 3, 5]
    padding = torch.arange(S)[None, :] >= torch.tensor(lengths)[:, None]
    cache = mha.KeyValueCache()
    layer.append_to_cache(cache, memory.numpy(), memory.numpy())  # projected once
    outs = [layer.forward_cached(query[:, i:i + 1].numpy(), cache, key_lengths=lengths, need_weights=False)[0]
            for i in range(L)]
    ours = np.concatenate(outs, axis=1)
    with torch.no_grad():
        t32, _ = ref(query, memory, memory, key_padding_mask=padding)
        t64, _ = ref.double()(query.double(), memory.double(), memory.double(), key_padding_mask=padding)
    t32, t64 = t32.numpy(), t64.numpy()
    assert np.abs(ours - t64).max() <= 2 * np.abs(t32 - t64).max() + 1e-6


def test_forward_cached_errors_name_the_problem():
    layer = mha.MultiheadAttention(8, 2, batch_first=True).eval()
    with pytest.raises(ValueError, match="cache"):
        layer.forward_cached(np.ones((1, 1, 8), np.float32), mha.KeyValueCache())
    cache = mha.KeyValueCache()
    layer.append_to_cache(cache, np.ones((2, 3, 8), np.float32), np.ones((2, 3, 8), np.float32))
    with pytest.raises(ValueError):
        layer.forward_cached(np.ones((1, 1, 8), np.float32), cache)  # batch 1 against a cache of 2


def test_float_key_padding_mask_is_added_as_in_forward():
    """A float key_padding_mask is added to the logits (PyTorch's meaning) in forward_cached too."""
    rng = np.random.default_rng(6)
    B, L, S, E, h = 2, 3, 5, 8, 2
    layer = mha.MultiheadAttention(E, h, batch_first=True, dtype=np.float64, seed=7).eval()
    query, memory = rng.standard_normal((B, L, E)), rng.standard_normal((B, S, E))
    padding = rng.uniform(-2.0, 0.0, (B, S))
    padding[1, 3:] = -np.inf
    full, full_w = layer(query, memory, memory, key_padding_mask=padding, average_attn_weights=False)
    cache = mha.KeyValueCache()
    layer.append_to_cache(cache, memory, memory)
    out, w = layer.forward_cached(query, cache, key_padding_mask=padding, average_attn_weights=False)
    np.testing.assert_allclose(out, full, rtol=0, atol=1e-12)
    np.testing.assert_allclose(w, full_w, rtol=0, atol=1e-12)
    assert np.all(w[1, :, :, 3:] == 0)
    without, _ = layer.forward_cached(query, cache)
    assert np.abs(without - out).max() > 1e-3  # the mask mattered


def test_one_cache_shared_by_threads_of_two_layers_never_gives_a_torn_result():
    """KeyValueCache's threads contract: one thread appends position after position through one layer
    while another attends through a second layer with the same parameters and reads len(cache). An
    overlapping pair is refused with mha.Error ("in use by another call") and changes nothing; every
    call that runs sees a whole number of appends: its output is bitwise the one a serial run gives at
    that length."""
    import threading

    B, T, E, h = 2, 40, 8, 2
    writer_layer = mha.MultiheadAttention(E, h, batch_first=True, seed=7).eval()
    reader_layer = mha.MultiheadAttention(E, h, batch_first=True, seed=7).eval()
    x = np.random.default_rng(8).standard_normal((B, T, E)).astype(np.float32)
    query = x[:, :1]
    serial, expected = mha.KeyValueCache(), {}
    for t in range(T):
        writer_layer.append_to_cache(serial, x[:, t:t + 1], x[:, t:t + 1])
        expected[t + 1] = reader_layer.forward_cached(query, serial, need_weights=False)[0]

    cache, failures, refused = mha.KeyValueCache(), [], [0]
    writer_layer.append_to_cache(cache, x[:, :1], x[:, :1])
    done = threading.Event()

    def append_all():
        t = 1
        while t < T:
            try:
                writer_layer.append_to_cache(cache, x[:, t:t + 1], x[:, t:t + 1])
                t += 1
            except mha.Error as e:
                if "in use by another call" not in str(e):
                    failures.append(repr(e))
                    break
                refused[0] += 1
        done.set()

    def attend_over_and_over():
        while not done.is_set():
            before = len(cache)
            try:
                out = reader_layer.forward_cached(query, cache, need_weights=False)[0]
            except mha.Error as e:
                if "in use by another call" not in str(e):
                    failures.append(repr(e))
                refused[0] += 1
                continue
            if len(cache) == before and not np.array_equal(out, expected[before]):
                failures.append(f"length {before}: a result no serial run gives")

    threads = [threading.Thread(target=append_all), threading.Thread(target=attend_over_and_over)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures[:3]
    assert len(cache) == T and np.array_equal(reader_layer.forward_cached(query, cache, need_weights=False)[0],
                                              expected[T])


def test_a_layer_shared_by_threads_sees_whole_parameter_sets():
    """The layer's parameters under load_state_dict from one thread while another runs forward: the
    module's lock serialises them, so each output is bitwise the one of the old or of the new weights."""
    import threading

    E, h = 8, 2
    layer = mha.MultiheadAttention(E, h, batch_first=True, seed=1).eval()
    states = [layer.state_dict(), mha.MultiheadAttention(E, h, batch_first=True, seed=2).state_dict()]
    x = np.random.default_rng(3).standard_normal((2, 5, E)).astype(np.float32)
    outputs = []
    for state in states:
        layer.load_state_dict(state)
        outputs.append(layer(x, x, x, need_weights=False)[0])
    failures, stop = [], threading.Event()

    def forward_over_and_over():
        while not stop.is_set():
            out = layer(x, x, x, need_weights=False)[0]
            if not any(np.array_equal(out, o) for o in outputs):
                failures.append("an output of neither parameter set")

    reader = threading.Thread(target=forward_over_and_over)
    reader.start()
    for i in range(300):
        layer.load_state_dict(states[i % 2])
    stop.set()
    reader.join()
    assert not failures, failures[:3]
