"""mha: Multi-Head Attention ("Attention Is All You Need", Vaswani et al. 2017) on NumPy arrays.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V
    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,   head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

Two entry points:

* :func:`scaled_dot_product_attention` -- the attention core on [B, h, L, d] arrays (and its
  gradients, :func:`scaled_dot_product_attention_backward`); :func:`varlen_attention` (and
  :func:`varlen_attention_backward`) runs it over a packed batch of variable-length sequences,
  FlashAttention's ``cu_seqlens`` layout ([total, h, d] rows, no padding).
* :class:`MultiheadAttention` -- mirrors ``torch.nn.MultiheadAttention`` of PyTorch 1.13 (same
  arguments, parameter names, shapes and results), so a torch ``state_dict`` loads directly; in
  addition d_k and d_v (the per-head widths) are free, ``is_causal`` applies a causal mask, and
  ``backward()`` returns the gradients of the last training-mode forward.

Rotary position embeddings (RoPE, Su et al. 2021), to apply to q and k before the attention core:
:func:`apply_rotary` and its backward, :func:`apply_rotary_backward`.

For torch models, ``import mha.torch`` gives ``mha.torch.MultiheadAttention``, a ``torch.nn.Module``
drop-in for ``torch.nn.MultiheadAttention`` with autograd (``import mha`` alone does not import torch).

Legend: B batch, h heads, L queries, S keys, E = embed_dim, d_k / d_v per-head widths.

Masks follow PyTorch: a boolean ``True`` (or a nonzero integer) means "may not attend"; a float
mask is added to the logits (``-inf`` forbids a position). A query row whose keys are all forbidden
has a defined result: its output is 0 and its weights are 0 (PyTorch 1.13 returns NaN there). For
the module, a 0 attention output means that output row equals ``out_proj.bias``.

Inputs are used in place, without a copy, whatever their strides (transposed or sliced arrays are
fine); results are NumPy arrays that own the library's memory. The compute releases the GIL.

Errors: every invalid argument raises ``ValueError`` (precisely :class:`mha.Error`, a subclass of
``ValueError``) whose message starts with the argument's name, e.g.
``query: expected float32 (the layer's dtype), got float64 [5, 2, 8]``.
"""

import operator
import os

import collections

import numpy as np

from . import _core
from ._core import (BFloat16Bits, Error, Kernel, KeyValueCache, PagedKVCache, apply_rotary, apply_rotary_backward,
                    decode_attention, from_bfloat16, max_num_threads, num_threads, set_num_threads, to_bfloat16)
from ._core import varlen_attention, varlen_attention_backward  # packed variable-length batches

__all__ = [
    "BFloat16Bits",
    "Error",
    "Kernel",
    "KeyValueCache",
    "MultiheadAttention",
    "PagedKVCache",
    "apply_rotary",
    "apply_rotary_backward",
    "decode_attention",
    "load",
    "from_bfloat16",
    "max_num_threads",
    "num_threads",
    "read_npy",
    "read_safetensors",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "set_num_threads",
    "to_bfloat16",
    "varlen_attention",
    "varlen_attention_backward",
    "write_npy",
    "write_safetensors",
]

__version__ = "0.1.0"

_DTYPES = {np.dtype(np.float32): _core.DType.float32, np.dtype(np.float64): _core.DType.float64}

# NumPy has no bfloat16 dtype: a bfloat16 layer is asked for, and reports its dtype, by this name.
_BFLOAT16 = "bfloat16"


def _as_dtype(dtype):
    """numpy.float32 / numpy.float64 (or their names), or "bfloat16" -> (numpy dtype or "bfloat16", _core.DType)."""
    if isinstance(dtype, str) and dtype == _BFLOAT16:
        return _BFLOAT16, _core.DType.bfloat16
    if dtype is None:  # numpy.dtype(None) is float64: not a silent choice of the layer's dtype
        raise Error('dtype: expected numpy.float32, numpy.float64 or "bfloat16", got None')
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved not in _DTYPES:
        raise Error(f'dtype: expected numpy.float32, numpy.float64 or "bfloat16", got {dtype!r}')
    return resolved, _DTYPES[resolved]


def _dtype_name(dtype):
    """A layer's dtype (numpy dtype or "bfloat16") as its name: "float32", "float64", "bfloat16"."""
    return dtype if isinstance(dtype, str) else dtype.name


def _as_array(x):
    """An input as _core takes it: a BFloat16Bits as it is (bfloat16 memory, viewed in place), a torch
    tensor through _numpy_of, anything else through numpy.asarray."""
    if isinstance(x, BFloat16Bits):
        return x
    return np.asarray(_numpy_of(x))


def _int64_arg(value, name):
    """An integer argument as the 64-bit integer the C++ config holds; mha.Error naming it otherwise."""
    try:
        value = operator.index(value)
    except TypeError:
        raise Error(f"{name}: expected an integer, got {value!r}") from None
    if not -2**63 <= value < 2**63:
        raise Error(f"{name}: expected an integer that fits 64 bits, got {value}")
    return value


def _float_arg(value, name):
    """A real number argument as a float (an int, a float, a NumPy scalar); mha.Error naming it for
    None, a str (float("0.5") would parse it), a complex or an int beyond float64's range."""
    refused = f"{name}: expected a real number (float or int), got {type(value).__name__} {value!r:.60}"
    if value is None or isinstance(value, (str, bytes)):
        raise Error(refused)
    try:
        return float(value)
    except OverflowError:
        raise Error(f"{name}: {value!r:.60} is beyond the range of float64") from None
    except (TypeError, ValueError):
        raise Error(refused) from None


