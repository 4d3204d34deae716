"""The Python API of mha: parameters, errors, conversions, shapes, generality, dropout.

Numerical checks follow the suite's rule: ours (float32) against a float64 reference within twice the
error of a plain float32 run of the same reference, plus 1e-6; a float64 module to ~1e-12.

Legend: B batch, h heads, L queries, S keys, E embed_dim, d_k / d_v per-head widths.
"""
import re
import threading

import numpy as np
import pytest
import torch

import mha
from mha_reference import (additive_mask, causal_forbidden, error_bound, max_abs_diff, mha_reference,
                           softmax_rows)


KERNELS = {"flash": mha.Kernel.flash, "reference": mha.Kernel.reference}


@pytest.fixture(params=list(KERNELS))
def kernel(request):
    """Each test that takes `kernel` runs once per attention kernel."""
    return KERNELS[request.param]


def with_kernel(module, kernel):
    module.kernel = kernel
    return module


def rng_for(*key):
    return np.random.default_rng(list(key))


def normal(rng, shape, dtype=np.float32):
    return rng.normal(size=shape).astype(dtype)


def randomize_biases(module, rng):
    """Nonzero biases (they start at 0), so that tests see them."""
    state = module.state_dict()
    for name in state:
        if "bias" in name:
            state[name] = normal(rng, state[name].shape) * 0.5
    module.load_state_dict(state)
    return module


def torch_module(ours, **kwargs):
    """A torch.nn.MultiheadAttention holding ours' parameters (float64 when ours is)."""
    module = torch.nn.MultiheadAttention(ours.embed_dim, ours.num_heads, **kwargs)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in ours.state_dict().items()})
    return module.eval().to(torch.float64 if ours.dtype == np.float64 else torch.float32)


def assert_close(a, b, atol=1e-6):
    """Equal up to float32 rounding: for results reached by different code paths."""
    assert (a is None) == (b is None)
    if a is not None:
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)


def message_names(excinfo, name):
    """The error message starts with the argument's name (the library's format, "name: ...")."""
    message = str(excinfo.value)
    assert re.match(rf"{re.escape(name)}(?![\w.])", message), message
    return message


# ---- parameters ----------------------------------------------------------------------------------

PARAMETER_CASES = [
    dict(embed_dim=8, num_heads=2),
    dict(embed_dim=8, num_heads=2, kdim=5, vdim=3),
    dict(embed_dim=8, num_heads=2, kdim=5),
    dict(embed_dim=8, num_heads=2, bias=False),
    dict(embed_dim=8, num_heads=2, add_bias_kv=True),
    dict(embed_dim=6, num_heads=3, kdim=4, vdim=7, bias=False, add_bias_kv=True, add_zero_attn=True),
]
PARAMETER_IDS = ["packed", "kdim-vdim", "kdim", "nobias", "biaskv", "separate-nobias-biaskv-zeroattn"]


@pytest.mark.parametrize("case", PARAMETER_CASES, ids=PARAMETER_IDS)
def test_parameter_names_and_shapes_match_torch(case):
    reference = torch.nn.MultiheadAttention(**case).state_dict()
    ours = mha.MultiheadAttention(**case, seed=1)
    state = ours.state_dict()
    assert list(state) == list(reference)  # same names, same order
    assert ours.parameter_names() == list(reference)
    for name, value in reference.items():
        assert state[name].shape == tuple(value.shape), name
        assert state[name].dtype == np.float32
        np.testing.assert_array_equal(ours.parameter(name), state[name])
    assert ours._qkv_same_embed_dim == ("in_proj_weight" in reference)


@pytest.mark.parametrize("case", PARAMETER_CASES, ids=PARAMETER_IDS)
def test_state_dict_round_trip_through_torch(case):
    ours = randomize_biases(mha.MultiheadAttention(**case, seed=3), rng_for(3))
    original = ours.state_dict()
    module = torch.nn.MultiheadAttention(**case)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in original.items()})

    back = mha.MultiheadAttention(**case, seed=4)
    back.load_state_dict({k: v.numpy() for k, v in module.state_dict().items()})
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value, original[name])

    direct = mha.MultiheadAttention(**case, seed=5)
    direct.load_state_dict(module.state_dict())  # torch tensors work too
    for name, value in direct.state_dict().items():
        np.testing.assert_array_equal(value, original[name])

    params = mha.MultiheadAttention(**case, seed=6)
    params.load_state_dict(dict(module.named_parameters()))  # even parameters that require grad
    for name, value in params.state_dict().items():
        np.testing.assert_array_equal(value, original[name])


def test_state_dict_returns_copies():
    m = mha.MultiheadAttention(8, 2, seed=0)
    state = m.state_dict()
    before = state["in_proj_weight"].copy()
    state["in_proj_weight"][:] = 7.0
    m.parameter("out_proj.weight")[:] = 7.0
    np.testing.assert_array_equal(m.state_dict()["in_proj_weight"], before)
    assert not (m.state_dict()["out_proj.weight"] == 7.0).any()


def test_load_state_dict_unknown_key():
    m = mha.MultiheadAttention(8, 2, seed=0)
    state = m.state_dict()
    state["out_proj.bogus"] = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match=re.escape("out_proj.bogus")):
        m.load_state_dict(state)


def test_load_state_dict_missing_key():
    m = mha.MultiheadAttention(8, 2, seed=0)
    state = m.state_dict()
    del state["out_proj.bias"]
    with pytest.raises(ValueError, match=re.escape("out_proj.bias")):
        m.load_state_dict(state)


@pytest.mark.parametrize("name,shape", [("in_proj_weight", (24, 7)), ("in_proj_bias", (23,)),
                                        ("out_proj.weight", (8,)), ("out_proj.bias", (1, 8))])
def test_load_state_dict_wrong_shape_names_the_key_and_changes_nothing(name, shape):
    m = mha.MultiheadAttention(8, 2, seed=0)
    before = m.state_dict()
    state = {k: v + 1.0 for k, v in before.items()}
    state[name] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=re.escape(name)):
        m.load_state_dict(state)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


def test_load_state_dict_wrong_dtype_names_the_key():
    m = mha.MultiheadAttention(8, 2, seed=0)
    state = m.state_dict()
    state["in_proj_bias"] = np.zeros(24, np.int64)
    with pytest.raises(ValueError, match="in_proj_bias"):
        m.load_state_dict(state)
    state["in_proj_bias"] = np.zeros(24, bool)
    with pytest.raises(ValueError, match="in_proj_bias"):
        m.load_state_dict(state)


