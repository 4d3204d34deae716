"""PyTorch and NumPy side of the file-format interop tests (tests/cpp/io/formats_test.cpp, IoTorch.*).

    torch_interop.py write DIR   writes files from PyTorch and NumPy for the C++ side to read
    torch_interop.py check DIR   reads the files the C++ side wrote into DIR; exits non-zero on a mismatch

Debian has no `safetensors` package, so safetensors files are written and read here by hand, the way
the reference implementation lays them out (8-byte little-endian header length, JSON header padded
with spaces to a multiple of 8, then the tensors back to back). The reader is strict: it checks
everything the format requires, so a file it accepts is one the real package accepts.
"""
import json
import struct
import sys
from pathlib import Path

import numpy as np
import torch

TORCH_TO_ST = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.bool: "BOOL"}
ST_TO_NUMPY = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "BOOL": np.bool_}
SHAPES = [(), (0,), (5,), (2, 3), (3, 0, 2), (2, 3, 4), (2, 1, 3, 2), (0, 0, 0, 0)]  # kShapes in formats_test.cpp


def write_safetensors(path, tensors, metadata=None):
    """What safetensors.torch.save_file writes: wider dtypes first, then by name."""
    header = {"__metadata__": metadata} if metadata else {}
    blobs, offset = [], 0
    for name, t in sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0])):
        t = t.detach().contiguous()
        raw = (t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t).numpy().tobytes()
        header[name] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys {keys}"
    return dict(pairs)


def read_safetensors(path):
    """A strict reader: returns ({name: torch tensor}, metadata)."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0, f"header length {n} is not a multiple of 8"
    text = data[8:8 + n].decode("utf-8")
    assert text.startswith("{"), "header must start with '{'"
    header = json.loads(text, object_pairs_hook=no_duplicates)
    metadata = header.pop("__metadata__", {})
    buffer = data[8 + n:]
    expected, tensors = 0, {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        assert set(info) == {"dtype", "shape", "data_offsets"}, info
        begin, end = info["data_offsets"]
        dtype = np.dtype(ST_TO_NUMPY[info["dtype"]])
        assert begin == expected, f"{name}: begins at {begin}, expected {expected}"
        assert begin % dtype.itemsize == 0, f"{name}: offset {begin} not aligned to {dtype.itemsize}"
        assert end - begin == int(np.prod(info["shape"], dtype=np.int64)) * dtype.itemsize, name
        tensors[name] = torch.from_numpy(np.frombuffer(buffer[begin:end], dtype=dtype).reshape(info["shape"]).copy())
        expected = end
    assert expected == len(buffer), f"{len(buffer) - expected} bytes after the last tensor"
    return tensors, metadata


def randomise(module):
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-0.5, 0.5)


def write(out):
    torch.manual_seed(0)
    save = lambda name, array: np.save(out / name, np.asarray(array))

    packed = torch.nn.MultiheadAttention(16, 4, add_bias_kv=True, batch_first=True)
    randomise(packed)
    packed.eval()
    q, k, v = torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    out_, weights = packed(q, k, v, need_weights=True)
    write_safetensors(out / "packed.safetensors", packed.state_dict(), {"format": "pt"})
    for name, t in [("q", q), ("k", k), ("v", v), ("out", out_), ("weights", weights)]:
        save(f"packed_{name}.npy", t.detach().numpy())

    separate = torch.nn.MultiheadAttention(12, 3, bias=False, kdim=5, vdim=7)  # sequence first
    randomise(separate)
    separate.eval()
    q, k, v = torch.randn(5, 2, 12), torch.randn(7, 2, 5), torch.randn(7, 2, 7)
    out_, _ = separate(q, k, v)
    write_safetensors(out / "separate.safetensors", separate.state_dict())
    for name, t in [("q", q), ("k", k), ("v", v), ("out", out_)]:
        save(f"separate_{name}.npy", t.detach().numpy())

    x = torch.tensor([0.0, -0.0, 1.0, -2.0, 1 / 3, 65504.0, 7e4, 6e-8, 1e-40, 3e38, float("inf"), -float("inf"),
                      float("nan"), 3.14159, -1e-5])
    write_safetensors(out / "halves.safetensors", {"f16": x.half(), "bf16": x.bfloat16()})
    save("f16_as_f32.npy", x.half().float().numpy())
    save("bf16_as_f32.npy", x.bfloat16().float().numpy())

    a64 = np.arange(24, dtype=np.float64).reshape(2, 3, 4) * 0.25 - 1
    a32 = a64.astype(np.float32)
    variants = {
        "fortran_f8": np.asfortranarray(a64),
        "bool": np.array([[True, False, True], [False, False, True]]),
        "scalar_f8": np.array(3.75),
        "empty_f4": np.zeros((0, 3), np.float32),
    }
    for name, array in variants.items():
        save(f"{name}.npy", array)
        save(f"{name}_expected.npy", np.array(array, order="C"))  # ascontiguousarray makes 0-d 1-d
    for version in (2, 3):
        with open(out / f"v{version}_f4.npy", "wb") as f:
            np.lib.format.write_array(f, a32, version=(version, 0))
        save(f"v{version}_f4_expected.npy", a32)
    f2 = np.array([1, -2, 0.5, 65504, 6e-8, np.inf, -0.0], dtype=np.float16)
    save("f2.npy", f2)
    save("f2_expected.npy", f2.astype(np.float32))


def check(out):
    state, md = read_safetensors(out / "layer.safetensors")
    assert md["format"] == "mha", md
    flag = lambda key: {"true": True, "false": False}[md[key]]
    assert md["dtype"] == "float32" and md["d_k"] == md["d_v"] == str(int(md["d_model"]) // int(md["num_heads"])), md
    layer = torch.nn.MultiheadAttention(int(md["d_model"]), int(md["num_heads"]), dropout=float(md["dropout"]),
                                        bias=flag("bias"), add_bias_kv=flag("add_bias_kv"),
                                        add_zero_attn=flag("add_zero_attn"), kdim=int(md["kdim"]),
                                        vdim=int(md["vdim"]), batch_first=flag("batch_first"))
    layer.load_state_dict(state, strict=True)
    layer.eval()
    load = lambda name: torch.from_numpy(np.load(out / f"{name}.npy"))
    out_, weights = layer(load("q"), load("k"), load("v"), need_weights=True)
    np.testing.assert_allclose(out_.detach().numpy(), load("out").numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(weights.detach().numpy(), load("weights").numpy(), atol=1e-6, rtol=1e-5)

    for dtype in ("float32", "float64", "bool"):
        for i, shape in enumerate(SHAPES):
            path = out / f"arange_{dtype}_{i}.npy"
            raw = path.read_bytes()
            assert raw[:8] == b"\x93NUMPY\x01\x00", raw[:8]
            a = np.load(path)
            j = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape)
            expected = (j % 3 == 0) if dtype == "bool" else (j * 0.5 - 1).astype(dtype)
            assert a.dtype == np.dtype(dtype) and a.shape == shape and a.flags.c_contiguous, (path, a.dtype, a.shape)
            np.testing.assert_array_equal(a, expected, err_msg=str(path))


if __name__ == "__main__":
    mode, directory = sys.argv[1], Path(sys.argv[2])
    {"write": write, "check": check}[mode](directory)