def _mask_to_dtype(attn_mask, dtype):
    """A float attn_mask in the dtype of the computation (as torch requires); others unchanged.
    A BFloat16Bits mask is passed as it is (the library converts float masks where it must)."""
    if attn_mask is None or isinstance(attn_mask, BFloat16Bits):
        return attn_mask
    attn_mask = np.asarray(_numpy_of(attn_mask))
    if attn_mask.dtype.kind == "f" and dtype.kind == "f" and attn_mask.dtype != dtype:
        attn_mask = attn_mask.astype(dtype)
    return attn_mask


def _key_lengths(key_lengths):
    """key_lengths as a list of ints for _core: None (or an empty sequence) -> [] (no lengths).

    Takes any sequence or 1-D array of integers (a list, a tuple, a NumPy integer array); refuses
    anything else naming key_lengths, rather than guessing (a float 2.7 is not a length, and a
    boolean array is a key_padding_mask, not lengths).
    """
    if key_lengths is None:
        return []
    if isinstance(key_lengths, (str, bytes)):
        raise Error(f"key_lengths: expected a sequence of B integer lengths, got {type(key_lengths).__name__}")
    try:
        lengths = np.asarray(key_lengths)
    except (TypeError, ValueError) as e:
        raise Error(f"key_lengths: expected a sequence of B integer lengths ({e})") from None
    if lengths.ndim != 1:
        raise Error(f"key_lengths: expected a sequence (1-D) of B integer lengths, got shape {list(lengths.shape)}")
    if lengths.size == 0:
        return []
    if lengths.dtype.kind not in "iu":
        raise Error(f"key_lengths: expected integer lengths, got {lengths.dtype} values {lengths.tolist()[:4]}")
    if lengths.dtype.kind == "u" and lengths.max() > np.iinfo(np.int64).max:
        raise Error(f"key_lengths: {lengths.max()} is out of range")
    return [int(n) for n in lengths]


def _kernel_arg(kernel):
    """mha.Kernel from a Kernel or its name ("flash", "reference"); None stays None."""
    if kernel is None or isinstance(kernel, Kernel):
        return kernel
    names = ", ".join(f'"{name}"' for name in Kernel.__members__)
    if isinstance(kernel, str):
        if kernel.lower() in Kernel.__members__:
            return Kernel.__members__[kernel.lower()]
        raise Error(f"kernel: unknown kernel {kernel[:40]!r}; expected mha.Kernel or one of {names}")
    raise Error(f"kernel: expected mha.Kernel or one of {names}, got {type(kernel).__name__}")


def _refuse_autograd_tensors(**arrays):
    """Raises mha.Error for a torch tensor that requires grad: the NumPy API cannot pass gradients
    back to autograd, and torch's own error ("Can't call numpy() on Tensor that requires grad")
    does not say what to use instead."""
    for name, a in arrays.items():
        if getattr(a, "requires_grad", False) is True and hasattr(a, "detach"):
            raise Error(f"{name}: a torch tensor that requires grad. The NumPy API (mha.MultiheadAttention, "
                        "mha.scaled_dot_product_attention) takes arrays and returns arrays, outside autograd: "
                        "use mha.torch.MultiheadAttention, the torch.nn.Module whose backward autograd calls, "
                        "or pass tensor.detach() when no gradient is wanted")


def _offsets(offsets):
    """Packed sequences' offsets as a list (a 1-D integer array or a sequence); _core refuses the rest by name."""
    array = np.asarray(_numpy_of(offsets))
    return array.tolist() if array.ndim == 1 and array.dtype.kind in "iu" else offsets


def _variants(window, alibi_slopes, softcap, sinks=None):
    """Keyword arguments for the attention variants: window=(left, right) with -1 for an unbounded
    side, alibi_slopes [h] and sinks [h] (float32 / float64), softcap (None or 0: none). _core
    converts window and softcap, refusing by name what is not two 64-bit integers or a real number."""
    options = dict(softcap=softcap, window=window)
    if alibi_slopes is not None:
        options["alibi_slopes"] = np.asarray(_numpy_of(alibi_slopes))
    if sinks is not None:
        options["sinks"] = np.asarray(_numpy_of(sinks))
    return options