def test_load_state_dict_converts_the_other_float_dtype():
    m32 = mha.MultiheadAttention(8, 2, seed=0)
    m64 = mha.MultiheadAttention(8, 2, seed=1, dtype=np.float64)
    state64 = {k: v.astype(np.float64) / 3.0 for k, v in m32.state_dict().items()}
    m32.load_state_dict(state64)
    m64.load_state_dict(m32.state_dict())
    for name, value in state64.items():
        assert m32.parameter(name).dtype == np.float32
        np.testing.assert_array_equal(m32.parameter(name), value.astype(np.float32))
        assert m64.parameter(name).dtype == np.float64
        np.testing.assert_array_equal(m64.parameter(name), value.astype(np.float32).astype(np.float64))
    # array-likes that numpy.asarray accepts
    m32.load_state_dict({k: v.tolist() for k, v in m32.state_dict().items()})


def test_errors_are_mha_error_a_value_error():
    assert issubclass(mha.Error, ValueError)
    m = mha.MultiheadAttention(8, 2, seed=0)
    with pytest.raises(mha.Error):
        m.load_state_dict({})


def _bound(shape):
    """xavier_uniform's bound for a [fan_out, fan_in] weight."""
    return np.sqrt(6.0 / (shape[0] + shape[1]))


def _check_uniform(w, bound, name):
    assert np.abs(w).max() <= bound * (1 + 1e-6), name
    assert np.abs(w).max() > 0.95 * bound, name
    assert abs(w.std() / (bound / np.sqrt(3.0)) - 1.0) < 0.1, name
    assert abs(w.mean()) < 0.1 * bound, name


@pytest.mark.parametrize("case", [
    dict(embed_dim=64, num_heads=4, add_bias_kv=True),
    dict(embed_dim=64, num_heads=8, kdim=32, vdim=16, add_bias_kv=True),
    dict(embed_dim=48, num_heads=3, d_k=20, d_v=24, add_bias_kv=True),
], ids=["packed", "separate", "dk-dv"])
def test_initialisation_statistics(case):
    m = mha.MultiheadAttention(**case, seed=11)
    state = m.state_dict()
    for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
        if name in state:
            _check_uniform(state[name], _bound(state[name].shape), name)
    out_w = state["out_proj.weight"]
    assert out_w.shape == (m.embed_dim, m.num_heads * m.d_v)
    _check_uniform(out_w, 1.0 / np.sqrt(out_w.shape[1]), "out_proj.weight")
    np.testing.assert_array_equal(state["in_proj_bias"], 0.0)
    np.testing.assert_array_equal(state["out_proj.bias"], 0.0)
    for name, width in (("bias_k", m.num_heads * m.d_k), ("bias_v", m.num_heads * m.d_v)):
        b = state[name]
        assert b.shape == (1, 1, width)
        std = 1.0 / np.sqrt(width)  # xavier_normal of a [1, 1, width] tensor
        assert 0.6 * std < b.std() < 1.4 * std, name
        assert abs(b.mean()) < 4 * std / np.sqrt(width), name


def test_same_seed_same_parameters_different_seed_different():
    a = mha.MultiheadAttention(16, 4, add_bias_kv=True, seed=7).state_dict()
    b = mha.MultiheadAttention(16, 4, add_bias_kv=True, seed=7).state_dict()
    c = mha.MultiheadAttention(16, 4, add_bias_kv=True, seed=8).state_dict()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    for name in ("in_proj_weight", "out_proj.weight", "bias_k", "bias_v"):
        assert not np.array_equal(a[name], c[name]), name


def test_seed_none_draws_a_seed_and_keeps_it():
    a = mha.MultiheadAttention(16, 4)
    b = mha.MultiheadAttention(16, 4)
    assert isinstance(a.seed, int) and a.seed != b.seed
    assert not np.array_equal(a.parameter("in_proj_weight"), b.parameter("in_proj_weight"))
    again = mha.MultiheadAttention(16, 4, seed=a.seed)
    np.testing.assert_array_equal(again.parameter("in_proj_weight"), a.parameter("in_proj_weight"))


def test_attributes_mirror_torch():
    m = mha.MultiheadAttention(12, 3, dropout=0.25, kdim=5, vdim=7, batch_first=True, seed=0)
    t = torch.nn.MultiheadAttention(12, 3, dropout=0.25, kdim=5, vdim=7, batch_first=True)
    for name in ("embed_dim", "num_heads", "head_dim", "kdim", "vdim", "batch_first", "dropout",
                 "add_zero_attn", "_qkv_same_embed_dim", "training"):
        assert getattr(m, name) == getattr(t, name), name
    assert (m.d_k, m.d_v, m.dtype) == (4, 4, np.dtype(np.float32))
    g = mha.MultiheadAttention(12, 3, d_k=5, d_v=2, dtype=np.float64, seed=0)
    assert (g.d_k, g.d_v, g.head_dim, g.dtype) == (5, 2, 5, np.dtype(np.float64))
    with pytest.raises(AttributeError):
        m.embed_dim = 3
    assert "MultiheadAttention(embed_dim=12" in repr(m)
    assert m.kernel == mha.Kernel.flash  # the library's default
    m.kernel = mha.Kernel.reference
    assert m.kernel == mha.Kernel.reference


def test_train_and_eval_return_self():
    m = mha.MultiheadAttention(8, 2, seed=0)
    assert m.training is True  # like a new torch module
    assert m.eval() is m and m.training is False
    assert m.train() is m and m.training is True
    assert m.train(False) is m and m.training is False


@pytest.mark.parametrize("kwargs,name", [
    (dict(embed_dim=8, num_heads=3), "embed_dim"),
    (dict(embed_dim=8, num_heads=0), "num_heads"),
    (dict(embed_dim=0, num_heads=1), "embed_dim"),
    (dict(embed_dim=8, num_heads=2, dropout=1.0), "dropout"),
    (dict(embed_dim=8, num_heads=2, dropout=-0.1), "dropout"),
    (dict(embed_dim=8, num_heads=2, dtype=np.int32), "dtype"),
    (dict(embed_dim=8, num_heads=2, dtype=np.float16), "dtype"),
])
def test_invalid_config_raises_value_error(kwargs, name):
    with pytest.raises(ValueError) as excinfo:
        mha.MultiheadAttention(**kwargs, seed=0)
    message_names(excinfo, name)


# ---- forward errors ------------------------------------------------------------------------------

