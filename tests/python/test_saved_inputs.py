"""What a training-mode forward keeps of its input arrays for backward: the arrays themselves (held by
reference until the next forward), not copies.

  * the gradients are bitwise those of the copying path (an input with gaps between its rows is
    still copied; its gradients must not differ by a bit);
  * self-attention keeps no copy at all: saved_bytes() counts the projections only;
  * the caller may drop its references: the arrays stay alive until the next forward;
  * an input modified in place before backward() raises mha.Error naming it, in mha and in
    mha.torch, instead of returning wrong gradients.

Legend: B batch, L queries, E embed_dim.
"""
import gc
import weakref

import numpy as np
import pytest
import torch

import mha
import mha.torch

B, L, E, H = 2, 7, 16, 2


def layer(seed=5):
    return mha.MultiheadAttention(E, H, batch_first=True, seed=seed)


def gradients(module, query, key, value, dout):
    module.forward(query, key, value, need_weights=False, is_causal=True)
    return module.backward(dout)


def assert_same_bits(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name


def test_borrowed_gradients_equal_copied_bitwise():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, L, E)).astype(np.float32)
    dout = rng.normal(size=(B, L, E)).astype(np.float32)
    wide = np.zeros((B, L, 2 * E), np.float32)
    gapped = wide[:, :, :E]  # rows with gaps: the layer copies it
    gapped[...] = x
    borrowed = gradients(layer(), x, x, x, dout)
    copied = gradients(layer(), gapped, gapped, gapped, dout)
    assert_same_bits(borrowed, copied)


def test_self_attention_keeps_no_copy():
    rng = np.random.default_rng(2)
    x, y, z = (rng.normal(size=(B, L, E)).astype(np.float32) for _ in range(3))
    module = layer()
    module.forward(x, y, z, need_weights=False)
    distinct = module.saved_bytes()
    module.forward(x, x, x, need_weights=False)
    assert module.saved_bytes() == distinct
    # q, k, v projections and the concatenated heads are 4 * x.nbytes; a copy would add x.nbytes.
    assert 4 * x.nbytes <= module.saved_bytes() < 5 * x.nbytes
    module.eval()
    module.forward(x, x, x, need_weights=False)
    assert module.saved_bytes() == 0


def test_arrays_kept_alive_until_the_next_forward():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(B, L, E)).astype(np.float32)
    dout = rng.normal(size=(B, L, E)).astype(np.float32)
    expected = gradients(layer(), x.copy(), x.copy(), x.copy(), dout)
    module = layer()
    module.forward(x, x, x, need_weights=False, is_causal=True)
    alive = weakref.ref(x)
    del x
    gc.collect()
    garbage = [np.full((B, L, E), 1e3, np.float32) for _ in range(8)]  # reuse any freed memory
    assert alive() is not None
    assert_same_bits(module.backward(dout), expected)
    assert_same_bits(module.backward(dout), expected)  # a second backward reads them too
    module.eval()
    module.forward(garbage[0], garbage[0], garbage[0], need_weights=False)
    gc.collect()
    assert alive() is None  # released by the next forward


def test_modified_input_is_refused():
    rng = np.random.default_rng(4)
    x, y = (rng.normal(size=(B, L, E)).astype(np.float32) for _ in range(2))
    dout = rng.normal(size=(B, L, E)).astype(np.float32)
    module = layer()
    module.forward(x, x, x, need_weights=False)
    x[1, 3, 5] += 1.0
    with pytest.raises(mha.Error, match=r"query \(passed also as key and value\) changed between forward and backward"):
        module.backward(dout)
    module.forward(x, y, y, need_weights=False)
    y[0, 0, 0] = -y[0, 0, 0]
    with pytest.raises(mha.Error, match=r"key \(passed also as value\) changed"):
        module.backward(dout)


def test_torch_module_refuses_an_input_modified_in_place():
    torch.manual_seed(0)
    module = mha.torch.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E, requires_grad=True)
    out, _ = module(x, x, x, need_weights=False)
    with torch.no_grad():
        x.add_(1.0)
    # The NumPy path's layer finds the change; the operator's autograd, torch's version counter, first.
    with pytest.raises((mha.Error, RuntimeError), match="changed between forward and backward|modified by an inplace"):
        out.sum().backward()


def test_torch_module_gradients_with_dropped_references():
    torch.manual_seed(0)
    module = mha.torch.MultiheadAttention(E, H, batch_first=True)
    reference = torch.nn.MultiheadAttention(E, H, batch_first=True)
    reference.load_state_dict(module.state_dict())
    x = torch.randn(B, L, E, dtype=torch.float32)
    expected_x = x.clone().requires_grad_(True)
    reference(expected_x, expected_x, expected_x, need_weights=False)[0].sum().backward()
    leaf = x.clone().requires_grad_(True)
    out = module(leaf * 1.0, leaf * 1.0, leaf * 1.0, need_weights=False)[0]  # inputs only the graph holds
    gc.collect()
    out.sum().backward()
    np.testing.assert_allclose(leaf.grad.numpy(), expected_x.grad.numpy(), rtol=1e-4, atol=1e-5)
