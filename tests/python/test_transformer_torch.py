"""The Transformer example's blocks (examples/transformer) against torch autograd, in float64.

`build/transformer_dump_blocks OUT_DIR` (tests/transformer/torch/dump_blocks.cpp) runs each block
forward and backward in float64 on fixed random inputs and parameters and writes one safetensors file
per case: the parameters (param.<name>), the inputs (input.<name>; token ids and key lengths as
float64 values), the output (out), the gradient given to the backward (dout), and the block's
gradients of every parameter (grad.<name>) and differentiable input (grad_input.<name>). Here each
case is rebuilt from torch primitives, written independently of the C++ code: F.linear, F.layer_norm,
F.relu, F.embedding, nn.MultiheadAttention (batch_first, float64, its state_dict loaded from the dump,
so the parameter names must be PyTorch's), the post-norm LN(x + F(x)) / pre-norm x + F(LN(x))
wiring, the sinusoidal positional encoding of "Attention Is All You Need" section 3.5, and
F.cross_entropy(..., label_smoothing=0.1). Autograd, given the same dout, yields the reference
gradients.

Tolerance: every output and gradient must agree within 1e-10 * max(1, max|torch value|), per tensor.
Both sides compute in float64 (unit roundoff 1.1e-16) the same functions in a different order of
operations, on tensors of at most a few hundred entries with values of order 1 and models at most
4 layers deep; the rounding differences that accumulate (sums of ~10-100 terms per dot product, a few
dozen operations in sequence, amplified by LayerNorm's 1/std and softmax's Jacobian by at most ~10-100)
stay below ~1e-13. Observed differences are ~1e-15. A wrong gradient (a sign, a missing term, a
transposed matrix, a wrong scale) is off by 1e-3 or far more, so 1e-10 separates the two by orders
of magnitude. The floor of 1 keeps a tensor whose entries are all tiny from demanding more than
absolute 1e-10.
"""
import math
import pathlib
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha

DUMP = pathlib.Path(__file__).resolve().parents[2] / "build" / "transformer_dump_blocks"
TOLERANCE = 1e-10

# Fixed here, so that a case the program stops writing fails instead of vanishing.
CASES = [
    "linear",
    "layer_norm",
    "feed_forward",
    "embedding",
    "attention_self",
    "attention_self_causal",
    "attention_self_key_lengths",
    "attention_self_causal_key_lengths",
    "attention_cross_key_lengths",
    "residual_ffn_post_norm",
    "residual_ffn_pre_norm",
    "encoder_layer_post_norm",
    "encoder_layer_pre_norm",
    "decoder_layer_post_norm",
    "decoder_layer_pre_norm",
    "label_smoothed_cross_entropy",
    "transformer_post_norm",
    "transformer_pre_norm",
]


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    if not DUMP.exists():
        pytest.skip(f"{DUMP} is not built (cmake --build build --target transformer_dump_blocks)")
    out = tmp_path_factory.mktemp("transformer_blocks")
    subprocess.run([str(DUMP), str(out)], check=True, timeout=300)
    return out


class Params:
    """The dump's parameters as torch leaves, created on first use; remembers which were used."""

    def __init__(self, tensors):
        self.values = {k[len("param."):]: v for k, v in tensors.items() if k.startswith("param.")}
        self.leaves = {}

    def __call__(self, name):
        if name not in self.leaves:
            self.leaves[name] = torch.tensor(np.array(self.values[name]), dtype=torch.float64, requires_grad=True)
        return self.leaves[name]

    def module(self, module, prefix):
        """Loads module's state_dict strictly from the parameters named prefix + its names, and takes
        the module's parameters as the leaves of those names."""
        module.load_state_dict({k: torch.tensor(np.array(self.values[prefix + k])) for k in module.state_dict()})
        for k, p in module.named_parameters():
            assert prefix + k not in self.leaves, f"{prefix + k} used twice"
            self.leaves[prefix + k] = p
        return module


def tensor(a, requires_grad=False):
    return torch.tensor(np.array(a), dtype=torch.float64, requires_grad=requires_grad)


def integers(a):
    a = np.array(a)
    assert np.all(a == np.round(a)), "ids and lengths are integers stored as float64"
    return torch.tensor(a.astype(np.int64))


# ---- the blocks, from torch primitives ------------------------------------------------------------

def linear(P, name, x):
    return F.linear(x, P(name + ".weight"), P(name + ".bias"))


def layer_norm(P, name, x):
    return F.layer_norm(x, (x.shape[-1],), P(name + ".weight"), P(name + ".bias"), eps=1e-5)


def feed_forward(P, name, x):
    return linear(P, name + ".linear2", F.relu(linear(P, name + ".linear1", x)))