def _forward_error_cases():
    r = rng_for(21)
    q, k, v = normal(r, (2, 5, 8)), normal(r, (2, 7, 8)), normal(r, (2, 7, 8))
    return [
        ("rank-4-query", dict(query=q[..., None]), "query"),
        ("rank-1-query", dict(query=q[0, 0]), "query"),
        ("embed-dim", dict(query=normal(r, (2, 5, 9))), "query"),
        ("kdim", dict(key=normal(r, (2, 7, 9))), "key"),
        ("key-rank", dict(key=k[0]), "key"),
        ("batch", dict(key=normal(r, (3, 7, 8)), value=normal(r, (3, 7, 8))), "key"),
        ("value-length", dict(value=normal(r, (2, 6, 8))), "value"),
        ("mask-2d", dict(attn_mask=np.zeros((5, 8), bool)), "attn_mask"),
        ("mask-3d", dict(attn_mask=np.zeros((3, 5, 7), bool)), "attn_mask"),
        ("mask-rank", dict(attn_mask=np.zeros(7, bool)), "attn_mask"),
        ("mask-complex", dict(attn_mask=np.zeros((5, 7), complex)), "attn_mask"),
        ("kpm-length", dict(key_padding_mask=np.zeros((2, 8), bool)), "key_padding_mask"),
        ("kpm-batch", dict(key_padding_mask=np.zeros((3, 7), bool)), "key_padding_mask"),
        ("query-float64", dict(query=q.astype(np.float64)), "query"),
        ("query-int", dict(query=q.astype(np.int64)), "query"),
        ("query-bool", dict(query=q > 0), "query"),
        ("key-float64", dict(key=k.astype(np.float64)), "key"),
        ("value-float16", dict(value=v.astype(np.float16)), "value"),
        ("value-none", dict(value=None), "value"),
    ], (q, k, v)


_CASES, _QKV = _forward_error_cases()


@pytest.mark.parametrize("change,name", [(c[1], c[2]) for c in _CASES], ids=[c[0] for c in _CASES])
def test_forward_errors_name_the_argument(change, name):
    m = mha.MultiheadAttention(8, 2, batch_first=True, seed=0).eval()
    args = dict(query=_QKV[0], key=_QKV[1], value=_QKV[2])
    args.update(change)
    with pytest.raises(ValueError) as excinfo:
        m(**args)
    message_names(excinfo, name)


# ---- conversions: zero copy in, zero copy out ----------------------------------------------------

def test_inputs_reach_the_library_without_a_copy():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    describe = mha._core._describe_view
    d = describe(a.T)
    assert d["data"] == a.ctypes.data and d["shape"] == (6, 4) and d["strides"] == (1, 6)
    d = describe(a[1:, ::2])
    assert d["data"] == a[1:].ctypes.data and d["shape"] == (3, 3) and d["strides"] == (6, 2)
    d = describe(np.broadcast_to(a, (3, 4, 6)))
    assert d["data"] == a.ctypes.data and d["strides"] == (0, 6, 1)
    d = describe(a.astype(np.float64))
    assert d["dtype"] == "float64"
    m = np.zeros((3, 5), np.uint8)
    d = describe(m[:, 1:], mask=True)
    assert d["data"] == m[:, 1:].ctypes.data and d["dtype"] == "bool" and d["strides"] == (5, 1)
    assert describe(np.zeros((3, 5), bool), mask=True)["dtype"] == "bool"
    assert describe(np.zeros((3, 5), np.float32), mask=True)["dtype"] == "float32"


def test_inputs_that_need_a_copy_get_one():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    describe = mha._core._describe_view
    d = describe(a[::-1])  # negative stride
    assert d["data"] != a.ctypes.data and d["strides"] == (6, 1)
    raw = np.zeros(4 * 6 + 1, np.uint8)
    unaligned = raw[1:].view(np.float32)
    assert unaligned.ctypes.data % 4 != 0
    d = describe(unaligned)
    assert d["data"] % 4 == 0 and d["strides"] == (1,)
    record = np.zeros(5, dtype=[("x", np.float32), ("tag", np.int8)])["x"]  # byte stride 5
    d = describe(record)
    assert d["data"] != record.ctypes.data and d["strides"] == (1,)
    d = describe(a.astype(">f4"))  # big-endian
    assert d["dtype"] == "float32"
    d = describe(np.array([[0, 3], [-1, 0]], np.int64), mask=True)  # wide integers -> bool
    assert d["dtype"] == "bool"
    with pytest.raises(ValueError) as excinfo:
        describe(a.astype(np.int32), name="query")
    message_names(excinfo, "query")
    with pytest.raises(ValueError) as excinfo:
        describe(np.zeros(3, complex), name="attn_mask", mask=True)
    message_names(excinfo, "attn_mask")


def test_outputs_use_the_library_memory():
    m = mha.MultiheadAttention(8, 2, batch_first=True, seed=0).eval()
    x = normal(rng_for(1), (2, 5, 8))
    out, weights = m(x, x, x)
    for a in (out, weights):
        assert type(a.base).__name__ == "PyCapsule"
        assert not a.flags.owndata and a.flags.c_contiguous and a.flags.writeable
    out[:] = 0.0  # the memory is the array's own to write
    del weights
    assert (out == 0.0).all()


@pytest.mark.parametrize("batch_first", [True, False])
def test_strided_inputs_give_the_same_result_as_contiguous_copies(batch_first, kernel):
    r = rng_for(2)
    B, L, S, E, kdim, vdim, h = 3, 6, 9, 12, 5, 7, 3
    m = randomize_biases(mha.MultiheadAttention(E, h, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                                seed=0), r).eval()
    m.kernel = kernel
    # Views: the other layout transposed, every other column, a broadcast batch.
    shape = (lambda n, w: (B, n, w)) if batch_first else (lambda n, w: (n, B, w))
    q = normal(r, shape(L, 2 * E))[:, :, ::2]
    k_other = normal(r, (shape(S, kdim)[1], shape(S, kdim)[0], kdim))
    k = k_other.transpose(1, 0, 2)
    v_one = normal(r, (1,) + shape(S, vdim)[1:]) if batch_first else normal(r, (S, 1, vdim))
    v = np.broadcast_to(v_one, shape(S, vdim))
    kpm = (r.random((S, B)) < 0.3).T
    attn_mask = normal(r, (L, 2 * S))[:, 1::2]
    assert not any(a.flags.c_contiguous for a in (q, k, v, kpm, attn_mask))
    strided = m(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=False)
    copies = [np.ascontiguousarray(a) for a in (q, k, v, kpm, attn_mask)]
    contiguous = m(*copies[:3], key_padding_mask=copies[3], attn_mask=copies[4], average_attn_weights=False)
    for a, b in zip(strided, contiguous):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_self_attention_with_one_array():
    r = rng_for(3)
    m = randomize_biases(mha.MultiheadAttention(8, 2, batch_first=True, seed=0), r).eval()
    x = normal(r, (2, 5, 8))
    out, w = m(x, x, x)
    out2, w2 = m(x, x.copy(), x.copy())
    assert_close(out, out2)
    assert_close(w, w2)


