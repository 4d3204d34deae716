"""mha.MultiheadAttention(..., sinks=True): a learned logit per head in every row's softmax, with no value.

The truth is layer_reference.py's: the layer's math in torch float64 (projections, the sink as one more
logit column dropped after the softmax, the output projection) and torch's autograd for every gradient,
"sinks" included; torch float32 measures what plain float32 arithmetic loses (the suite's rule).

Legend: B batch, L queries, S keys, E embed_dim, h heads, h_kv key/value heads, d per-head width.
"""
import numpy as np
import pytest
import torch

import mha
from layer_reference import layer_reference


def sink_layer(dtype, h=4, h_kv=4, seed=3):
    layer = mha.MultiheadAttention(24, h, num_kv_heads=h_kv, batch_first=True, dtype=dtype, seed=seed, sinks=True)
    layer.sinks = np.random.default_rng(seed).standard_normal(h) * 2
    return layer


@pytest.mark.parametrize("h_kv", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_and_every_gradient_match_the_reference(h_kv, causal, dtype):
    layer = sink_layer(dtype, h_kv=h_kv)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 9, 24)).astype(dtype)
    dout = rng.standard_normal((2, 9, 24)).astype(dtype)
    out, _ = layer(x, x, x, is_causal=causal, need_weights=False)
    grads = layer.backward(dout)
    state = layer.state_dict()
    ref64_out, ref64 = layer_reference(state, x, x, 4, h_kv, 0, None, False, causal, torch.float64, dout)
    ref32_out, ref32 = layer_reference(state, x, x, 4, h_kv, 0, None, False, causal, torch.float32, dout)
    grads["key"] = grads["key"] + grads["value"]  # the reference's key input plays both roles
    pairs = [("out", out, ref64_out, ref32_out)] + [(n, grads[n], ref64[n], ref32[n]) for n in ref64]
    for name, got, r64, r32 in pairs:
        err = np.abs(np.asarray(got, np.float64) - r64).max()
        if dtype == np.float64:
            bound = 1e-10 * max(1.0, np.abs(r64).max())
        else:
            bound = 3 * np.abs(r32 - r64).max() + 1e-5 * max(1.0, np.abs(r64).max())
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"
    assert grads["sinks"].shape == (4,) and np.any(grads["sinks"] != 0)


def test_sinks_change_the_output_and_minus_inf_sinks_are_no_sinks():
    layer = sink_layer(np.float64)
    plain = mha.MultiheadAttention(24, 4, batch_first=True, dtype=np.float64, seed=3)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "sinks"})
    x = np.random.default_rng(8).standard_normal((2, 6, 24))
    with_sinks, _ = layer(x, x, x)
    without, _ = plain(x, x, x)
    assert np.abs(with_sinks - without).max() > 1e-3
    layer.sinks = np.full(4, -np.inf)
    np.testing.assert_allclose(layer(x, x, x)[0], without, rtol=0, atol=1e-13)


def test_forward_cached_step_by_step_equals_the_causal_forward():
    layer = sink_layer(np.float32)
    layer.eval()
    x = np.random.default_rng(9).standard_normal((2, 11, 24)).astype(np.float32)
    whole, _ = layer(x, x, x, is_causal=True, need_weights=False)
    cache = mha.KeyValueCache()
    steps = []
    for t in range(11):
        layer.append_to_cache(cache, x[:, t:t + 1], x[:, t:t + 1])
        steps.append(layer.forward_cached(x[:, t:t + 1], cache, is_causal=True, need_weights=False)[0])
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=0, atol=2e-6)


def test_sinks_are_saved_loaded_pickled_and_in_the_repr(tmp_path):
    import pickle
    layer = sink_layer(np.float32)
    path = tmp_path / "layer.safetensors"
    layer.save(path)
    loaded = mha.load(path)
    assert loaded.has_sinks and "sinks=True" in repr(loaded)
    np.testing.assert_array_equal(loaded.sinks, layer.sinks)
    copy = pickle.loads(pickle.dumps(layer))
    np.testing.assert_array_equal(copy.sinks, layer.sinks)
    x = np.random.default_rng(10).standard_normal((1, 4, 24)).astype(np.float32)
    np.testing.assert_array_equal(loaded(x, x, x)[0], layer(x, x, x)[0])
    assert mha.MultiheadAttention(24, 4).sinks is None


def test_a_bfloat16_layer_learns_sinks_within_bfloat16_precision():
    layer = sink_layer("bfloat16")
    wide = sink_layer(np.float32)
    wide.load_state_dict(layer.state_dict())  # the same (bfloat16-representable) parameters
    x = mha.from_bfloat16(mha.to_bfloat16(np.random.default_rng(11).standard_normal((2, 7, 24)).astype(np.float32)))
    out, _ = layer(x, x, x)
    ref, _ = wide(x, x, x)
    assert np.abs(out - ref).max() <= 2.0 ** -6 * max(1.0, np.abs(ref).max())
    g = layer.backward(np.ones_like(out))
    g32 = wide.backward(np.ones_like(ref))
    assert np.abs(g["sinks"] - g32["sinks"]).max() <= 2.0 ** -5 * max(1.0, np.abs(g32["sinks"]).max())