def residual(P, norm, x, sublayer, pre_norm):
    """Post-norm LN(x + F(x)) (the paper) or pre-norm x + F(LN(x))."""
    if pre_norm:
        return x + sublayer(layer_norm(P, norm, x))
    return layer_norm(P, norm, x + sublayer(x))


def attention(P, prefix, query, key_value, B, heads, key_lengths=None, causal=False):
    """query [B*L, E], key_value [B*S, E] -> [B*L, E] through nn.MultiheadAttention (batch_first).
    Keys at positions >= key_lengths[b] are masked; causal: query i sees keys j <= i."""
    E = query.shape[-1]
    L, S = query.shape[0] // B, key_value.shape[0] // B
    layer = P.module(torch.nn.MultiheadAttention(E, heads, batch_first=True, dtype=torch.float64), prefix)
    padding = None
    if key_lengths is not None:
        assert bool((key_lengths >= 1).all()), "a query row with every key masked is NaN in torch"
        padding = torch.arange(S)[None, :] >= key_lengths[:, None]  # [B, S], True = masked
    mask = torch.ones(L, S, dtype=torch.bool).triu(1) if causal else None  # [L, S], True = masked
    kv = key_value.reshape(B, S, E)
    out, _ = layer(query.reshape(B, L, E), kv, kv, key_padding_mask=padding, attn_mask=mask, need_weights=False)
    return out.reshape(B * L, E)


def encoder_layer(P, prefix, x, B, lengths, heads, pre_norm):
    y = residual(P, prefix + ".norm1", x,
                 lambda u: attention(P, prefix + ".self_attn.", u, u, B, heads, lengths), pre_norm)
    return residual(P, prefix + ".norm2", y, lambda u: feed_forward(P, prefix + ".ffn", u), pre_norm)


def decoder_layer(P, prefix, x, memory, B, lengths, heads, pre_norm):
    y = residual(P, prefix + ".norm1", x,
                 lambda u: attention(P, prefix + ".self_attn.", u, u, B, heads, causal=True), pre_norm)
    y = residual(P, prefix + ".norm2", y,
                 lambda u: attention(P, prefix + ".cross_attn.", u, memory, B, heads, lengths), pre_norm)
    return residual(P, prefix + ".norm3", y, lambda u: feed_forward(P, prefix + ".ffn", u), pre_norm)