def test_concurrent_calls_from_threads():
    """The compute releases the GIL; results from parallel threads equal the serial ones."""
    r = rng_for(4)
    modules = [randomize_biases(mha.MultiheadAttention(16, 4, batch_first=True, seed=s), r).eval()
               for s in range(4)]
    inputs = [normal(r, (2, 40, 16)) for _ in modules]
    serial = [m(x, x, x)[0] for m, x in zip(modules, inputs)]
    results = [None] * len(modules)

    def work(i):
        for _ in range(5):
            results[i] = modules[i](inputs[i], inputs[i], inputs[i])[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(modules))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(results, serial):
        assert_close(a, b)


def test_one_module_shared_by_threads():
    """Calls into one module from several threads are serialised by the module's lock."""
    r = rng_for(5)
    m = randomize_biases(mha.MultiheadAttention(16, 4, dropout=0.2, batch_first=True, seed=0), r)
    inputs = [normal(r, (2, 30, 16)) for _ in range(4)]
    m.eval()
    serial = [m(x, x, x)[0] for x in inputs]
    results = [None] * len(inputs)
    errors = []

    def work(i):
        try:
            for _ in range(5):
                results[i] = m(inputs[i], inputs[i], inputs[i])[0]
                m.load_state_dict(m.state_dict())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for a, b in zip(results, serial):
        assert_close(a, b)

    # Training mode: each forward replaces what backward uses; with equal shapes any interleaving
    # of the threads' forwards and backwards is valid.
    m.train()

    def train_work(i):
        try:
            for _ in range(5):
                out, _ = m(inputs[i], inputs[i], inputs[i])
                m.backward(np.ones_like(out))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=train_work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# ---- masks as torch reads them -------------------------------------------------------------------

def _module_and_inputs(seed, E=8, h=2, B=2, L=5, S=7, batch_first=True, kernel=mha.Kernel.flash):
    r = rng_for(seed)
    m = randomize_biases(mha.MultiheadAttention(E, h, batch_first=batch_first, seed=seed), r).eval()
    m.kernel = kernel
    return m, r, normal(r, (B, L, E)), normal(r, (B, S, E)), normal(r, (B, S, E))


def test_integer_masks_read_as_bool():
    m, r, q, k, v = _module_and_inputs(5)
    kpm = r.random((2, 7)) < 0.3
    mask = r.random((5, 7)) < 0.3
    expected = m(q, k, v, key_padding_mask=kpm, attn_mask=mask)
    for dtype in (np.uint8, np.int8, np.int64):
        got = m(q, k, v, key_padding_mask=kpm.astype(dtype) * 3, attn_mask=mask.astype(dtype) * 2)
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)


def test_float_key_padding_mask_is_added_like_torch(kernel):
    m, r, q, k, v = _module_and_inputs(6, kernel=kernel)
    kpm = normal(r, (2, 7))
    kpm[0, 2] = -np.inf
    t = torch_module(m, batch_first=True)
    with torch.no_grad():
        t_out, t_w = t(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                       key_padding_mask=torch.from_numpy(kpm))
    out, w = m(q, k, v, key_padding_mask=kpm)
    np.testing.assert_allclose(out, t_out.numpy(), atol=2e-6)
    np.testing.assert_allclose(w, t_w.numpy(), atol=2e-6)
    # with a float attn_mask the two add up
    mask = normal(r, (2 * 2, 5, 7))
    summed = mask + kpm.repeat(2, axis=0)[:, None, :]
    for a, b in zip(m(q, k, v, key_padding_mask=kpm, attn_mask=mask), m(q, k, v, attn_mask=summed)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError) as excinfo:
        m(q, k, v, key_padding_mask=normal(r, (2, 6)))
    message_names(excinfo, "key_padding_mask")
    # unbatched: [S]
    with torch.no_grad():
        t_out, t_w = t(torch.from_numpy(q[1]), torch.from_numpy(k[1]), torch.from_numpy(v[1]),
                       key_padding_mask=torch.from_numpy(kpm[1]), average_attn_weights=False)
    out, w = m(q[1], k[1], v[1], key_padding_mask=kpm[1], average_attn_weights=False)
    np.testing.assert_allclose(out, t_out.numpy(), atol=2e-6)
    np.testing.assert_allclose(w, t_w.numpy(), atol=2e-6)


