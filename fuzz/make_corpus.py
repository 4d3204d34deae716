"""Writes the seed corpus of the fuzzers (fuzz/corpus/*): valid files of every kind the readers take,
and a few near-valid ones. Run once with /usr/bin/python3 (needs numpy); the output is committed."""
import json
import struct
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def safetensors(tensors, metadata=None, pad=True):
    header, blobs, offset = ({"__metadata__": metadata} if metadata else {}), [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def main():
    st = HERE / "corpus" / "safetensors"
    f = lambda a, t: a.astype(t).tobytes()
    a = np.arange(6, dtype=np.float64).reshape(2, 3) - 2.5
    seeds = {
        "f32.safetensors": safetensors({"w": ("F32", (2, 3), f(a, "<f4"))}),
        "f64_metadata.safetensors": safetensors({"w": ("F64", (2, 3), f(a, "<f8"))}, {"format": "mha", "k": "v"}),
        "f16_bf16.safetensors": safetensors({"h": ("F16", (3,), f(np.array([1, -2, 65504.0]), "<f2")),
                                             "b": ("BF16", (2,), b"\x80\x3f\xc0\x7f")}),
        "bool_scalar_empty.safetensors": safetensors({"b": ("BOOL", (3,), b"\x01\x00\x01"),
                                                      "s": ("F32", (), f(np.array(7.0), "<f4")),
                                                      "e": ("F64", (0, 4), b"")}),
        "metadata_only.safetensors": safetensors({}, {"a": "b"}),
        "unpadded.safetensors": safetensors({"w": ("F32", (1,), f(np.array([1.0]), "<f4"))}, pad=False),
        "near_bad_offsets.safetensors": safetensors({"w": ("F32", (2,), f(np.array([1.0, 2.0]), "<f4"))})[:-1],
        "near_unknown_dtype.safetensors": safetensors({"w": ("I8", (2,), b"\x01\x02")}),
    }
    for name, data in seeds.items():
        (st / name).write_bytes(data)

    npy = HERE / "corpus" / "npy"
    arrays = {
        "f4.npy": (a.astype(np.float32), (1, 0)),
        "f8_fortran.npy": (np.asfortranarray(a), (1, 0)),
        "bool.npy": (a > 0, (1, 0)),
        "f2.npy": (a.astype(np.float16), (1, 0)),
        "scalar.npy": (np.array(3.5), (1, 0)),
        "empty.npy": (np.zeros((0, 3), np.float32), (1, 0)),
        "v2.npy": (a.astype(np.float32), (2, 0)),
        "v3.npy": (a, (3, 0)),
        "near_int.npy": (np.arange(3), (1, 0)),
    }
    for name, (array, version) in arrays.items():
        with open(npy / name, "wb") as out:
            np.lib.format.write_array(out, array, version=version)
    (npy / "near_truncated.npy").write_bytes((npy / "f4.npy").read_bytes()[:-3])


if __name__ == "__main__":
    main()