def positional_encoding(positions, d):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)): [positions, d]."""
    pos = torch.arange(positions, dtype=torch.float64)[:, None]
    two_i = torch.arange(0, d, 2, dtype=torch.float64)
    angle = pos / torch.pow(torch.tensor(10000.0, dtype=torch.float64), two_i / d)
    pe = torch.zeros(positions, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)[:, : d // 2]
    return pe


def embed(table, ids, positions):
    """ids [B, P] -> E[ids] * sqrt(d) + PE, [B*P, d]."""
    d = table.shape[1]
    x = F.embedding(ids, table) * math.sqrt(d) + positional_encoding(positions, d)[None]
    return x.reshape(-1, d)


# ---- each case: (outputs by dump name, differentiable inputs by name) -----------------------------

def flag(meta, key):
    return meta[key] == "true"


def build(tensors, meta, P):
    block = meta["block"]
    inputs = {}

    def leaf(name):
        inputs[name] = tensor(tensors["input." + name], requires_grad=True)
        return inputs[name]

    if block == "linear":
        return {"out": linear(P, "linear", leaf("x"))}, inputs
    if block == "layer_norm":
        return {"out": layer_norm(P, "norm", leaf("x"))}, inputs
    if block == "feed_forward":
        return {"out": feed_forward(P, "ffn", leaf("x"))}, inputs
    if block == "embedding":
        table = P("embedding.weight")
        ids = integers(tensors["input.ids"])
        embedded = F.embedding(ids, table) * math.sqrt(int(meta["d_model"]))
        return {"out.embed": embedded, "out.logits": F.linear(leaf("h"), table)}, inputs
    if block in ("self_attention", "cross_attention"):
        B, heads, causal = int(meta["B"]), int(meta["heads"]), flag(meta, "causal")
        lengths = integers(tensors["input.key_lengths"]) if "input.key_lengths" in tensors else None
        if block == "self_attention":
            x = leaf("x")
            out = attention(P, "attn.", x, x, B, heads, lengths, causal)
        else:
            out = attention(P, "attn.", leaf("query"), leaf("key_value"), B, heads, lengths, causal)
        return {"out": out}, inputs
    if block == "residual_ffn":
        out = residual(P, "norm", leaf("x"), lambda u: feed_forward(P, "ffn", u), flag(meta, "pre_norm"))
        return {"out": out}, inputs
    if block == "encoder_layer":
        out = encoder_layer(P, meta["prefix"], leaf("x"), int(meta["B"]), integers(tensors["input.key_lengths"]),
                            int(meta["heads"]), flag(meta, "pre_norm"))
        return {"out": out}, inputs
    if block == "decoder_layer":
        out = decoder_layer(P, meta["prefix"], leaf("x"), leaf("memory"), int(meta["B"]),
                            integers(tensors["input.key_lengths"]), int(meta["heads"]), flag(meta, "pre_norm"))
        return {"out": out}, inputs
    if block == "label_smoothed_cross_entropy":
        loss = F.cross_entropy(leaf("logits"), integers(tensors["input.targets"]),
                               label_smoothing=float(meta["smoothing"]))
        return {"out": loss.reshape(1)}, inputs
    if block == "transformer":
        return transformer(tensors, meta, P), inputs
    raise AssertionError(f"unknown block {block!r}")


def transformer(tensors, meta, P):
    """source -> encoder stack (-> encoder.norm) = memory; target -> decoder stack (-> decoder.norm)
    -> h E^T = logits; loss = label-smoothed cross-entropy against input.targets."""
    B, S, T = int(meta["B"]), int(meta["S"]), int(meta["T"])
    heads, pre_norm = int(meta["heads"]), flag(meta, "pre_norm")
    lengths = integers(tensors["input.source_lengths"])
    table = P("embedding.weight")
    x = embed(table, integers(tensors["input.source"]).reshape(B, S), S)
    for i in range(int(meta["encoder_layers"])):
        x = encoder_layer(P, f"encoder.{i}", x, B, lengths, heads, pre_norm)
    memory = layer_norm(P, "encoder.norm", x) if pre_norm else x
    y = embed(table, integers(tensors["input.target"]).reshape(B, T), T)
    for i in range(int(meta["decoder_layers"])):
        y = decoder_layer(P, f"decoder.{i}", y, memory, B, lengths, heads, pre_norm)
    if pre_norm:
        y = layer_norm(P, "decoder.norm", y)
    logits = F.linear(y, table)
    loss = F.cross_entropy(logits, integers(tensors["input.targets"]), label_smoothing=float(meta["smoothing"]))
    return {"logits": logits, "out": loss.reshape(1)}


# ---- the test -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_block_matches_torch_autograd(dump_dir, case):
    path = dump_dir / f"{case}.safetensors"
    assert path.exists(), f"transformer_dump_blocks wrote no {path.name}"
    tensors, meta = mha.read_safetensors(str(path))
    assert meta["case"] == case
    P = Params(tensors)
    outputs, inputs = build(tensors, meta, P)

    # Backward with the dump's dout for each output that has one (out -> dout, out.embed -> dout.embed).
    pairs = [(out, tensor(tensors["d" + name])) for name, out in outputs.items() if "d" + name in tensors]
    assert pairs, f"{case}: no dout in the dump"
    torch.autograd.backward([o for o, _ in pairs], [d for _, d in pairs])

    # Every parameter of the dump was used by the torch model, and nothing else.
    assert set(P.leaves) == set(P.values), (
        f"{case}: torch used {sorted(set(P.leaves) - set(P.values))}, "
        f"left unused {sorted(set(P.values) - set(P.leaves))}")
    assert {k[len("grad."):] for k in tensors if k.startswith("grad.")} == set(P.values)
    assert {k[len("grad_input."):] for k in tensors if k.startswith("grad_input.")} == set(inputs)

    compared = []
    for name, out in outputs.items():
        compared.append((name, tensors[name], out))
    for name, p in P.leaves.items():
        assert p.grad is not None, f"{case}: torch gives {name} no gradient"
        compared.append(("grad." + name, tensors["grad." + name], p.grad))
    for name, x in inputs.items():
        compared.append(("grad_input." + name, tensors["grad_input." + name], x.grad))

    failures = []
    for name, ours, theirs in compared:
        theirs = theirs.detach().numpy()
        assert ours.shape == theirs.shape, f"{case}: {name}: shape {ours.shape} vs torch {theirs.shape}"
        assert np.all(np.isfinite(theirs)), f"{case}: {name}: torch gives non-finite values"
        scale = max(1.0, float(np.abs(theirs).max(initial=0.0)))
        error = float(np.abs(ours - theirs).max(initial=0.0))
        if not error <= TOLERANCE * scale:
            failures.append(f"{name}: max |ours - torch| = {error:.3e}, allowed {TOLERANCE * scale:.3e}")
    assert not failures, f"{case}: " + "; ".join(failures)