def test_float64_attn_mask_in_a_float32_module():
    m, r, q, k, v = _module_and_inputs(7)
    mask = r.normal(size=(5, 7))
    for a, b in zip(m(q, k, v, attn_mask=mask), m(q, k, v, attn_mask=mask.astype(np.float32))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("L,S", [(5, 5), (3, 8), (8, 3), (1, 6)])
def test_is_causal_is_a_bottom_right_causal_mask(L, S, kernel):
    m, r, q, k, v = _module_and_inputs(8, L=L, S=S, kernel=kernel)
    causal = m(q, k, v, is_causal=True, average_attn_weights=False)
    explicit = m(q, k, v, attn_mask=causal_forbidden(L, S), average_attn_weights=False)
    for a, b in zip(causal, explicit):
        assert_close(a, b)
    extra = r.random((L, S)) < 0.3  # combines with attn_mask
    both = m(q, k, v, attn_mask=extra, is_causal=True)
    merged = m(q, k, v, attn_mask=extra | causal_forbidden(L, S))
    for a, b in zip(both, merged):
        assert_close(a, b)


def test_key_lengths_equal_a_padding_mask(kernel):
    m, r, q, k, v = _module_and_inputs(9, kernel=kernel)
    lengths = [3, 7]
    kpm = np.arange(7)[None, :] >= np.array(lengths)[:, None]
    for a, b in zip(m(q, k, v, key_lengths=lengths), m(q, k, v, key_padding_mask=kpm)):
        assert_close(a, b)


# ---- shapes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("extras", [{}, dict(add_bias_kv=True, add_zero_attn=True)], ids=["plain", "extras"])
def test_unbatched_input_equals_a_batch_of_one(batch_first, extras, kernel):
    r = rng_for(10)
    E, h, L, S = 12, 3, 4, 6
    m = randomize_biases(mha.MultiheadAttention(E, h, kdim=5, batch_first=batch_first, seed=1, **extras), r).eval()
    m.kernel = kernel
    q, k, v = normal(r, (L, E)), normal(r, (S, 5)), normal(r, (S, E))
    kpm = r.random(S) < 0.3
    mask = r.random((h, L, S)) < 0.2
    S2 = S + len(extras)
    out, w = m(q, k, v, key_padding_mask=kpm, attn_mask=mask)
    assert out.shape == (L, E) and w.shape == (L, S2)
    out_h, w_h = m(q, k, v, key_padding_mask=kpm, attn_mask=mask, average_attn_weights=False)
    assert out_h.shape == (L, E) and w_h.shape == (h, L, S2)
    out_n, w_n = m(q, k, v, need_weights=False)
    assert out_n.shape == (L, E) and w_n is None
    batch = (lambda x: x[None]) if batch_first else (lambda x: x[:, None])
    out_b, w_b = m(batch(q), batch(k), batch(v), key_padding_mask=kpm[None], attn_mask=mask,
                   average_attn_weights=False)
    out_b = out_b[0] if batch_first else out_b[:, 0]
    np.testing.assert_allclose(out_h, out_b, atol=1e-6)
    np.testing.assert_allclose(w_h, w_b[0], atol=1e-7)
    np.testing.assert_allclose(w, w_h.mean(axis=0), atol=1e-6)
    t = torch_module(m, kdim=5, batch_first=batch_first, **extras)
    with torch.no_grad():
        t_out, t_w = t(*(torch.from_numpy(x) for x in (q, k, v)), key_padding_mask=torch.from_numpy(kpm),
                       attn_mask=torch.from_numpy(mask), average_attn_weights=False)
    assert t_out.shape == out_h.shape and t_w.shape == w_h.shape


@pytest.mark.parametrize("batch_first", [True, False])
def test_empty_queries(batch_first, kernel):
    m = with_kernel(mha.MultiheadAttention(8, 2, batch_first=batch_first, seed=0).eval(), kernel)
    r = rng_for(11)
    shape = (lambda n: (3, n, 8)) if batch_first else (lambda n: (n, 3, 8))
    out, w = m(normal(r, shape(0)), normal(r, shape(4)), normal(r, shape(4)))
    assert out.shape == shape(0) and w.shape == (3, 0, 4)
    out, w = m(np.zeros((0, 8), np.float32), normal(r, (4, 8)), normal(r, (4, 8)))
    assert out.shape == (0, 8) and w.shape == (0, 4)


@pytest.mark.parametrize("bias", [True, False])
def test_empty_keys_give_the_defined_result(bias, kernel):
    r = rng_for(12)
    m = randomize_biases(mha.MultiheadAttention(8, 2, bias=bias, batch_first=True, seed=0), r).eval()
    m.kernel = kernel
    out, w = m(normal(r, (2, 3, 8)), np.zeros((2, 0, 8), np.float32), np.zeros((2, 0, 8), np.float32))
    assert out.shape == (2, 3, 8) and w.shape == (2, 3, 0)
    expected = m.parameter("out_proj.bias") if bias else np.zeros(8, np.float32)
    np.testing.assert_array_equal(out, np.broadcast_to(expected, out.shape))
    # with add_bias_kv there is one key even when S = 0
    mb = randomize_biases(mha.MultiheadAttention(8, 2, bias=bias, add_bias_kv=True, batch_first=True,
                                                 seed=0), r).eval()
    mb.kernel = kernel
    q = normal(r, (2, 3, 8))
    out, w = mb(q, np.zeros((2, 0, 8), np.float32), np.zeros((2, 0, 8), np.float32))
    assert w.shape == (2, 3, 1)
    np.testing.assert_allclose(w, 1.0)
    ref, _ = mha_reference(mb.state_dict(), q, np.zeros((2, 0, 8)), np.zeros((2, 0, 8)), 2, 4, 4)
    np.testing.assert_allclose(out, ref, atol=1e-5)


# ---- generality torch cannot express, against the NumPy reference -------------------------------

GENERAL_CASES = [
    dict(E=16, h=2, d_k=3, d_v=5),
    dict(E=10, h=3, d_k=7, d_v=2, kdim=4, vdim=9),
    dict(E=8, h=4, d_k=2, d_v=2),                                # packed, h*d_k == E
    dict(E=9, h=2, d_k=6, d_v=6),                                # packed, h*d_k != E
    dict(E=12, h=5, d_k=1, d_v=13, bias=False),
    dict(E=6, h=2, d_k=8, d_v=3, add_bias_kv=True, add_zero_attn=True),
    dict(E=6, h=3, d_k=4, d_v=5, kdim=6, vdim=6, mask="bool2d", kpm=True),
    dict(E=7, h=2, d_k=5, d_v=9, mask="float3d", causal=True),
    dict(E=20, h=4, d_k=16, d_v=3, mask="bool3d", kpm=True, add_bias_kv=True, L=40, S=70),
    dict(E=5, h=1, d_k=13, d_v=1, causal=True, L=9, S=4),        # L > S: first rows see nothing
    dict(E=32, h=8, d_k=5, d_v=7, kdim=3, vdim=11, kpm=True, L=64, S=33),
]


def _general_inputs(case, r):
    B, L, S = case.get("B", 2), case.get("L", 5), case.get("S", 8)
    E, h = case["E"], case["h"]
    kdim, vdim = case.get("kdim", E), case.get("vdim", E)
    query, key, value = normal(r, (B, L, E)), normal(r, (B, S, kdim)), normal(r, (B, S, vdim))
    kpm = (r.random((B, S)) < 0.25) if case.get("kpm") else None
    mask = None
    kind = case.get("mask")
    if kind == "bool2d":
        mask = r.random((L, S)) < 0.25
    elif kind == "bool3d":
        mask = r.random((B * h, L, S)) < 0.25
    elif kind == "float3d":
        mask = normal(r, (B * h, L, S))
        mask[r.random(mask.shape) < 0.2] = -np.inf
    if kpm is not None:
        kpm[0, :] = True  # one batch entry with no keys at all
    return query, key, value, kpm, mask


def _general_module(case, dtype, seed, kernel):
    return with_kernel(mha.MultiheadAttention(case["E"], case["h"], d_k=case["d_k"], d_v=case["d_v"],
                                  kdim=case.get("kdim"), vdim=case.get("vdim"),
                                  bias=case.get("bias", True), add_bias_kv=case.get("add_bias_kv", False),
                                  add_zero_attn=case.get("add_zero_attn", False), batch_first=True,
                                  dtype=dtype, seed=seed).eval(), kernel)


@pytest.mark.parametrize("case", GENERAL_CASES, ids=[
    "-".join(f"{k}{v}" for k, v in c.items()) for c in GENERAL_CASES])
def test_general_head_widths_against_numpy_reference(case, kernel):
    r = rng_for(13, len(case), case["E"], case["d_k"])
    m = randomize_biases(_general_module(case, np.float32, 5, kernel), r)
    state = m.state_dict()
    hk, hv = case["h"] * case["d_k"], case["h"] * case["d_v"]
    assert state["out_proj.weight"].shape == (case["E"], hv)
    if "in_proj_weight" in state:
        assert state["in_proj_weight"].shape == (2 * hk + hv, case["E"])
    else:
        assert state["q_proj_weight"].shape == (hk, case["E"])
    query, key, value, kpm, mask = _general_inputs(case, r)
    causal = case.get("causal", False)
    kwargs = dict(num_heads=case["h"], d_k=case["d_k"], d_v=case["d_v"], attn_mask=mask,
                  key_padding_mask=kpm, causal=causal, add_zero_attn=case.get("add_zero_attn", False))
    ref64, w64 = mha_reference(state, query, key, value, dtype=np.float64, **kwargs)
    ref32, w32 = mha_reference(state, query, key, value, dtype=np.float32, **kwargs)

    out, w = m(query, key, value, key_padding_mask=kpm, attn_mask=mask, is_causal=causal,
               average_attn_weights=False)
    assert out.shape == ref64.shape and w.shape == w64.shape
    assert np.isfinite(out).all() and np.isfinite(w).all()
    assert max_abs_diff(out, ref64) <= error_bound(max_abs_diff(ref32, ref64))
    assert max_abs_diff(w, w64) <= error_bound(max_abs_diff(w32, w64))
    _, w_avg = m(query, key, value, key_padding_mask=kpm, attn_mask=mask, is_causal=causal)
    assert max_abs_diff(w_avg, w64.mean(axis=1)) <= error_bound(max_abs_diff(w32.mean(axis=1), w64.mean(axis=1)))

    m64 = _general_module(case, np.float64, 5, kernel)
    m64.load_state_dict(state)
    q64, k64, v64 = (x.astype(np.float64) for x in (query, key, value))
    out64, wd = m64(q64, k64, v64, key_padding_mask=kpm, attn_mask=mask, is_causal=causal,
                    average_attn_weights=False)
    assert out64.dtype == np.float64
    assert max_abs_diff(out64, ref64) <= 1e-12 * max(1.0, np.abs(ref64).max())
    assert max_abs_diff(wd, w64) <= 1e-12


# ---- scaled_dot_product_attention against torch (float64, written out) ---------------------------

def torch_sdpa(q, k, v, additive, scale, dtype):
    """softmax(q k^T * scale + mask) v in torch, in `dtype`; NaN rows (nothing allowed) -> 0."""
    tq, tk, tv = (torch.from_numpy(np.asarray(x).astype(dtype)) for x in (q, k, v))
    logits = tq @ tk.transpose(-1, -2) * scale + torch.from_numpy(additive.astype(dtype))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return (weights @ tv).numpy(), weights.numpy()


def _sdpa_case(seed):
    r = rng_for(14, seed)
    B, h = int(r.integers(1, 4)), int(r.integers(1, 5))
    L, S = int(r.integers(1, 40)), int(r.integers(1, 40))
    d_k, d_v = int(r.choice([1, 3, 8, 13, 32])), int(r.choice([1, 5, 8, 16]))
    return dict(seed=seed, B=B, h=h, L=L, S=S, d_k=d_k, d_v=d_v,
                causal=bool(r.random() < 0.4), mask=str(r.choice(["none", "bool2d", "bool3d", "float4d"])),
                kpm=bool(r.random() < 0.4), scale=None if r.random() < 0.6 else float(r.uniform(0.05, 2.0)),
                layout=str(r.choice(["contiguous", "transposed"])))


SDPA_CASES = [_sdpa_case(s) for s in range(40)]


@pytest.mark.parametrize("case", SDPA_CASES, ids=[
    "{seed:02d}-B{B}-h{h}-L{L}-S{S}-dk{d_k}-dv{d_v}-{mask}".format(**c) + ("-causal" if c["causal"] else "")
    + ("-kpm" if c["kpm"] else "") + ("" if c["scale"] is None else "-scale") + "-" + c["layout"]
    for c in SDPA_CASES])
def test_scaled_dot_product_attention_against_torch(case, kernel):
    r = rng_for(15, case["seed"])
    B, h, L, S, d_k, d_v = (case[n] for n in ("B", "h", "L", "S", "d_k", "d_v"))
    if case["layout"] == "transposed":  # [B, L, h, d] memory viewed as [B, h, L, d]
        q = normal(r, (B, L, h, d_k)).transpose(0, 2, 1, 3)
        k = normal(r, (B, S, h, d_k)).transpose(0, 2, 1, 3)
        v = normal(r, (B, S, h, d_v)).transpose(0, 2, 1, 3)
    else:
        q, k, v = normal(r, (B, h, L, d_k)), normal(r, (B, h, S, d_k)), normal(r, (B, h, S, d_v))
    mask = None
    if case["mask"] == "bool2d":
        mask = r.random((L, S)) < 0.2
    elif case["mask"] == "bool3d":
        mask = r.random((B * h, L, S)) < 0.2
    elif case["mask"] == "float4d":
        mask = normal(r, (B, h, L, S))
        mask[r.random(mask.shape) < 0.1] = -np.inf
    kpm = (r.random((B, S)) < 0.2) if case["kpm"] else None
    if kpm is not None and L > 1:
        kpm[-1, :] = True  # a batch entry with every key padded: all its rows are defined zeros
    scale = case["scale"]
    additive = additive_mask(B, h, L, S, mask, kpm, case["causal"])
    s = 1.0 / np.sqrt(d_k) if scale is None else scale
    ref64, w64 = torch_sdpa(q, k, v, additive, s, np.float64)
    ref32, w32 = torch_sdpa(q, k, v, additive, s, np.float32)

    out, w = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=case["causal"],
                                              scale=scale, key_padding_mask=kpm, need_weights=True,
                                              kernel=kernel)
    assert out.shape == (B, h, L, d_v) and w.shape == (B, h, L, S) and out.dtype == np.float32
    assert np.isfinite(out).all() and np.isfinite(w).all()
    assert max_abs_diff(out, ref64) <= error_bound(max_abs_diff(ref32, ref64))
    assert max_abs_diff(w, w64) <= error_bound(max_abs_diff(w32, w64))
    dead = np.isneginf(additive).all(axis=-1)  # rows with nothing allowed: exactly 0
    assert (out[dead] == 0).all() and (w[dead] == 0).all()
    only_out = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=case["causal"],
                                                scale=scale, key_padding_mask=kpm, kernel=kernel)
    assert_close(only_out, out)

    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    out64, wd = mha.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, is_causal=case["causal"],
                                                 scale=scale, key_padding_mask=kpm, need_weights=True,
                                                 kernel=kernel)
    assert out64.dtype == np.float64
    assert max_abs_diff(out64, ref64) <= 1e-12 and max_abs_diff(wd, w64) <= 1e-12


