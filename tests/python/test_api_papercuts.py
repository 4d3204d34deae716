"""The Python API where a user of torch.nn.MultiheadAttention would expect it to behave like torch
(issue 15, section 3): parameters as attributes, parameters() / named_parameters(), strict=False,
copies and pickling, clear errors for autograd tensors, kernel names and embed_dim; and mha.torch's
refusals of TorchScript and double backward.

Legend: B batch, L queries, E embed_dim.
"""
import copy
import pickle

import numpy as np
import pytest
import torch

import mha
import mha.torch as mha_torch


def layer(**kwargs):
    kwargs.setdefault("batch_first", True)
    return mha.MultiheadAttention(16, 4, seed=5, **kwargs)


def inputs(seed=0, shape=(2, 5, 16)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---- parameters as attributes ----------------------------------------------------------------------

def test_parameter_attributes_read_as_the_state_dict_has_them():
    m = layer(add_bias_kv=True)
    state = m.state_dict()
    np.testing.assert_array_equal(m.in_proj_weight, state["in_proj_weight"])
    np.testing.assert_array_equal(m.in_proj_bias, state["in_proj_bias"])
    np.testing.assert_array_equal(m.bias_k, state["bias_k"])
    np.testing.assert_array_equal(m.out_proj.weight, state["out_proj.weight"])
    np.testing.assert_array_equal(m.out_proj.bias, state["out_proj.bias"])
    # Parameters this layer does not have are None, as in PyTorch.
    assert m.q_proj_weight is None and layer(bias=False).out_proj.bias is None
    assert layer().bias_k is None


def test_separate_projections_as_attributes_when_kdim_differs():
    m = mha.MultiheadAttention(16, 4, kdim=8, vdim=12, seed=1)
    assert m.in_proj_weight is None
    assert m.k_proj_weight.shape == (16, 8) and m.v_proj_weight.shape == (16, 12)


def test_assigning_a_parameter_attribute_sets_the_parameter():
    m = layer().eval()
    x = inputs()
    before = m(x, x, x)[0]
    weight = np.random.default_rng(1).standard_normal((48, 16)).astype(np.float32)
    m.in_proj_weight = weight
    np.testing.assert_array_equal(m.parameter("in_proj_weight"), weight)
    m.out_proj.bias = torch.full((16,), 0.5)  # a torch tensor works too
    np.testing.assert_array_equal(m.parameter("out_proj.bias"), np.full(16, 0.5, np.float32))
    assert not np.array_equal(m(x, x, x)[0], before)


def test_assigning_a_parameter_the_layer_lacks_or_a_wrong_shape_raises():
    m = layer()
    with pytest.raises(mha.Error, match="bias_k"):
        m.bias_k = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(mha.Error, match="in_proj_weight"):
        m.in_proj_weight = np.zeros((3, 3), np.float32)
    with pytest.raises(AttributeError, match="weight and bias"):
        m.out_proj.wieght = np.zeros((16, 16), np.float32)


def test_reading_a_parameter_attribute_gives_a_copy():
    m = layer()
    w = m.in_proj_weight
    w[:] = 7
    assert not np.any(m.parameter("in_proj_weight") == 7)


def test_parameters_and_named_parameters_follow_the_state_dict():
    m = layer(add_bias_kv=True)
    state = m.state_dict()
    named = list(m.named_parameters())
    assert [n for n, _ in named] == list(state)
    for (name, value), plain in zip(named, m.parameters()):
        np.testing.assert_array_equal(value, state[name])
        np.testing.assert_array_equal(plain, state[name])


def test_load_state_dict_strict_false_sets_what_is_given_and_reports_the_rest():
    m = layer()
    before = m.state_dict()
    bias = np.full(48, 3.0, np.float32)
    result = m.load_state_dict({"in_proj_bias": bias, "not_a_parameter": bias}, strict=False)
    assert result.missing_keys == ["in_proj_weight", "out_proj.weight", "out_proj.bias"]
    assert result.unexpected_keys == ["not_a_parameter"]
    np.testing.assert_array_equal(m.parameter("in_proj_bias"), bias)
    np.testing.assert_array_equal(m.parameter("in_proj_weight"), before["in_proj_weight"])
    # strict (the default) still refuses a partial dict, changing nothing.
    with pytest.raises(mha.Error, match="in_proj_weight"):
        m.load_state_dict({"in_proj_bias": np.zeros(48, np.float32)})
    np.testing.assert_array_equal(m.parameter("in_proj_bias"), bias)
    # A mis-shaped entry changes nothing with strict=False either.
    with pytest.raises(mha.Error, match="out_proj.bias"):
        m.load_state_dict({"in_proj_bias": np.zeros(48, np.float32), "out_proj.bias": np.zeros(3, np.float32)},
                          strict=False)
    np.testing.assert_array_equal(m.parameter("in_proj_bias"), bias)
    assert tuple(m.load_state_dict(m.state_dict())) == ([], [])


# ---- copies and pickling ----------------------------------------------------------------------------

@pytest.mark.parametrize("make_copy", [copy.copy, copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
                         ids=["copy", "deepcopy", "pickle"])
def test_copies_are_independent_layers_with_the_same_state(make_copy):
    m = mha.MultiheadAttention(16, 4, seed=9, dropout=0.25, add_bias_kv=True, d_k=8, dtype=np.float64)
    m.eval()
    m.kernel = mha.Kernel.reference
    m.note = "kept"
    c = make_copy(m)
    assert repr(c) == repr(m) and c.seed == m.seed and c.note == "kept"
    assert not c.training and c.kernel == mha.Kernel.reference
    x = inputs(shape=(5, 2, 16)).astype(np.float64)
    np.testing.assert_array_equal(c(x, x, x)[0], m(x, x, x)[0])
    # Mode and parameters are the copy's own.
    c.train()
    assert not m.training
    c.in_proj_bias = np.ones(m.in_proj_bias.shape)
    assert not np.any(m.in_proj_bias == 1)


# ---- errors that say what to do ------------------------------------------------------------------------

def test_a_torch_tensor_that_requires_grad_points_to_mha_torch():
    m = layer()
    t = torch.rand(2, 5, 16, requires_grad=True)
    with pytest.raises(mha.Error, match="mha.torch.MultiheadAttention"):
        m(t, t, t)
    with pytest.raises(mha.Error, match="mha.torch.MultiheadAttention"):
        mha.scaled_dot_product_attention(t[:, None], t[:, None], t[:, None])
    # Without requires_grad a torch tensor is just an array.
    plain = torch.rand(2, 5, 16)
    assert m.eval()(plain, plain, plain)[0].shape == (2, 5, 16)


def test_kernel_names_are_accepted_and_unknown_ones_listed():
    q = inputs(shape=(1, 2, 5, 16))
    by_name = mha.scaled_dot_product_attention(q, q, q, kernel="reference")
    by_enum = mha.scaled_dot_product_attention(q, q, q, kernel=mha.Kernel.reference)
    np.testing.assert_array_equal(by_name, by_enum)
    m = layer()
    m.kernel = "Flash"
    assert m.kernel == mha.Kernel.flash
    big = np.zeros((100, 100))
    for bad in ("refrence", 3, big):
        with pytest.raises(mha.Error, match='"flash", "reference"') as info:
            mha.scaled_dot_product_attention(q, q, q, kernel=bad)
        assert len(str(info.value)) < 200  # names the choices, does not print the arguments
        with pytest.raises(mha.Error, match='"flash", "reference"'):
            m.kernel = bad


@pytest.mark.parametrize("embed_dim, num_heads", [(0, 2), (7, 2)])
def test_constructor_errors_name_embed_dim(embed_dim, num_heads):
    with pytest.raises(mha.Error, match="embed_dim") as info:
        mha.MultiheadAttention(embed_dim, num_heads)
    assert "d_model" not in str(info.value)


# ---- mha.torch: what it cannot do, said plainly ---------------------------------------------------------

def test_torch_module_refuses_torchscript_with_a_reason(monkeypatch):
    monkeypatch.setattr(mha_torch, "_OPERATORS_LOADED", False)  # without the operator library (no libtorch)
    m = mha_torch.MultiheadAttention(16, 4)
    with pytest.raises(RuntimeError, match="cannot be compiled by torch.jit.script"):
        torch.jit.script(m)
    x = torch.rand(5, 1, 16)
    with pytest.raises(RuntimeError, match="torch.jit.trace"):
        torch.jit.trace(m, (x, x, x))


def test_torch_module_refuses_double_backward_with_a_reason():
    m = mha_torch.MultiheadAttention(16, 4)
    q = torch.rand(5, 1, 16, requires_grad=True)
    out, _ = m(q, q, q)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    out, _ = m(q, q, q)  # a plain backward still works
    out.sum().backward()
    assert q.grad.shape == q.shape