def _attention_options(q, k, attn_mask, is_causal, scale, key_padding_mask, key_lengths, dropout_p,
                       dropout_seed, kernel, window=None, alibi_slopes=None, softcap=0.0, sinks=None):
    """Keyword arguments for _core's attention calls; q and k are batched [B, h, *, d] arrays."""
    # Float masks in q's dtype; with bfloat16 q in float32, the dtype its logits are computed in.
    mask_dtype = np.dtype(np.float32) if isinstance(q, BFloat16Bits) else q.dtype
    attn_mask = _mask_to_dtype(attn_mask, mask_dtype)
    if attn_mask is not None and _ndim(attn_mask) == 4 and _ndim(q) == 4 and attn_mask.shape[:2] == q.shape[:2]:
        if isinstance(attn_mask, BFloat16Bits):  # [B, h, L, S] -> [B*h, L, S]
            attn_mask = BFloat16Bits(attn_mask.bits.reshape((-1,) + attn_mask.shape[2:]))
        else:
            attn_mask = attn_mask.reshape((-1,) + attn_mask.shape[2:])
    key_padding_mask = _mask_to_dtype(key_padding_mask, mask_dtype)  # a float one is added per key, O(B S)
    # scale, dropout_p and dropout_seed as given: _core converts them, naming what is not a real number
    # (scale, dropout_p) or an integer in [0, 2**64) (dropout_seed).
    options = dict(attn_mask=attn_mask, is_causal=bool(is_causal), scale=scale,
                   key_padding_mask=key_padding_mask, key_lengths=_key_lengths(key_lengths),
                   dropout_p=dropout_p, dropout_seed=dropout_seed,
                   **_variants(window, alibi_slopes, softcap, sinks))
    kernel = _kernel_arg(kernel)
    if kernel is not None:
        options["kernel"] = kernel
    return options


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, scale=None,
                                 key_padding_mask=None, need_weights=False, *, key_lengths=None,
                                 dropout_p=0.0, dropout_seed=0, kernel=None, need_lse=False, window=None,
                                 alibi_slopes=None, softcap=0.0, sinks=None):
    """softmax(q k^T * scale + mask) v, per batch entry and head.

    Args:
        q: queries [B, h, L, d_k] (or unbatched [h, L, d_k]), float32 or float64, or bfloat16 as a
            BFloat16Bits (``mha.to_bfloat16(array)``; the results then come back as BFloat16Bits,
            ``mha.from_bfloat16`` makes float32 arrays of them, and the lse is float32).
        k: keys [B, h_kv, S, d_k] (or [h_kv, S, d_k]), same dtype as q. h_kv = h is multi-head
            attention; fewer key/value heads (h_kv dividing h) is grouped-query attention, query
            head i reading key/value head i // (h // h_kv) (h_kv = 1: multi-query attention).
        v: values [B, h_kv, S, d_v] (or [h_kv, S, d_v]), same dtype as q.
        attn_mask: optional boolean (True = forbidden) or float (added to the logits) mask,
            [L, S], [B*h, L, S] or [B, h, L, S].
        is_causal: apply a causal mask, aligned to the bottom right: query i may see key j only
            when j <= i + S - L (the usual lower triangle when L == S).
        scale: the logit scale; None means 1 / sqrt(d_k). 0 or a normal finite number of the dtype the
            logits are computed in (see "Logit numbers" below).
        key_padding_mask: optional [B, S] (or [S] unbatched); boolean True (or nonzero integer)
            marks padding keys; a float mask is added to the logits of its key as in PyTorch
            (memory O(B S)), also next to a boolean attn_mask (PyTorch 1.13 reads it as boolean there).
        need_weights: also return the attention probabilities [B, h, L, S].
        key_lengths: alternative to a boolean key_padding_mask: B lengths in [0, S] (a sequence or
            1-D integer array); keys at positions >= length are padding.
        dropout_p: probability of zeroing a weight (kept ones are scaled by 1 / (1 - dropout_p)).
        dropout_seed: keys the dropout mask; the same seed gives the same mask.
        kernel: which implementation computes it (mha.Kernel, or its name: "flash" or "reference");
            None: the library's default (Kernel.flash, which runs float64 inputs through the
            reference kernel).
        need_lse: also return the log-sum-exp of each row's logits [B, h, L] (-inf for a row with
            no allowed key), which scaled_dot_product_attention_backward needs.
        window: a sliding window (left, right), FlashAttention-2's window_size: query i, at position
            i' = i + S - L, sees key j only when i' - left <= j <= i' + right; -1 leaves a side
            unbounded. Key blocks outside it are skipped.
        alibi_slopes: ALiBi, [h] float slopes: -slope[head] * |i' - j| is added to each logit. Each
            slope 0 or a normal finite number of the logit dtype.
        softcap: logit soft-capping (> 0): each scaled logit x becomes softcap * tanh(x / softcap)
            before ALiBi and the masks are added; 0 (default) or None leaves logits alone. Else a
            normal positive number of the logit dtype.
        sinks: attention sinks (gpt-oss), [h] float32 or float64 logits in the units of the scaled
            logits, one per query head, that join every row's softmax and bring no value:
            p_j = exp(s_j) / (exp(sinks[head]) + sum_k exp(s_k)). A row's weights then sum to less
            than 1; a row with no allowed key gets output 0 and lse sinks[head]. The lse includes the
            sink. A NaN sink makes its head's rows NaN; -inf is no sink.

    Masks combine: a position is allowed only if every mask allows it. A query row with no allowed
    key gets output 0 and weights 0.

    Logit numbers: scale, softcap and each ALiBi slope must be 0 or a normal finite number of the
    dtype the logits are computed in: float32 for float32 and bfloat16 inputs (magnitude in
    [1.1754944e-38, 3.4028235e+38]), float64 for float64 inputs (magnitude in
    [2.2250738585072014e-308, 1.7976931348623157e+308]). Others (NaN, inf, 1e39 or 1e-40 with
    float32 q, a subnormal float64) raise mha.Error naming the argument and the range: in float32,
    1e39 would be inf (every output NaN) and softcap=5e-324 would be 0, no soft-capping at all.
    A real number is a float, an int or a NumPy scalar (not a str); window and dropout_seed take
    64-bit integers (dropout_seed in [0, 2**64)); others raise mha.Error naming the argument.

    Returns:
        out [B, h, L, d_v] (or [h, L, d_v]); with need_weights and/or need_lse, the tuple
        (out, weights) / (out, lse) / (out, weights, lse).

    Raises:
        ValueError (mha.Error) naming the offending argument.
    """
    _refuse_autograd_tensors(q=q, k=k, v=v)
    q, k, v = _array(q), _array(k), _array(v)
    unbatched = _ndim(q) == 3
    if unbatched:
        q, k, v = _batched(q), _batched(k), _batched(v)
        if key_padding_mask is not None:
            key_padding_mask = np.asarray(key_padding_mask)[None]
    options = _attention_options(q, k, attn_mask, is_causal, scale, key_padding_mask, key_lengths,
                                 dropout_p, dropout_seed, kernel, window, alibi_slopes, softcap, sinks)
    results = _core.scaled_dot_product_attention(q, k, v, need_weights=bool(need_weights),
                                                 need_lse=bool(need_lse), **options)
    if unbatched:
        results = tuple(None if r is None else _unbatched(r) for r in results)
    out, weights, lse = results
    if not need_weights and not need_lse:
        return out
    return (out,) + ((weights,) if need_weights else ()) + ((lse,) if need_lse else ())