def test_sdpa_causal_alignment_and_fully_masked_rows(kernel):
    r = rng_for(16)
    q, k, v = normal(r, (1, 2, 6, 4)), normal(r, (1, 2, 3, 4)), normal(r, (1, 2, 3, 5))
    out, w = mha.scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=True, kernel=kernel)
    # L = 6 > S = 3: query i sees keys j <= i - 3, so rows 0..2 see nothing
    assert (out[:, :, :3] == 0).all() and (w[:, :, :3] == 0).all()
    np.testing.assert_allclose(w[0, :, 3], [[1, 0, 0]] * 2, atol=1e-7)
    np.testing.assert_allclose(w[0, :, 5].sum(axis=-1), 1.0, atol=1e-6)
    assert (w[0, :, 5] > 0).all()
    # L = 2 < S = 5: the last query sees every key, the first all but the last
    q2 = normal(r, (1, 1, 2, 4))
    k2, v2 = normal(r, (1, 1, 5, 4)), normal(r, (1, 1, 5, 3))
    _, w2 = mha.scaled_dot_product_attention(q2, k2, v2, is_causal=True, need_weights=True, kernel=kernel)
    assert (w2[0, 0, 1] > 0).all() and w2[0, 0, 0, 4] == 0 and (w2[0, 0, 0, :4] > 0).all()


