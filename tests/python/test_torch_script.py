"""TorchScript and libtorch through mha's registered operator (python/torch_ops, docs/TORCH.md).

A small model, an encoder layer whose self-attention is mha.torch.scaled_dot_product_attention (causal)
followed by a module calling it with grouped heads, a window and learned sinks, is scripted and traced;
its outputs must equal eager mode's bit for bit. Saved with torch.jit.save, it is loaded in a fresh
Python process (after `import mha.torch`) and in the C++ program examples/libtorch/main.cpp (libtorch and
mha_torch_ops only): outputs and input gradients again bitwise equal to eager mode's.

Legend: N batch, L sequence, E model width, h query heads, h_kv key/value heads, d head width.
"""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

mha_torch = pytest.importorskip("mha.torch")
import mha._torch_sdpa as torch_sdpa  # noqa: E402

pytestmark = pytest.mark.skipif(not torch_sdpa.OPERATORS_LOADED,
                                reason="the operator library (libmha_torch_ops.so) was not built")

PACKAGE_PARENT = pathlib.Path(mha_torch.__file__).resolve().parents[1]  # build/python in a build tree
BUILD_TREE = PACKAGE_PARENT.parent
EXAMPLE = BUILD_TREE / "examples" / "libtorch" / "mha_libtorch_example"


class EncoderLayer(torch.nn.Module):
    """Post-norm Transformer encoder layer (as torch.nn.TransformerEncoderLayer) on mha's function."""

    def __init__(self, E: int = 16, h: int = 4, ff: int = 32, dropout: float = 0.1):
        super().__init__()
        self.h = h
        self.dropout = dropout
        self.qkv = torch.nn.Linear(E, 3 * E)
        self.out = torch.nn.Linear(E, E)
        self.ff1, self.ff2 = torch.nn.Linear(E, ff), torch.nn.Linear(ff, E)
        self.norm1, self.norm2 = torch.nn.LayerNorm(E), torch.nn.LayerNorm(E)

    def forward(self, x):  # x: (N, L, E)
        N, L, E = x.shape
        qkv = self.qkv(x).view(N, L, 3, self.h, E // self.h).permute(2, 0, 3, 1, 4)  # (3, N, h, L, d), strided
        p = self.dropout if self.training else 0.0
        a = mha_torch.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], dropout_p=p, is_causal=True)
        x = self.norm1(x + self.out(a.transpose(1, 2).reshape(N, L, E)))
        return self.norm2(x + self.ff2(torch.relu(self.ff1(x))))


class GroupedSinkAttention(torch.nn.Module):
    """The function with keywords: h = 4 query heads on h_kv = 2, a window and learned sinks."""

    def __init__(self, E: int = 16):
        super().__init__()
        self.q = torch.nn.Linear(E, E)
        self.kv = torch.nn.Linear(E, E)  # 2 key heads + 2 value heads of width 4
        self.sinks = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4))

    def forward(self, x):  # x: (N, L, E)
        N, L, E = x.shape
        q = self.q(x).view(N, L, 4, 4).transpose(1, 2)  # (N, 4, L, 4)
        kv = self.kv(x).view(N, L, 2, 2, 4).permute(2, 0, 3, 1, 4)  # (2, N, 2, L, 4)
        a = mha_torch.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True, window=[3, 0], sinks=self.sinks)
        return a.transpose(1, 2).reshape(N, L, E)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = EncoderLayer()
        self.attention = GroupedSinkAttention()

    def forward(self, x):
        return self.attention(self.layer(x))


class Inputs(torch.nn.Module):
    """Holds the input for the C++ program: a saved scripted module is a file libtorch 1.13 can read."""

    def __init__(self, x):
        super().__init__()
        self.register_buffer("x", x)

    def forward(self):
        return self.x


def model_and_input():
    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(2, 7, 16)
    return model, x


def output_and_gradients(module, x):
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    out.sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("compile", ["script", "trace"])
def test_scripted_and_traced_models_equal_eager_bitwise(compile):
    model, x = model_and_input()
    compiled = torch.jit.script(model) if compile == "script" else torch.jit.trace(model, x)
    assert "mha::scaled_dot_product_attention" in str(compiled.inlined_graph)
    eager = output_and_gradients(model, x)
    model.zero_grad()
    got = output_and_gradients(compiled, x)
    assert_bitwise(got[0], eager[0])
    assert_bitwise(got[1], eager[1])
    for a, b in zip(got[2], eager[2]):  # the parameters' gradients, the sinks' among them
        assert_bitwise(a, b)


def test_scripted_training_dropout_repeats_eager_under_manual_seed():
    model, x = model_and_input()
    model.train()
    scripted = torch.jit.script(model)
    torch.manual_seed(7)
    eager = model(x)
    torch.manual_seed(7)
    assert_bitwise(scripted(x), eager)


def _saved(tmp_path):
    model, x = model_and_input()
    path = tmp_path / "model.pt"
    torch.jit.script(model).save(str(path))
    return model, x, path


def test_saved_model_loads_in_a_fresh_process_after_import_mha_torch(tmp_path):
    model, x, path = _saved(tmp_path)
    torch.save(x, tmp_path / "x.pt")
    script = ("import sys, torch, mha.torch\n"
              "m = torch.jit.load(sys.argv[1])\n"
              "x = torch.load(sys.argv[2]).requires_grad_(True)\n"
              "out = m(x); out.sum().backward()\n"
              "torch.save((out.detach(), x.grad), sys.argv[3])\n")
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT))
    subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
                   check=True, env=env, timeout=120)
    out, grad = torch.load(tmp_path / "out.pt")
    expected_out, expected_grad, _ = output_and_gradients(model, x)
    assert_bitwise(out, expected_out)
    assert_bitwise(grad, expected_grad)


def test_libtorch_program_runs_the_saved_model_bitwise_as_python(tmp_path):
    if not (BUILD_TREE / "CMakeCache.txt").exists():
        pytest.skip("mha.torch is not in a CMake build tree: no examples/libtorch program to run")
    assert EXAMPLE.exists(), f"{EXAMPLE} was not built (CMake builds it with the operator library)"
    model, x, path = _saved(tmp_path)
    torch.jit.script(Inputs(x)).save(str(tmp_path / "inputs.pt"))
    result = subprocess.run([str(EXAMPLE), str(path), str(tmp_path / "inputs.pt"), str(tmp_path / "out.bin")],
                            check=True, capture_output=True, text=True, timeout=120)
    assert "mha_libtorch_example: out [2, 7, 16] Float, grad [2, 7, 16]" in result.stdout
    raw = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32)
    expected_out, expected_grad, _ = output_and_gradients(model, x)
    assert raw.numel() == 2 * x.numel()
    assert_bitwise(raw[:x.numel()].view_as(x), expected_out)
    assert_bitwise(raw[x.numel():].view_as(x), expected_grad)