def scaled_dot_product_attention_backward(dout, q, k, v, out, lse, attn_mask=None, is_causal=False,
                                          scale=None, key_padding_mask=None, *, key_lengths=None,
                                          dropout_p=0.0, dropout_seed=0, kernel=None, window=None,
                                          alibi_slopes=None, softcap=0.0, sinks=None):
    """The gradients of scaled_dot_product_attention: returns (dq, dk, dv), or (dq, dk, dv, dsinks)
    with sinks (dsinks [h] in the sinks' dtype, summed over batch and rows in float64, in order).

    dout is dLoss/dout [B, h, L, d_v]; out and lse come from the forward
    (``scaled_dot_product_attention(..., need_lse=True)``) with the same q, k, v and the same
    options (masks, scale, dropout_p and dropout_seed, which regenerate the dropout mask).
    Unbatched arrays ([h, ...]) work as in the forward. The gradients are new arrays (nothing is
    accumulated); with grouped-query attention dk and dv have k's and v's h_kv heads, each the sum
    over its group of query heads. Masks get no gradient. Raises ValueError (mha.Error) naming the argument.
    """
    _refuse_autograd_tensors(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    dout, q, k, v, out, lse = (_array(x) for x in (dout, q, k, v, out, lse))
    unbatched = _ndim(q) == 3
    if unbatched:
        dout, q, k, v, out, lse = (_batched(x) for x in (dout, q, k, v, out, lse))
        if key_padding_mask is not None:
            key_padding_mask = np.asarray(key_padding_mask)[None]
    options = _attention_options(q, k, attn_mask, is_causal, scale, key_padding_mask, key_lengths,
                                 dropout_p, dropout_seed, kernel, window, alibi_slopes, softcap, sinks)
    grads = _core.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **options)
    if unbatched:  # dq, dk, dv lose their batch dimension; dsinks [h] has none
        return tuple(_unbatched(g) for g in grads[:3]) + tuple(grads[3:])
    return grads


# Arrays and BFloat16Bits alike (bfloat16 data: mha.to_bfloat16), for the attention functions.
def _array(x):
    return x if isinstance(x, BFloat16Bits) else np.asarray(x)


def _ndim(x):
    return x.bits.ndim if isinstance(x, BFloat16Bits) else x.ndim


def _batched(x):
    return BFloat16Bits(x.bits[None]) if isinstance(x, BFloat16Bits) else x[None]


def _unbatched(x):
    return BFloat16Bits(x.bits[0]) if isinstance(x, BFloat16Bits) else x[0]