def test_sdpa_unbatched_and_empty(kernel):
    r = rng_for(17)
    q, k, v = normal(r, (3, 4, 5)), normal(r, (3, 6, 5)), normal(r, (3, 6, 2))
    kpm = r.random(6) < 0.3
    out, w = mha.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, need_weights=True, kernel=kernel)
    out_b, w_b = mha.scaled_dot_product_attention(q[None], k[None], v[None], key_padding_mask=kpm[None],
                                                  need_weights=True, kernel=kernel)
    assert out.shape == (3, 4, 2) and w.shape == (3, 4, 6)
    assert_close(out, out_b[0])
    assert_close(w, w_b[0])
    # S = 0: nothing to attend to, output 0
    out, w = mha.scaled_dot_product_attention(normal(r, (2, 3, 4, 5)), np.zeros((2, 3, 0, 5), np.float32),
                                              np.zeros((2, 3, 0, 7), np.float32), need_weights=True, kernel=kernel)
    assert out.shape == (2, 3, 4, 7) and (out == 0).all() and w.shape == (2, 3, 4, 0)
    # L = 0
    out, w = mha.scaled_dot_product_attention(np.zeros((2, 3, 0, 5), np.float32), normal(r, (2, 3, 4, 5)),
                                              normal(r, (2, 3, 4, 7)), need_weights=True, kernel=kernel)
    assert out.shape == (2, 3, 0, 7) and w.shape == (2, 3, 0, 4)


def test_sdpa_key_lengths_and_large_logits(kernel):
    r = rng_for(18)
    q, k, v = normal(r, (2, 2, 3, 4)), normal(r, (2, 2, 5, 4)), normal(r, (2, 2, 5, 3))
    kpm = np.arange(5)[None, :] >= np.array([2, 5])[:, None]
    a = mha.scaled_dot_product_attention(q, k, v, key_lengths=[2, 5], need_weights=True, kernel=kernel)
    b = mha.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, need_weights=True, kernel=kernel)
    for x, y in zip(a, b):
        assert_close(x, y)
    # logits of 1e4 do not overflow
    out, w = mha.scaled_dot_product_attention(q * 100, k * 100, v, need_weights=True, kernel=kernel)
    assert np.isfinite(out).all() and np.isfinite(w).all()
    np.testing.assert_allclose(w.sum(axis=-1), 1.0, atol=1e-6)


def test_sdpa_errors_name_the_argument():
    r = rng_for(19)
    q, k, v = normal(r, (1, 2, 3, 4)), normal(r, (1, 2, 5, 4)), normal(r, (1, 2, 5, 3))
    cases = [
        (dict(q=q[0, 0]), "q"),
        (dict(k=normal(r, (1, 2, 5, 3))), "k"),
        (dict(v=normal(r, (1, 2, 4, 3))), "v"),
        (dict(k=k.astype(np.float64)), "k"),
        (dict(q=q.astype(np.int32)), "q"),
        (dict(attn_mask=np.zeros((3, 4), bool)), "attn_mask"),
        (dict(key_padding_mask=np.zeros((1, 4), bool)), "key_padding_mask"),
        (dict(key_lengths=[6]), "key_lengths"),
        (dict(dropout_p=1.0), "dropout_p"),
    ]
    for change, name in cases:
        args = dict(q=q, k=k, v=v)
        args.update(change)
        with pytest.raises(ValueError) as excinfo:
            mha.scaled_dot_product_attention(**args)
        message_names(excinfo, name)


# ---- dropout -------------------------------------------------------------------------------------

def _dropout_setup(p, seed=20, kernel=mha.Kernel.flash):
    r = rng_for(seed)
    E, h, B, L, S = 16, 4, 2, 16, 16
    state_source = randomize_biases(mha.MultiheadAttention(E, h, batch_first=True, seed=seed), r)
    m = mha.MultiheadAttention(E, h, dropout=p, batch_first=True, seed=seed)
    m.load_state_dict(state_source.state_dict())
    m.kernel = state_source.kernel = kernel
    return m, state_source.eval(), normal(r, (B, L, E)), normal(r, (B, S, E)), normal(r, (B, S, E))


def test_eval_mode_has_no_dropout(kernel):
    m, plain, q, k, v = _dropout_setup(0.5, kernel=kernel)
    m.eval()
    for a, b in zip(m(q, k, v, average_attn_weights=False), plain(q, k, v, average_attn_weights=False)):
        np.testing.assert_array_equal(a, b)
    zero = with_kernel(mha.MultiheadAttention(16, 4, dropout=0.0, batch_first=True, seed=0).train(), kernel)
    zero.load_state_dict(plain.state_dict())
    for a, b in zip(zero(q, k, v), plain(q, k, v)):  # p = 0 in training mode: no dropout either
        np.testing.assert_array_equal(a, b)


def test_training_mode_drops_and_rescales_weights(kernel):
    p = 0.5
    m, plain, q, k, v = _dropout_setup(p, kernel=kernel)
    assert m.training
    out, w = m(q, k, v, average_attn_weights=False)
    out_eval, w_eval = plain(q, k, v, average_attn_weights=False)
    assert not np.allclose(out, out_eval)
    dropped = w == 0
    assert 0.4 < dropped.mean() < 0.6
    np.testing.assert_allclose(w[~dropped], w_eval[~dropped] / (1 - p), rtol=1e-5, atol=1e-7)
    # the output is the out-projection of the dropped weights applied to the values
    ref64, _ = mha_reference(m.state_dict(), q, k, v, 4, 4, 4, weights_override=w.astype(np.float64))
    ref32, _ = mha_reference(m.state_dict(), q, k, v, 4, 4, 4, dtype=np.float32, weights_override=w)
    assert max_abs_diff(out, ref64) <= error_bound(max_abs_diff(ref32, ref64))


