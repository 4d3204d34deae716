"""`mha run`: a PyTorch layer saved as safetensors and inputs saved as .npy, run by the command, compared
with PyTorch under the project's rule: max|ours - torch64| <= 2 * max|torch32 - torch64| + 1e-6."""
import pathlib
import re
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

import mha

ROOT = pathlib.Path(__file__).resolve().parents[2]
MHA = ROOT / "build" / "mha"
sys.path.insert(0, str(ROOT / "tests" / "data"))
from torch_interop import write_safetensors  # noqa: E402  (the by-hand safetensors writer)

pytestmark = pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built")


def run(*args):
    return subprocess.run([str(MHA), "run", *map(str, args)], capture_output=True, text=True)


def within_rule(ours, t32, t64):
    ours, t32, t64 = (np.asarray(x, np.float64) for x in (ours, t32, t64))
    return np.abs(ours - t64).max() <= 2 * np.abs(t32 - t64).max() + 1e-6


CASES = [  # (batch_first, kdim, add_bias_kv, causal, with key padding, with float mask, per-head weights)
    (True, None, False, False, False, False, False),
    (False, None, True, True, False, False, True),
    (True, 6, False, False, True, False, False),
    (False, 6, False, False, True, True, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "bf{}-kdim{}-biaskv{}-causal{}-kpm{}-float{}-heads{}".format(*c))
def test_mha_run_matches_torch(tmp_path, case):
    batch_first, kdim, bias_kv, causal, with_kpm, with_float_mask, per_head = case
    torch.manual_seed(zlib.crc32(repr(case).encode()) % 1000)  # not hash(): str hashes change from run to run
    E, h, B, L, S = 8, 2, 3, 5, 7
    layer = torch.nn.MultiheadAttention(E, h, kdim=kdim, vdim=kdim, add_bias_kv=bias_kv, batch_first=batch_first).eval()
    write_safetensors(tmp_path / "layer.safetensors", dict(layer.state_dict()))
    rng = np.random.default_rng(len(str(case)))
    shape = lambda T, W: (B, T, W) if batch_first else (T, B, W)  # noqa: E731
    q = rng.standard_normal(shape(L, E), dtype=np.float32)
    k = rng.standard_normal(shape(S, kdim or E), dtype=np.float32)
    v = rng.standard_normal(shape(S, kdim or E), dtype=np.float32)
    np.save(tmp_path / "q.npy", q), np.save(tmp_path / "k.npy", k), np.save(tmp_path / "v.npy", v)
    args = ["--weights", tmp_path / "layer.safetensors", "--heads", h, "--query", tmp_path / "q.npy",
            "--key", tmp_path / "k.npy", "--value", tmp_path / "v.npy", "--out", tmp_path / "out.npy",
            "--weights-out", tmp_path / "w.npy", "--layout", "batch-first" if batch_first else "seq-first",
            "--threads", 2]
    mask = None
    if causal:  # bottom-right aligned: query i sees key j <= i + S - L
        mask = np.triu(np.ones((L, S), bool), k=S - L + 1)
        args.append("--causal")
    if with_float_mask:
        mask = rng.standard_normal((L, S)).astype(np.float32)
        np.save(tmp_path / "mask.npy", mask)
        args += ["--attn-mask", tmp_path / "mask.npy"]
    kpm = None
    if with_kpm:
        kpm = np.zeros((B, S), bool)
        kpm[:, -2:] = True
        np.save(tmp_path / "kpm.npy", kpm)
        args += ["--key-padding-mask", tmp_path / "kpm.npy"]
    if per_head:
        args.append("--per-head-weights")
    result = run(*args)
    assert result.returncode == 0, result.stderr

    def torch_run(dtype):
        m = layer.to(dtype)
        t = lambda a: None if a is None else torch.from_numpy(a).to(dtype) if a.dtype != bool else torch.from_numpy(a)  # noqa: E731
        with torch.no_grad():
            out, w = m(t(q), t(k), t(v), key_padding_mask=t(kpm), attn_mask=t(mask), need_weights=True,
                       average_attn_weights=not per_head)
        return out.double().numpy(), w.double().numpy()

    out64, w64 = torch_run(torch.float64)
    out32, w32 = torch_run(torch.float32)
    assert within_rule(np.load(tmp_path / "out.npy"), out32, out64)
    assert within_rule(np.load(tmp_path / "w.npy"), w32, w64)


def test_mha_run_errors_name_the_flag_and_the_file(tmp_path):
    np.save(tmp_path / "q.npy", np.ones((2, 3, 8), np.float32))
    missing = tmp_path / "nope.safetensors"
    result = run("--weights", missing, "--heads", 2, "--query", tmp_path / "q.npy", "--out", tmp_path / "o.npy")
    assert result.returncode == 1 and "--weights" in result.stderr and str(missing) in result.stderr
    layer = torch.nn.MultiheadAttention(8, 2)
    write_safetensors(tmp_path / "layer.safetensors", dict(layer.state_dict()))
    (tmp_path / "bad.npy").write_bytes(b"not an npy file at all")
    result = run("--weights", tmp_path / "layer.safetensors", "--heads", 2, "--layout", "seq-first",
                 "--query", tmp_path / "bad.npy", "--out", tmp_path / "o.npy")
    assert result.returncode == 1 and "--query" in result.stderr and "bad.npy" in result.stderr
    result = run("--weights", tmp_path / "layer.safetensors", "--query", tmp_path / "q.npy", "--out", tmp_path / "o.npy")
    assert result.returncode == 1 and "--heads" in result.stderr  # no metadata: the heads must be given
    result = run("--weights", tmp_path / "layer.safetensors", "--heads", 2, "--out", tmp_path / "o.npy")
    assert result.returncode == 2  # --query is required: a usage error


def test_mha_run_needs_the_layout_of_a_file_without_metadata(tmp_path):
    """PyTorch's state_dict carries no layout, and PyTorch's default (seq-first) is not ours: no guessing."""
    layer = torch.nn.MultiheadAttention(8, 2)
    write_safetensors(tmp_path / "layer.safetensors", dict(layer.state_dict()))
    np.save(tmp_path / "q.npy", np.ones((3, 2, 8), np.float32))
    result = run("--weights", tmp_path / "layer.safetensors", "--heads", 2, "--query", tmp_path / "q.npy",
                 "--out", tmp_path / "o.npy")
    assert result.returncode == 1 and "--layout" in result.stderr and "seq-first" in result.stderr
    assert not (tmp_path / "o.npy").exists()


@pytest.mark.parametrize("flags, complaint", [(["--heads", "4"], "--heads 4: the file's metadata says 2 heads"),
                                              (["--layout", "seq-first"], "--layout seq-first: the file's metadata"),
                                              (["--add-zero-attn"], "--add-zero-attn")])
def test_mha_run_refuses_flags_that_contradict_the_metadata(tmp_path, flags, complaint):
    mha.MultiheadAttention(8, 2, batch_first=True, seed=1).save(tmp_path / "layer.safetensors")
    np.save(tmp_path / "q.npy", np.ones((2, 3, 8), np.float32))
    args = ["--weights", tmp_path / "layer.safetensors", "--query", tmp_path / "q.npy", "--out", tmp_path / "o.npy"]
    result = run(*args, *flags)
    assert result.returncode == 1 and complaint in result.stderr, result.stderr
    agreeing = run(*args, "--heads", 2, "--layout", "batch-first")
    assert agreeing.returncode == 0, agreeing.stderr


def test_mha_run_says_what_a_file_of_the_wrong_kind_appears_to_be(tmp_path):
    """Not "header length 5088219219985302144": what the file looks like, and what was expected (issue 15)."""
    mha.MultiheadAttention(8, 2, batch_first=True, seed=1).save(tmp_path / "layer.safetensors")
    np.save(tmp_path / "q.npy", np.ones((2, 3, 8), np.float32))
    torch.save({"w": torch.ones(2)}, tmp_path / "zip.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    mha.write_safetensors(tmp_path / "model.safetensors", {"encoder.0.w": np.ones(2, np.float32)},
                          metadata={"format": "mha-transformer-dates"})
    cases = [
        (["--weights", tmp_path / "q.npy"], "appears to be a NumPy .npy file"),
        (["--weights", tmp_path / "zip.pt"], "appears to be a zip archive (PyTorch's torch.save"),
        (["--weights", tmp_path / "legacy.pt"], "appears to be a Python pickle"),
        (["--weights", tmp_path / "model.safetensors"], "'mha-transformer-dates', not one attention layer"),
    ]
    for weights, complaint in cases:
        result = run(*weights, "--query", tmp_path / "q.npy", "--out", tmp_path / "o.npy")
        assert result.returncode == 1 and complaint in result.stderr, result.stderr
        assert "safetensors" in result.stderr and not re.search(r"\d{12}", result.stderr), result.stderr
    result = run("--weights", tmp_path / "layer.safetensors", "--query", tmp_path / "layer.safetensors",
                 "--out", tmp_path / "o.npy")
    assert result.returncode == 1 and "not a .npy file" in result.stderr
    assert "appears to be a safetensors file" in result.stderr


def test_mha_run_takes_inputs_in_the_layers_dtype_only(tmp_path):
    """One policy with the Python API: no silent rounding of float64 inputs to a float32 layer, no silent
    widening; a float16 .npy is read as float32, exactly, as every reader of the library reads it."""
    mha.MultiheadAttention(8, 2, batch_first=True, seed=1).save(tmp_path / "f32.safetensors")
    mha.MultiheadAttention(8, 2, batch_first=True, seed=1, dtype=np.float64).save(tmp_path / "f64.safetensors")
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float16)
    for dtype in (np.float16, np.float32, np.float64):
        np.save(tmp_path / f"{np.dtype(dtype).name}.npy", x.astype(dtype))

    def run_on(layer, query):
        return run("--weights", tmp_path / layer, "--query", tmp_path / query, "--out", tmp_path / "o.npy")

    result = run_on("f32.safetensors", "float64.npy")
    assert result.returncode == 1 and "expected float32 values (the layer's dtype), got float64" in result.stderr
    result = run_on("f64.safetensors", "float32.npy")
    assert result.returncode == 1 and "expected float64 values (the layer's dtype), got float32" in result.stderr
    assert run_on("f32.safetensors", "float32.npy").returncode == 0
    from_f32 = np.load(tmp_path / "o.npy")
    assert run_on("f32.safetensors", "float16.npy").returncode == 0
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), from_f32)  # the same float32 values


def test_mha_run_feeds_a_bfloat16_layer_float_inputs_rounded(tmp_path):
    """A bfloat16 layer (saved as BF16) takes float32 or float64 .npy inputs (NumPy has no bfloat16),
    rounded to nearest even as the Python API's bfloat16 layer rounds them, and writes float32: the
    same numbers as that layer's forward, bit for bit."""
    layer = mha.MultiheadAttention(16, 4, batch_first=True, seed=3, dtype="bfloat16")
    layer.save(tmp_path / "bf16.safetensors")
    x = np.random.default_rng(1).standard_normal((2, 5, 16))
    np.save(tmp_path / "x64.npy", x)
    np.save(tmp_path / "x32.npy", x.astype(np.float32))
    layer.eval()
    for name, array in (("x64.npy", x), ("x32.npy", x.astype(np.float32))):
        result = run("--weights", tmp_path / "bf16.safetensors", "--query", tmp_path / name, "--out", tmp_path / "o.npy")
        assert result.returncode == 0, result.stderr
        out = np.load(tmp_path / "o.npy")
        assert out.dtype == np.float32
        want, _ = layer(array, array, array)
        np.testing.assert_array_equal(out, want)
