"""File formats through the Python bindings, against PyTorch and NumPy.

* a torch.nn.MultiheadAttention state_dict written as safetensors (by hand, as the `safetensors`
  package lays it out; Debian has no such package) loads into mha.MultiheadAttention and gives
  torch's forward;
* a layer saved by mha loads, through a strict safetensors reader, into torch with strict=True;
* float16 / bfloat16 written from torch read back as torch converts them;
* .npy files from NumPy (format versions 1.0, 2.0, 3.0, Fortran order, bool, 0-d, empty, float16)
  read by mha, and .npy files from mha read by np.load;
* every committed hostile file (tests/data/hostile) raises mha.Error naming the file.

The helpers that write and strictly read safetensors in Python live in tests/data/torch_interop.py,
shared with the C++ interop tests (tests/cpp/io/formats_test.cpp, IoTorch.*).
"""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mha

DATA = Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(DATA))
import torch_interop  # noqa: E402


def randomised(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-0.5, 0.5)
    return module.eval()


@pytest.mark.parametrize("config", [
    dict(embed_dim=16, num_heads=4, add_bias_kv=True, batch_first=True),
    dict(embed_dim=12, num_heads=3, bias=False, kdim=5, vdim=7),
    dict(embed_dim=8, num_heads=2, add_zero_attn=True),
], ids=["packed_bias_kv_batch_first", "separate_kdim5_vdim7_nobias", "packed_zero_attn_seq_first"])
def test_torch_state_dict_file_loads_and_matches_forward(tmp_path, config):
    ref = randomised(torch.nn.MultiheadAttention(**config), seed=1)
    path = tmp_path / "torch.safetensors"
    torch_interop.write_safetensors(path, ref.state_dict(), {"format": "pt"})

    tensors, metadata = mha.read_safetensors(str(path))
    assert metadata == {"format": "pt"}
    assert set(tensors) == set(ref.state_dict())
    for name, t in ref.state_dict().items():
        np.testing.assert_array_equal(tensors[name], t.numpy(), err_msg=name)

    layer = mha.MultiheadAttention(**config).eval()
    layer.load_state_dict(tensors)
    E, kdim, vdim = config["embed_dim"], config.get("kdim", config["embed_dim"]), config.get("vdim", config["embed_dim"])
    batch_first = config.get("batch_first", False)
    shape = (lambda T, W: (2, T, W)) if batch_first else (lambda T, W: (T, 2, W))
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(*shape(T, W), generator=g) for T, W in ((5, E), (7, kdim), (7, vdim)))
    expected, expected_weights = ref(q, k, v)
    out, weights = layer(q.numpy(), k.numpy(), v.numpy())
    np.testing.assert_allclose(out, expected.detach().numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(weights, expected_weights.detach().numpy(), atol=1e-6, rtol=1e-5)


def test_mha_file_loads_in_torch(tmp_path):
    layer = mha.MultiheadAttention(16, 4, add_bias_kv=True, batch_first=True, seed=3).eval()
    rng = np.random.default_rng(4)
    layer.load_state_dict({n: rng.uniform(-0.5, 0.5, p.shape).astype(np.float32)
                           for n, p in layer.state_dict().items()})
    path = tmp_path / "mha.safetensors"
    layer.save(path)

    state, metadata = torch_interop.read_safetensors(path)  # strict: padding, tiling, alignment
    assert metadata["format"] == "mha" and metadata["num_heads"] == "4" and metadata["batch_first"] == "true"
    ref = torch.nn.MultiheadAttention(16, 4, add_bias_kv=True, batch_first=True).eval()
    ref.load_state_dict(state, strict=True)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 5, 16), (2, 7, 16), (2, 7, 16)))
    expected, _ = ref(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v))
    out, _ = layer(q, k, v)
    np.testing.assert_allclose(out, expected.detach().numpy(), atol=1e-5, rtol=1e-5)

    again = mha.load(path).eval()
    np.testing.assert_array_equal(again(q, k, v)[0], out)


def test_half_and_bfloat16_read_as_torch_converts_them(tmp_path):
    x = torch.tensor([0.0, -0.0, 1.0, -2.0, 1 / 3, 65504.0, 7e4, 6e-8, 1e-40, 3e38, float("inf"),
                      -float("inf"), float("nan"), 3.14159, -1e-5])
    path = tmp_path / "halves.safetensors"
    torch_interop.write_safetensors(path, {"f16": x.half(), "bf16": x.bfloat16()})
    tensors, _ = mha.read_safetensors(str(path))
    for name, t in (("f16", x.half()), ("bf16", x.bfloat16())):
        assert tensors[name].dtype == np.float32
        # Bit for bit, NaN included.
        np.testing.assert_array_equal(tensors[name].view(np.uint32), t.float().numpy().view(np.uint32), err_msg=name)


A64 = np.arange(24, dtype=np.float64).reshape(2, 3, 4) * 0.25 - 1
NPY_ARRAYS = {
    "f4": A64.astype(np.float32),
    "f8_fortran": np.asfortranarray(A64),
    "f4_fortran_2d": np.asfortranarray(A64[0].astype(np.float32)),
    "bool": A64 > 0,
    "scalar": np.array(3.75),
    "empty": np.zeros((0, 3), np.float32),
    "rank4": A64.reshape(1, 2, 3, 4),
}


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)], ids=["v1", "v2", "v3"])
@pytest.mark.parametrize("name", list(NPY_ARRAYS))
def test_npy_from_numpy(tmp_path, name, version):
    array = NPY_ARRAYS[name]
    path = tmp_path / f"{name}.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, version=version)
    got = mha.read_npy(str(path))
    assert got.dtype == array.dtype and got.shape == array.shape
    np.testing.assert_array_equal(got, array)


def test_npy_float16_from_numpy_reads_as_float32(tmp_path):
    array = np.array([1, -2, 0.5, 65504, 6e-8, np.inf, -0.0], dtype=np.float16)
    np.save(tmp_path / "f2.npy", array)
    got = mha.read_npy(str(tmp_path / "f2.npy"))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, array.astype(np.float32))


@pytest.mark.parametrize("name", list(NPY_ARRAYS))
def test_npy_to_numpy(tmp_path, name):
    array = NPY_ARRAYS[name]
    path = tmp_path / f"{name}.npy"
    mha.write_npy(str(path), array)  # Fortran-ordered input is written in C order
    got = np.load(path)
    assert got.dtype == array.dtype and got.shape == array.shape and got.flags.c_contiguous
    np.testing.assert_array_equal(got, array)


HOSTILE = sorted((DATA / "hostile").iterdir())


def test_hostile_folder_is_populated():
    assert len(HOSTILE) >= 50


@pytest.mark.parametrize("path", HOSTILE, ids=[p.name for p in HOSTILE])
def test_hostile_file_raises_naming_it(path):
    read = mha.read_npy if path.suffix == ".npy" else mha.read_safetensors
    with pytest.raises(mha.Error) as error:
        read(str(path))
    assert str(error.value).startswith(f"{path}: "), str(error.value)