def test_training_mode_draws_a_new_mask_per_call(kernel):
    m, _, q, k, v = _dropout_setup(0.3, kernel=kernel)
    out1, w1 = m(q, k, v, average_attn_weights=False)
    out2, w2 = m(q, k, v, average_attn_weights=False)
    assert not np.array_equal(w1 == 0, w2 == 0)
    assert not np.allclose(out1, out2)


def test_dropout_sequence_follows_the_seed():
    a, _, q, k, v = _dropout_setup(0.3, seed=21)
    b, _, _, _, _ = _dropout_setup(0.3, seed=21)
    for _ in range(2):
        for x, y in zip(a(q, k, v), b(q, k, v)):
            np.testing.assert_array_equal(x, y)


def test_sdpa_dropout(kernel):
    r = rng_for(22)
    q, k, v = normal(r, (2, 3, 8, 4)), normal(r, (2, 3, 9, 4)), normal(r, (2, 3, 9, 5))
    p = 0.25

    def sdpa(**kwargs):
        return mha.scaled_dot_product_attention(q, k, v, need_weights=True, kernel=kernel, **kwargs)

    _, w0 = sdpa()
    out1, w1 = sdpa(dropout_p=p, dropout_seed=1)
    out1b, w1b = sdpa(dropout_p=p, dropout_seed=1)
    _, w2 = sdpa(dropout_p=p, dropout_seed=2)
    np.testing.assert_array_equal(out1, out1b)
    np.testing.assert_array_equal(w1, w1b)
    assert not np.array_equal(w1 == 0, w2 == 0)
    kept = w1 != 0
    assert 0.15 < 1 - kept.mean() < 0.35
    np.testing.assert_allclose(w1[kept], w0[kept] / (1 - p), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out1, w1.astype(np.float64) @ v.astype(np.float64), atol=1e-5)
    out_only = mha.scaled_dot_product_attention(q, k, v, kernel=kernel, dropout_p=p, dropout_seed=1)
    assert_close(out_only, out1)


def test_kernels_agree_including_the_dropout_mask():
    """The dropout mask is a hash of (seed, b, h, i, j), so it does not depend on the kernel."""
    r = rng_for(24)
    q, k, v = normal(r, (2, 3, 70, 8)), normal(r, (2, 3, 300, 8)), normal(r, (2, 3, 300, 5))
    mask = r.random((70, 300)) < 0.1
    results = {
        name: mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, need_weights=True,
                                               dropout_p=0.2, dropout_seed=9, kernel=kernel)
        for name, kernel in KERNELS.items()}
    (out_f, w_f), (out_r, w_r) = results["flash"], results["reference"]
    np.testing.assert_array_equal(w_f == 0, w_r == 0)
    assert_close(w_f, w_r)
    assert_close(out_f, out_r, atol=1e-5)


def test_softmax_reference_defines_masked_rows():
    """The helper the references use: rows of -inf give 0, others sum to 1."""
    logits = np.array([[0.0, 1.0, -np.inf], [-np.inf, -np.inf, -np.inf]])
    w = softmax_rows(logits)
    np.testing.assert_allclose(w[0].sum(), 1.0)
    assert (w[1] == 0).all()


@pytest.mark.parametrize("how", ["key_padding_mask", "key_lengths", "bool_mask", "float_mask", "causal"])
def test_nan_and_inf_at_masked_keys_do_not_reach_the_output(how, kernel):
    """Masked keys are never read (attention.hpp): NaN/Inf stored there cannot reach any output."""
    r = rng_for(23)
    B, h, L, S, E = 2, 2, 5, 5, 8
    q = normal(r, (B, h, L, 4))
    k, v = normal(r, (B, h, S, 4)), normal(r, (B, h, S, 3))
    k[:, :, S - 1] = np.nan
    v[:, :, S - 1] = np.inf
    masked = np.zeros((L, S), bool)
    masked[:, S - 1] = True
    kwargs = {
        "key_padding_mask": dict(key_padding_mask=np.broadcast_to(masked[0], (B, S))),
        "key_lengths": dict(key_lengths=[S - 1] * B),
        "bool_mask": dict(attn_mask=masked),
        "float_mask": dict(attn_mask=np.where(masked, -np.inf, normal(r, (L, S)))),
        "causal": dict(is_causal=True),
    }[how]
    rows = slice(0, L - 1) if how == "causal" else slice(0, L)  # with causal, the last query sees key S-1
    out, w = mha.scaled_dot_product_attention(q, k, v, need_weights=True, kernel=kernel, **kwargs)
    assert np.isfinite(out[:, :, rows]).all() and np.isfinite(w[:, :, rows]).all()
    assert (w[:, :, rows, S - 1] == 0).all()

    m = with_kernel(randomize_biases(mha.MultiheadAttention(E, h, batch_first=True, seed=0), r).eval(), kernel)
    query, key, value = normal(r, (B, L, E)), normal(r, (B, S, E)), normal(r, (B, S, E))
    key[:, S - 1] = np.nan
    value[:, S - 1] = np.inf
    out, w = m(query, key, value, **kwargs)
    assert np.isfinite(out[:, rows]).all() and np.isfinite(w[:, rows]).all()


# ---- files: save / load, safetensors and .npy from Python ----------------------------------------

def test_save_and_load_round_trip(tmp_path):
    layer = mha.MultiheadAttention(8, 2, kdim=5, vdim=6, add_bias_kv=True, batch_first=True, d_v=3, seed=3).eval()
    layer.save(tmp_path / "layer.safetensors")
    loaded = mha.load(tmp_path / "layer.safetensors").eval()
    assert repr(loaded) == repr(layer)
    for name, value in layer.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[name], value)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 8), dtype=np.float32)
    k = rng.standard_normal((2, 4, 5), dtype=np.float32)
    v = rng.standard_normal((2, 4, 6), dtype=np.float32)
    np.testing.assert_array_equal(loaded(q, k, v)[0], layer(q, k, v)[0])


def test_load_refuses_a_file_without_mha_metadata(tmp_path):
    mha.write_safetensors(str(tmp_path / "plain.safetensors"), {"w": np.ones((2, 2), np.float32)})
    with pytest.raises(ValueError, match="no mha metadata"):
        mha.load(tmp_path / "plain.safetensors")


def test_npy_round_trip_and_a_hostile_file(tmp_path):
    a = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]  # strided
    mha.write_npy(str(tmp_path / "a.npy"), a)
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), a)
    np.testing.assert_array_equal(mha.read_npy(str(tmp_path / "a.npy")), a)
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY\x01\x00\xff\xff")
    with pytest.raises(ValueError, match="bad.npy"):
        mha.read_npy(str(tmp_path / "bad.npy"))
