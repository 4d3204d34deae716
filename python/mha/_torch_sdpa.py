"""mha.torch.scaled_dot_product_attention: PyTorch 2.5's function on mha's kernels, for torch 1.13.

The function is a thin, TorchScript-compilable call of the registered operator
``torch.ops.mha.scaled_dot_product_attention`` (python/torch_ops: argument checks, masks, autograd, all
in C++), so that a model using it can be scripted, traced, saved and run from C++ libtorch
(examples/libtorch). The operator library, libmha_torch_ops.so, is loaded from beside this file when
it is there (a CMake build with libtorch-dev); without it the function raises a RuntimeError saying so,
and the rest of mha.torch works as before.

Legend: N... leading (batch) dims, h query heads, h_kv key/value heads, L queries, S keys, E query/key
width, E_v value width.
"""

import os
from typing import List, Optional

import torch

__all__ = ["scaled_dot_product_attention", "OPERATORS_LOADED", "OPERATOR_LIBRARY"]

OPERATOR_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libmha_torch_ops.so")

_NOT_BUILT = (
    "mha.torch.scaled_dot_product_attention needs mha's PyTorch operator library (libmha_torch_ops.so), "
    "which was not built beside this package (" + OPERATOR_LIBRARY + "). Build mha with CMake where "
    "libtorch-dev is installed (scripts/install-deps.sh installs it; CMake option MHA_BUILD_TORCH_OPS) and "
    "use build/python on PYTHONPATH. mha.torch.MultiheadAttention works without it.")


def _load_operators():
    """Loads the operator library if it was built here; whether the operators are registered."""
    if hasattr(torch.ops, "mha") and hasattr(torch.ops.mha, "scaled_dot_product_attention"):
        return True  # loaded already (by a C++ host program, or an earlier import)
    if not os.path.exists(OPERATOR_LIBRARY):
        return False
    torch.ops.load_library(OPERATOR_LIBRARY)
    return True


OPERATORS_LOADED = _load_operators()


def _refuse_without_operators():
    if not OPERATORS_LOADED:
        raise RuntimeError(_NOT_BUILT)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                                 *, window: Optional[List[int]] = None, alibi_slopes: Optional[torch.Tensor] = None,
                                 softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    r"""softmax(query key^T * scale + mask) value: ``torch.nn.functional.scaled_dot_product_attention`` of
    PyTorch 2.5, computed by mha's fused kernels (FlashAttention-2 on the CPU: no L x S buffer for
    float32 and bfloat16), with autograd, in eager mode, TorchScript and libtorch.

    Args (PyTorch 2.5's):
        query: (N..., h, L, E); any number of leading dims, or none ((L, E)).
        key: (N..., h_kv, S, E); value: (N..., h_kv, S, E_v). The leading dims broadcast as torch's.
            All three torch.float32, torch.float64 or torch.bfloat16, one dtype, on the CPU, any
            strides (read in place where the leading dims collapse into one without a copy).
        attn_mask: broadcastable to (N..., h, L, S): bool, True = the position takes part (as torch's
            SDPA; unlike nn.MultiheadAttention, where True forbids), or float (query's dtype; float32
            also with bfloat16 query), added to the logits. No gradient: a mask that requires grad is
            refused.
        dropout_p: probability of zeroing a weight, in [0, 1) (applied whenever > 0, as torch's; pass
            0 in evaluation). The mask is keyed by a number drawn from torch's default CPU generator,
            so ``torch.manual_seed`` repeats it; it is not torch's mask.
        is_causal: query i sees key j <= i: torch's top-left alignment, also when L != S (with L < S
            the last S - L keys are seen by no query). Not together with attn_mask (as torch).
        scale: the logits' scale; None is 1 / sqrt(E).
        enable_gqa: grouped-query attention: h_kv divides h and query head i reads key/value head
            i // (h // h_kv), as torch's repeat_interleave. Without it h_kv must be h (or 1, broadcast).

    mha's variants (keywords; see mha/score.hpp):
        window: (left, right), FlashAttention-2's sliding window: query i at position i' = i + S - L
            sees key j when i' - left <= j <= i' + right; -1 leaves a side unbounded. Note the
            alignment: bottom-right (FlashAttention's), where is_causal is top-left (torch's); they
            agree when L == S.
        alibi_slopes: (h,) float; -slope[head] * |i' - j| is added to each logit. No gradient.
        softcap: > 0 caps each scaled logit x to softcap * tanh(x / softcap) (before ALiBi and masks).
        sinks: (h,) float logits, one per query head, that join every row's softmax with no value
            (gpt-oss); differentiable.

    Returns:
        (N..., h, L, E_v) in query's dtype.

    Where mha differs from torch 2.5, and why:
        - A query row whose keys are all masked gives output 0 (and gradient 0) where torch's math
          path gives NaN: mha defines that row as attending to nothing (docs/DESIGN.md), so one padded
          row does not turn a whole batch's loss into NaN.
        - Dropout draws a different (counter-based, thread-count-independent) mask than torch, from a
          seed taken from torch's generator; its statistics are the same.
        - The float mask, ALiBi slopes and scale get no gradient; scale, softcap and slopes must be 0 or
          normal finite numbers of the logit dtype (float32 for float32 and bfloat16 inputs).
        - dropout_p = 1 is refused (torch returns zeros).
        - No double backward (create_graph=True raises): the backward is mha's fused kernel.
        - CPU tensors only: a CUDA (or meta) tensor raises, naming the argument.
        - bfloat16: products in bfloat16 with float32 accumulation and a float32 softmax; torch's bf16
          math path rounds the logits and weights to bf16, so mha's bf16 error is smaller, not equal.

    Raises:
        RuntimeError naming the argument (torch's error type), or saying that the operator library
        was not built.
    """
    _refuse_without_operators()
    return torch.ops.mha.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                      enable_gqa, window, alibi_slopes, softcap, sinks)


# TorchScript cannot compile a function with keyword-only arguments, so torch.jit.script and trace see
# this one as what it calls: the operator, whose schema names the same arguments (torch maps its own
# torch.nn.functional functions to their aten operators the same way, through this table).
if OPERATORS_LOADED:
    torch.jit._builtins._register_builtin(scaled_dot_product_attention, "mha::scaled_dot_product_attention")