class MultiheadAttention:
    """Multi-head attention with the interface of ``torch.nn.MultiheadAttention`` (PyTorch 1.13).

    Args:
        embed_dim: E, the width of the query and of the output.
        num_heads: h.
        dropout: probability of zeroing an attention weight in training mode.
        bias: add in_proj_bias and out_proj.bias.
        add_bias_kv: learn bias_k and bias_v, appended as one more key/value position.
        add_zero_attn: append a zero key/value position (after bias_k / bias_v).
        kdim, vdim: widths of the key and value inputs (None: embed_dim).
        batch_first: inputs are [B, L, E] (True) or [L, B, E] (False, PyTorch's default).
        d_k, d_v: per-head query/key and value widths (None: embed_dim // num_heads). Unlike
            PyTorch, h * d_k need not equal embed_dim and d_k need not equal d_v.
        num_kv_heads: key/value heads h_kv, a divisor of num_heads (None: num_heads). Fewer is
            grouped-query attention (1: multi-query attention): query head i attends with key/value
            head i // (num_heads // num_kv_heads), and k_proj_weight / v_proj_weight project to
            num_kv_heads * d_k / d_v (the projections are never packed into in_proj_weight then).
        dtype: numpy.float32 or numpy.float64, for the parameters and the inputs; or "bfloat16":
            parameters, activations and gradients held in bfloat16 (products accumulate in float32,
            softmax in float32). NumPy has no bfloat16, so such a layer takes float32 or float64
            arrays and rounds them to bfloat16 (to nearest even) as they enter, and returns float32
            arrays (exact copies of its bfloat16 results): forward's out and weights, backward's
            gradients, state_dict() and parameter attributes. load_state_dict takes float32 /
            float64 arrays or torch tensors (torch.bfloat16 included). A BFloat16Bits input (bfloat16
            bit patterns, what mha.torch passes) is read in place and gets BFloat16Bits results.
            A training-mode forward keeps its rounded copies of float32 / float64 inputs, so
            backward() is that forward's even if the caller's arrays change in between.
        seed: seeds the parameter initialisation and the dropout masks. None draws a seed from
            os.urandom; the seed used is kept in ``self.seed``.
        sinks: learn attention sinks (gpt-oss): a parameter ``sinks`` [num_heads], initialised to
            0, one logit per head that joins every row's softmax with no value (see
            scaled_dot_product_attention); trained, saved and loaded like the other parameters
            (backward() returns its gradient under "sinks").
        rotary_dim: rotary position embeddings (RoPE, see apply_rotary) of every query and key head
            after the projection: the first rotary_dim components (even, <= d_k) of each head; None
            (the default): none. Key j sits at position j, query i at i + S - L (0..L-1 for
            self-attention); append_to_cache and forward_cached put new positions at their index in
            the sequence and store keys rotated. Not with add_bias_kv / add_zero_attn.
        rotary_base: the wavelength base (inv_freq_i = base^(-2i / rotary_dim)), 10000.0 by default.
        rotary_interleaved: pair components (2i, 2i + 1) (GPT-J) instead of (i, i + rotary_dim / 2)
            (GPT-NeoX, Llama).

    Parameters are initialised as PyTorch does (same distributions, not the same numbers):
    projection weights xavier_uniform, out_proj.weight uniform(+-1/sqrt(h*d_v)), biases 0, bias_k
    and bias_v xavier_normal. Like a torch module, a new module is in training mode; dropout
    applies only in training mode, and a training-mode forward also keeps what backward() needs
    (the projections, and references to the input arrays: no copies): call eval() for inference.
    Modifying an input array in place between a training-mode forward and its backward() makes
    backward() raise mha.Error (a fingerprint of each input is compared), not return wrong gradients.

    One module may be used from several threads; its calls are serialised by a lock.

    The parameters are also attributes under PyTorch's names (``in_proj_weight``, ``in_proj_bias``,
    ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``, ``bias_k``, ``bias_v``,
    ``out_proj.weight``, ``out_proj.bias``, and ``sinks``; None where this layer has no such parameter, as in
    PyTorch). Reading one gives a copy; assigning one (an array or a torch tensor of its shape) sets
    it. ``copy.copy``, ``copy.deepcopy`` and ``pickle`` give an independent layer with the same
    configuration, seed, parameters, mode and kernel; what a training-mode forward kept for
    backward() is not copied.

    Invalid arguments raise ValueError (mha.Error) naming the argument.
    """

    # PyTorch's parameter attributes; out_proj.weight and out_proj.bias are reached through out_proj.
    _PARAMETER_ATTRIBUTES = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
                             "v_proj_weight", "bias_k", "bias_v", "sinks")

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, d_k=None, d_v=None,
                 dtype=np.float32, seed=None, num_kv_heads=None, sinks=False, rotary_dim=None,
                 rotary_base=10000.0, rotary_interleaved=False):
        self._dtype, core_dtype = _as_dtype(dtype)
        config = _core.MultiHeadAttentionConfig()
        config.d_model = _int64_arg(embed_dim, "embed_dim")
        config.num_heads = _int64_arg(num_heads, "num_heads")
        config.num_kv_heads = 0 if num_kv_heads is None else _int64_arg(num_kv_heads, "num_kv_heads")
        config.d_k = 0 if d_k is None else _int64_arg(d_k, "d_k")
        config.d_v = 0 if d_v is None else _int64_arg(d_v, "d_v")
        config.kdim = 0 if kdim is None else _int64_arg(kdim, "kdim")
        config.vdim = 0 if vdim is None else _int64_arg(vdim, "vdim")
        config.bias = bool(bias)
        config.add_bias_kv = bool(add_bias_kv)
        config.add_zero_attn = bool(add_zero_attn)
        config.sinks = bool(sinks)
        if rotary_dim is not None:
            config.rotary_dim = _int64_arg(rotary_dim, "rotary_dim")
            if config.rotary_dim == 0:
                raise Error("rotary_dim: expected an even number of components in [2, d_k], or None for none; got 0")
        config.rotary_base = _float_arg(rotary_base, "rotary_base")
        config.rotary_interleaved = bool(rotary_interleaved)
        config.dropout = _float_arg(dropout, "dropout")
        config.batch_first = bool(batch_first)
        config.dtype = core_dtype
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        try:
            self.seed = operator.index(seed)
        except TypeError:
            raise Error(f"seed: expected an integer in [0, 2**64) or None, "
                        f"got {type(seed).__name__} {seed!r:.60}") from None
        if not 0 <= self.seed < 2**64:
            raise Error(f"seed: expected an integer in [0, 2**64), got {self.seed}")
        try:
            self._module = _core.MultiHeadAttention(config, self.seed)
        except Error as e:  # the C++ config calls embed_dim d_model
            raise Error(str(e).replace("d_model", "embed_dim")) from None
        self._config = self._module.config  # every default resolved

    # ---- hyper-parameters (read-only: they are fixed in the C++ module) -------------------------
    embed_dim = property(lambda self: self._config.d_model, doc="E")
    num_heads = property(lambda self: self._config.num_heads, doc="h")
    num_kv_heads = property(lambda self: self._config.num_kv_heads, doc="h_kv, key/value heads")
    d_k = property(lambda self: self._config.d_k, doc="per-head query/key width")
    d_v = property(lambda self: self._config.d_v, doc="per-head value width")
    head_dim = property(lambda self: self._config.d_k,
                        doc="d_k (embed_dim // num_heads unless d_k was given)")
    kdim = property(lambda self: self._config.kdim, doc="width of the key input")
    vdim = property(lambda self: self._config.vdim, doc="width of the value input")
    batch_first = property(lambda self: self._config.batch_first)
    dropout = property(lambda self: self._config.dropout)
    add_zero_attn = property(lambda self: self._config.add_zero_attn)
    has_sinks = property(lambda self: self._config.sinks, doc="whether the layer learns attention sinks")
    rotary_dim = property(lambda self: self._config.rotary_dim or None, doc="rotated components per head, or None")
    rotary_base = property(lambda self: self._config.rotary_base)
    rotary_interleaved = property(lambda self: self._config.rotary_interleaved)
    dtype = property(lambda self: self._dtype,
                     doc='numpy.dtype of the parameters and inputs, or "bfloat16" (parameters held in bfloat16)')
    # Float masks are added to the logits, which a bfloat16 layer computes in float32.
    _mask_dtype = property(lambda self: np.dtype(np.float32) if isinstance(self._dtype, str) else self._dtype)
    _qkv_same_embed_dim = property(lambda self: self._module.packed_in_proj,
                                   doc="True when the q, k, v weights live in one in_proj_weight")

    @property
    def training(self):
        """True in training mode (dropout applies), False in evaluation mode."""
        return self._module.training

    @property
    def kernel(self):
        """Which implementation computes the attention core (mha.Kernel, default flash); settable."""
        return self._module.kernel

    @kernel.setter
    def kernel(self, kernel):
        if kernel is None:
            raise Error('kernel: expected mha.Kernel or one of "flash", "reference", got None')
        self._module.kernel = _kernel_arg(kernel)

    def train(self, mode=True):
        """Sets training mode (evaluation mode with mode=False); returns self."""
        self._module.train(bool(mode))
        return self

    def eval(self):
        """Sets evaluation mode (no dropout); returns self."""
        return self.train(False)

    # ---- parameters ------------------------------------------------------------------------------
    def state_dict(self):
        """{name: copy of the parameter as a NumPy array}, in PyTorch's state_dict order (float32
        copies of a bfloat16 layer's parameters, exact)."""
        return self._module.state_dict()

    def load_state_dict(self, state_dict, strict=True):
        """Sets the parameters from {name: array} with PyTorch's names (float32 or float64 arrays,
        torch tensors of any floating dtype, BFloat16Bits), converted to the layer's dtype (rounded to
        nearest even for a bfloat16 layer).

        ``{k: v.numpy() for k, v in torch_module.state_dict().items()}`` (or the torch state_dict
        itself) loads directly. With strict=True (as in PyTorch) every parameter must be given and no
        other key; with strict=False the given parameters are set, the others kept, and unknown keys
        ignored. Returns (missing_keys, unexpected_keys), a named tuple as PyTorch's. Raises
        ValueError naming the key, changing nothing, on an unknown or missing key (strict) or a
        mis-shaped entry.
        """
        arrays = {name: _numpy_of(value) for name, value in state_dict.items()}
        names = self.parameter_names()
        missing = [n for n in names if n not in arrays]
        unexpected = [n for n in arrays if n not in names]
        if strict:
            self._module.load_state_dict(arrays)
        else:  # one call with every parameter, so that a bad entry changes nothing
            current = self._module.state_dict()
            self._module.load_state_dict({n: arrays.get(n, current[n]) for n in names})
        return _IncompatibleKeys(missing, unexpected)  # both empty when strict (it raised otherwise)

    def parameter(self, name):
        """A copy of the parameter `name` (a state_dict key)."""
        return self._module.parameter(name)

    def parameter_names(self):
        """The parameter names, in PyTorch's state_dict order."""
        return list(self._module.parameter_names())

    def parameters(self):
        """Copies of the parameters, in state_dict order (an iterator, as PyTorch's)."""
        return (self._module.parameter(n) for n in self.parameter_names())

    def named_parameters(self):
        """(name, copy of the parameter) pairs, in state_dict order (an iterator)."""
        return ((n, self._module.parameter(n)) for n in self.parameter_names())

    @property
    def out_proj(self):
        """The output projection's parameters, as ``out_proj.weight`` and ``out_proj.bias``."""
        return _OutProj(self)

    def __getattr__(self, name):  # only for names that normal lookup did not find
        if name in MultiheadAttention._PARAMETER_ATTRIBUTES and "_module" in self.__dict__:
            return self._module.parameter(name) if name in self.parameter_names() else None
        raise AttributeError(f"'MultiheadAttention' object has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name in MultiheadAttention._PARAMETER_ATTRIBUTES and "_module" in self.__dict__:
            self._set_parameter(name, value)
        else:
            object.__setattr__(self, name, value)

    def _set_parameter(self, name, value):
        names = self.parameter_names()
        if name not in names:
            raise Error(f"{name}: this layer has no such parameter (its parameters: {', '.join(names)})")
        self._module.set_parameter(name, _numpy_of(value))

    # ---- copies and pickling ----------------------------------------------------------------------
    def __getstate__(self):
        c = self._config
        config = dict(embed_dim=c.d_model, num_heads=c.num_heads, dropout=c.dropout, bias=c.bias,
                      add_bias_kv=c.add_bias_kv, add_zero_attn=c.add_zero_attn, kdim=c.kdim, vdim=c.vdim,
                      batch_first=c.batch_first, d_k=c.d_k, d_v=c.d_v, dtype=_dtype_name(self._dtype), seed=self.seed,
                      num_kv_heads=c.num_kv_heads, sinks=c.sinks, rotary_dim=c.rotary_dim or None,
                      rotary_base=c.rotary_base, rotary_interleaved=c.rotary_interleaved)
        own = {k: v for k, v in self.__dict__.items() if k not in ("_module", "_config", "_dtype", "seed")}
        return {"config": config, "state_dict": self.state_dict(), "training": self.training,
                "kernel": self.kernel.name, "attributes": own}

    def __setstate__(self, state):
        self.__init__(**state["config"])
        self._module.load_state_dict(state["state_dict"])
        self.train(state["training"])
        self.kernel = state["kernel"]
        for name, value in state["attributes"].items():
            object.__setattr__(self, name, value)

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False, *, key_lengths=None, head_gate=None, window=None,
                alibi_slopes=None, softcap=0.0, cu_seqlens=None, cu_seqlens_k=None, positions=None,
                key_positions=None):
        """Multi-head attention of query over key/value; returns (out, weights or None).

        Args:
            query: [B, L, E] (batch_first), [L, B, E] (not batch_first) or unbatched [L, E].
            key: [B, S, kdim], [S, B, kdim] or [S, kdim].
            value: [B, S, vdim], [S, B, vdim] or [S, vdim].
            key_padding_mask: [B, S] ([S] unbatched); True (or nonzero integer) marks padding; a
                float mask is added to the logits of its key, as in PyTorch (memory O(B S)). With a
                boolean attn_mask it is still added (PyTorch 1.13 reads it as boolean there).
            need_weights: also return the attention weights.
            attn_mask: boolean (True = forbidden) or float (added) mask, [L, S] or [B*h, L, S].
            average_attn_weights: average the weights over heads ([B, L, S']) instead of
                returning them per head ([B, h, L, S']). S' = S + add_bias_kv + add_zero_attn.
            is_causal: apply a causal mask over the S input keys, aligned to the bottom right
                (query i may see key j only when j <= i + S - L). Combines with attn_mask.
            key_lengths: alternative to a boolean key_padding_mask: B lengths in [0, S] (a
                sequence or 1-D integer array).
            head_gate: optional float32 / float64 gate g, [h] or [B, h] ([h] unbatched), multiplying
                head i's attention output before W^O: out = Concat(g_1 head_1, ..., g_h head_h) W^O
                + b_O. A gate of 0 switches a head off; the weights returned are not gated. After a
                training-mode forward with a gate, backward() also returns dLoss/dg under
                "head_gate" (the head-importance score of Michel et al. 2019).
            window, alibi_slopes, softcap: a sliding window (left, right) over the S input keys,
                ALiBi slopes [h] and logit soft-capping, as scaled_dot_product_attention takes them
                (not with add_bias_kv / add_zero_attn, except softcap; softcap None or 0: none).
                softcap and each slope must be 0 or a normal number of the layer's logit dtype
                (float32 for float32 and bfloat16 layers, float64 for float64), else mha.Error.
            cu_seqlens, cu_seqlens_k: packed sequences (FlashAttention's varlen layout, see
                varlen_attention): unbatched query [L_total, E] and key / value [S_total, *] holding n
                sequences one after another, cu_seqlens [n + 1] the prefix sums of their query lengths
                (from 0 to L_total), cu_seqlens_k those of their key lengths (None: cu_seqlens again,
                self-attention). Each sequence attends only to its own keys (causal and window within
                it; rotary positions count from 0 in each); nothing is padded. No masks, no weights
                (None is returned for them), not with add_bias_kv / add_zero_attn.
            positions, key_positions: explicit rotary positions (a layer with rotary_dim), for
                left-padded batches: int64 or int32 arrays, positions [B, L] or [L] (query row i of
                batch b rotated at positions[b, i]), key_positions [B, S] or [S]; integers >= 0.
                None: query i at i + S - L and key j at j. key_positions None reuses positions when
                S = L (self-attention) and is required when S != L. Not with cu_seqlens (packed
                sequences count from 0 in each), nor without rotary_dim.

        Returns:
            (out like query, weights or None); unbatched input gives weights [L, S'] or [h, L, S'].
            A bfloat16 layer takes float32 / float64 inputs (rounded to bfloat16) and returns float32
            arrays; given BFloat16Bits it returns BFloat16Bits.
        """
        _refuse_autograd_tensors(query=query, key=key, value=value, head_gate=head_gate)
        query = _as_array(query)
        key = query if key is query else _as_array(key)
        value = key if value is key else _as_array(value)
        attn_mask = _mask_to_dtype(attn_mask, self._mask_dtype)
        key_padding_mask = _mask_to_dtype(key_padding_mask, self._mask_dtype)
        return self._module.forward(
            query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
            head_gate=None if head_gate is None else _as_array(head_gate),
            key_lengths=_key_lengths(key_lengths), is_causal=bool(is_causal),
            need_weights=bool(need_weights), average_attn_weights=bool(average_attn_weights),
            cu_seqlens=None if cu_seqlens is None else _offsets(cu_seqlens),
            cu_seqlens_k=None if cu_seqlens_k is None else _offsets(cu_seqlens_k),
            positions=positions, key_positions=key_positions,
            **_variants(window, alibi_slopes, softcap))

    # ---- incremental decoding --------------------------------------------------------------------
    def append_to_cache(self, cache, key, value):
        """Projects key and value (laid out as forward's key and value) and appends them to
        `cache`, an mha.KeyValueCache; the first append fixes its batch size. O(new positions)."""
        _refuse_autograd_tensors(key=key, value=value)
        key = _as_array(key)
        self._module.append_to_cache(cache, key, key if value is key else _as_array(value))

    def forward_cached(self, query, cache, key_padding_mask=None, need_weights=True, attn_mask=None,
                       average_attn_weights=True, is_causal=False, *, key_lengths=None, head_gate=None,
                       window=None, alibi_slopes=None, softcap=0.0):
        """Attends query to every position in `cache`: forward(query, K, V) where K and V are all the
        keys and values appended so far, in evaluation mode (no dropout, nothing kept for backward).
        Masks and key_lengths refer to cache positions. is_causal is aligned to the bottom right, so
        appending a step's key and value and then attending with is_causal=True gives what a causal
        forward over the whole sequence gives for those queries. head_gate, window, alibi_slopes and
        softcap as in forward (positions are the cache's). Returns (out like query, weights or None)."""
        _refuse_autograd_tensors(query=query, head_gate=head_gate)
        query = _as_array(query)
        attn_mask = _mask_to_dtype(attn_mask, self._mask_dtype)
        key_padding_mask = _mask_to_dtype(key_padding_mask, self._mask_dtype)
        return self._module.forward_cached(
            query, cache, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
            head_gate=None if head_gate is None else _as_array(head_gate),
            key_lengths=_key_lengths(key_lengths),
            is_causal=bool(is_causal), need_weights=bool(need_weights),
            average_attn_weights=bool(average_attn_weights), **_variants(window, alibi_slopes, softcap))

    def save(self, path):
        """Writes the layer as safetensors: parameters under state_dict names, the config in the
        file's __metadata__ (what `mha.load` and the `mha run` command read).

        `path` is a str, bytes or os.PathLike. The file is written beside the target and renamed
        over it when complete; a symbolic link is followed (its target gets the new file, the link
        stays), and a path holding anything but a regular file (a directory, FIFO, device, socket)
        is refused, as is a path containing a NUL byte. Errors raise mha.Error naming the path."""
        self._module.save_safetensors(path)

    def backward(self, grad_out):
        """The gradients of the last training-mode forward, given grad_out = dLoss/d out.

        Returns a dict: "query", "key", "value" (new arrays shaped like that forward's inputs),
        then every parameter under its state_dict name, in state_dict order, then "head_gate"
        (shaped and typed like the gate) when that forward had one. Nothing is
        accumulated: when query, key and value were one array, add the three gradients. A bfloat16
        layer's gradients are bfloat16, returned as float32 arrays (BFloat16Bits when grad_out is one). No gradient
        flows through the returned attention weights. A training-mode forward keeps what this
        needs; evaluation mode keeps nothing. Raises ValueError when there is no training-mode
        forward, when an input array of that forward was modified since (the forward keeps the
        arrays themselves, not copies), or grad_out has the wrong shape or dtype.
        """
        _refuse_autograd_tensors(grad_out=grad_out)
        query, key, value, parameters, head_gate = self._module.backward(grad_out)
        grads = {"query": query, "key": key, "value": value, **parameters}
        if head_gate is not None:
            grads["head_gate"] = head_gate
        return grads

    def saved_bytes(self):
        """Bytes the last training-mode forward keeps for backward(): the projections, concatenated
        heads, log-sum-exps and masks (the input arrays are referenced, not copied, unless an input
        has gaps between its rows); 0 after an eval-mode forward."""
        return self._module.saved_bytes()

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __repr__(self):
        c = self._config
        grouped = f", num_kv_heads={c.num_kv_heads}" if c.num_kv_heads != c.num_heads else ""
        return (f"MultiheadAttention(embed_dim={c.d_model}, num_heads={c.num_heads}{grouped}, d_k={c.d_k}, "
                f"d_v={c.d_v}, kdim={c.kdim}, vdim={c.vdim}, bias={c.bias}, "
                f"add_bias_kv={c.add_bias_kv}, add_zero_attn={c.add_zero_attn}, "
                f"dropout={c.dropout}, batch_first={c.batch_first}, dtype={_dtype_name(self._dtype)}"
                + (", sinks=True" if c.sinks else "")
                + (f", rotary_dim={c.rotary_dim}, rotary_base={c.rotary_base}, rotary_interleaved={c.rotary_interleaved}"
                   if c.rotary_dim else "") + ")")


_IncompatibleKeys = collections.namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


def _numpy_of(value):
    """A NumPy view of a torch tensor or parameter (detached, on the CPU); anything else as it is.

    A torch.bfloat16 tensor becomes a float32 copy (NumPy has no bfloat16; the conversion is exact,
    so a bfloat16 layer gets the same bits back). mha.torch passes bfloat16 memory without a copy,
    as BFloat16Bits, instead."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return value


class _OutProj:
    """``layer.out_proj``: its weight and bias read (copies) and assigned through the layer."""

    def __init__(self, layer):
        object.__setattr__(self, "_layer", layer)

    def __getattr__(self, name):
        if name not in ("weight", "bias"):
            raise AttributeError(f"'out_proj' has no attribute {name!r} (it has weight and bias)")
        full = "out_proj." + name
        layer = self._layer
        return layer.parameter(full) if full in layer.parameter_names() else None

    def __setattr__(self, name, value):
        if name not in ("weight", "bias"):
            raise AttributeError(f"'out_proj' has no attribute {name!r} (it has weight and bias)")
        self._layer._set_parameter("out_proj." + name, value)


def load(path, **overrides):
    """A MultiheadAttention from a safetensors file written by `MultiheadAttention.save` (or by the
    C++ `mha::save_safetensors`): the config from the file's metadata, then the parameters, strictly.
    Keyword arguments override constructor arguments (e.g. batch_first=False).

    `path` is a str, bytes or os.PathLike. Every problem with the file (missing or malformed
    metadata, such as a boolean other than "true" / "false", a config the layer refuses, a missing,
    extra or mis-shaped parameter) raises mha.Error naming the file and the key or value."""
    tensors, meta = _core.read_safetensors(path)
    name = os.fsencode(path).decode("utf-8", "backslashreplace")  # as the C++ errors show it
    if meta.get("format") != "mha":
        raise Error(f"{name}: no mha metadata; build the layer yourself and load_state_dict("
                    "mha.read_safetensors(path)[0])")
    c = _core.config_from_metadata(meta, name)
    config = dict(embed_dim=c.d_model, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, d_k=c.d_k, d_v=c.d_v, kdim=c.kdim,
                  vdim=c.vdim, bias=c.bias, add_bias_kv=c.add_bias_kv, add_zero_attn=c.add_zero_attn,
                  batch_first=c.batch_first, dropout=c.dropout, sinks=c.sinks, rotary_dim=c.rotary_dim or None,
                  rotary_base=c.rotary_base, rotary_interleaved=c.rotary_interleaved,
                  dtype={_core.DType.float64: np.float64, _core.DType.bfloat16: _BFLOAT16}.get(c.dtype, np.float32))
    config.update(overrides)
    try:
        layer = MultiheadAttention(**config)
        layer.load_state_dict(tensors)
    except Error as e:
        raise Error(f"{name}: {e}") from None
    return layer


def read_safetensors(path):
    """Reads a safetensors file: ({name: array}, {metadata key: value}). BF16 tensors come back as
    float32 arrays (exact).

    `path` is a str, bytes or os.PathLike; one containing a NUL byte raises mha.Error."""
    return _core.read_safetensors(path)


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: array} and {str: str} metadata as a safetensors file. Arrays must be float32,
    float64 or bool, or a BFloat16Bits (stored as BF16; read back as float32): any other dtype (an
    integer array too) raises mha.Error naming it.

    `path` is a str, bytes or os.PathLike. The file is written beside its target and renamed over it
    when complete, so a failed write leaves the old file as it was. A symbolic link is followed (its
    target gets the new file, the link stays); a path holding anything but a regular file (a
    directory, FIFO, device, socket), or containing a NUL byte, raises mha.Error."""
    return _core.write_safetensors(path, tensors, metadata)


def read_npy(path):
    """Reads a .npy file (float64, float32, float16 as float32, bool) as an array.

    `path` is a str, bytes or os.PathLike; one containing a NUL byte raises mha.Error."""
    return _core.read_npy(path)


def write_npy(path, array):
    """Writes a float32, float64 or bool array as a .npy file; any other dtype (an integer array
    too) raises mha.Error naming it. `path` is handled as by `write_safetensors`: written beside its
    target and renamed over it, symbolic links followed, anything but a regular file refused."""
    return _core.write_npy(path, array)
