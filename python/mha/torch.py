"""mha.torch: a drop-in replacement for ``torch.nn.MultiheadAttention`` computed by mha.

    import mha.torch
    attention = mha.torch.MultiheadAttention(embed_dim=64, num_heads=4, batch_first=True)
    out, weights = attention(x, x, x, attn_mask=mask)   # x: torch tensors, as with torch's module
    out.sum().backward()                                # gradients for x and every parameter

:class:`MultiheadAttention` is a ``torch.nn.Module`` with the constructor, parameter names, shapes,
initialisation and forward of ``torch.nn.MultiheadAttention`` (PyTorch 1.13), so a state_dict
moves between the two either way and the module can replace ``self_attn`` in an existing model.
The forward and backward run mha's C++ layer through the registered operator
``torch.ops.mha.multi_head_attention`` (python/torch_ops, its autograd in C++), so the module can be
scripted (``torch.jit.script``), traced, saved and run from C++ libtorch (docs/TORCH.md). Where that
operator library was not built (a build without libtorch-dev) the forward runs the same C++ layer
through NumPy and a ``torch.autograd.Function`` instead (same results, bit for bit), in eager mode only.

This file imports torch; ``import mha`` alone does not (torch is imported only by ``import mha.torch``).

Legend: B batch, h heads, L queries, S keys, E = embed_dim, d_k / d_v per-head widths,
S' = S + add_bias_kv + add_zero_attn (the keys after the appended positions).
"""

from typing import List, Optional, Tuple

import numpy as np
import torch as _torch  # the top-level torch: absolute import, not this module (mha.torch)
from torch import Tensor as _Tensor
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear as _OutProj

import mha as _mha
from mha._torch_replace import replace_attention  # swaps torch.nn.MultiheadAttention modules for this one
from mha._torch_sdpa import OPERATORS_LOADED as _OPERATORS_LOADED  # libmha_torch_ops.so was built and loaded
from mha._torch_sdpa import scaled_dot_product_attention  # the registered operator's function (torch 2.5's)

__all__ = ["MultiheadAttention", "replace_attention", "scaled_dot_product_attention"]

# The internal mha layer's dtype for each torch dtype the module takes.
_LAYER_DTYPE = {_torch.float32: np.float32, _torch.float64: np.float64, _torch.bfloat16: "bfloat16"}
_DTYPE_NAMES = "torch.float32, torch.float64 or torch.bfloat16"

_NOT_SCRIPTABLE = (
    "mha.torch.MultiheadAttention cannot be compiled by torch.jit.script or recorded by torch.jit.trace "
    "without mha's operator library (libmha_torch_ops.so, not built in this install): its forward then runs "
    "mha's C++ layer through NumPy arrays, outside TorchScript. Build mha with CMake where libtorch-dev is "
    "installed, or use torch.nn.MultiheadAttention (same parameters and state_dict) where TorchScript is needed.")
_OPERATOR_ERROR = "mha.multi_head_attention: "  # how the operator's argument errors begin
_NO_DOUBLE_BACKWARD = (
    "mha.torch.MultiheadAttention does not support double backward (backward with create_graph=True, as "
    "gradient penalties and Hessian-vector products need): its backward is mha's fused kernel, whose own "
    "derivative is not implemented. Use torch.nn.MultiheadAttention for second derivatives.")
_NO_BATCHED_GRADIENTS = (
    "mha.torch.MultiheadAttention's backward cannot run under torch's vmap, which "
    "torch.autograd.grad(..., is_grads_batched=True) and torch.autograd.functional.jacobian / hessian(..., "
    "vectorize=True) use: the batched gradient is a BatchedTensor, whose memory mha's kernel cannot read. "
    "Pass the gradients one at a time (is_grads_batched=False, a loop over grad_outputs) or use "
    "vectorize=False (the default); both give the same gradients.")

# Idle mha layers kept per kind (see _WorkerPool). Two cover a training loop, where the graph of
# step n (one layer checked out) is still alive during the forward of step n + 1 (a second one).
_MAX_IDLE_WORKERS = 2


class MultiheadAttention(_torch.nn.Module):
    r"""``torch.nn.MultiheadAttention`` (PyTorch 1.13) computed by mha, on CPU tensors.

    Args (as torch's):
        embed_dim: E, the width of the query and of the output.
        num_heads: h.
        dropout: probability of zeroing an attention weight in training mode.
        bias: add in_proj_bias and out_proj.bias.
        add_bias_kv: learn bias_k and bias_v, appended as one more key/value position.
        add_zero_attn: append a zero key/value position (after bias_k / bias_v).
        kdim, vdim: widths of the key and value inputs (None: embed_dim).
        batch_first: inputs are [B, L, E] (True) or [L, B, E] (False, torch's default).
        device: None or "cpu" (mha runs on the CPU only).
        dtype: torch.float32, torch.float64 or torch.bfloat16 (None: torch's default dtype); or
            convert later with ``.to(torch.bfloat16)`` / ``.bfloat16()``, as any module.
    Extra args:
        d_k, d_v: per-head query/key and value widths (None: embed_dim // num_heads, which then
            must divide exactly, as torch requires). With them, h * d_k need not equal E and d_k
            need not equal d_v; the projection shapes follow (q_proj_weight [h*d_k, E], ...,
            out_proj.weight [E, h*d_v]).
    Extra forward arg: head_gate, a per-head gate before out_proj, differentiable (see forward).

    Parameters (``torch.nn.Parameter``, torch's names, shapes and initialisation; with the same
    ``torch.manual_seed`` a new module holds the same numbers as a new torch module):
        in_proj_weight [2*h*d_k + h*d_v, E] when kdim == vdim == E and d_k == d_v, else
        q_proj_weight [h*d_k, E], k_proj_weight [h*d_k, kdim], v_proj_weight [h*d_v, vdim];
        in_proj_bias [2*h*d_k + h*d_v]; bias_k [1, 1, h*d_k], bias_v [1, 1, h*d_v];
        out_proj (a NonDynamicallyQuantizableLinear): weight [E, h*d_v], bias [E].

    Differences from torch's module:
        * Gradients flow to query, key, value and every parameter, not through the returned
          attention weights (they come back with requires_grad=False) nor into masks: a float
          attn_mask or key_padding_mask that requires grad is refused.
        * Dropout (training mode) uses mha's counter-based mask, not torch's, so the dropped
          positions differ from torch's module (the distribution is the same). Through the operator
          library each call's mask is keyed by a seed drawn from torch's default generator, so the
          same ``torch.manual_seed`` repeats it, eager and scripted alike; the NumPy fallback seeds
          each of its pooled layers once from that generator, so a program still repeats itself.
        * A query row whose keys are all masked gives output out_proj.bias (attention output 0)
          and weights 0, where torch gives NaN.
        * ``is_causal=True`` applies a causal mask (query i may see key j when j <= i + S - L,
          the usual lower triangle when L == S), combined with any attn_mask. (torch 1.13 has no
          such argument; torch 2.x reads it as a hint that attn_mask is causal.)
        * float32, float64 and bfloat16 only, CPU only, dense tensors only (not sparse or nested);
          other dtypes, devices or layouts raise mha.Error (a ValueError) naming the argument, as do
          inputs whose dtype differs from the parameters' (torch's module raises a RuntimeError
          there). No double backward (create_graph=True), and no batched gradients: the backward does
          not run under torch's vmap, so ``torch.autograd.grad(..., is_grads_batched=True)`` and
          ``torch.autograd.functional.jacobian(..., vectorize=True)`` raise a RuntimeError saying so;
          pass the gradients one at a time, or vectorize=False (the default), instead.
        * bfloat16 runs mha's bfloat16 layer: bfloat16 products accumulated in float32, softmax in
          float32; torch 1.13's bfloat16 module rounds more often, so the two differ by bfloat16
          rounding (mha's error against float64 is no larger than torch's; tests/python/test_bfloat16.py).
        * In eval mode under ``torch.no_grad()``, torch.nn.TransformerEncoderLayer's fast path
          reads the parameters of its ``self_attn`` and calls torch's fused kernel without calling
          ``self_attn.forward``; the result is the same (same parameters), but mha does not run.

    How it runs: each forward copies the current parameter values into an internal mha layer
    (mha::MultiHeadAttention, taken from a pool of idle layers by configuration; so an optimiser's
    in-place updates are always seen) and hands it the inputs as views of the tensors' memory (no
    copy, any strides; the results come back as tensors on mha's memory, again without a copy). When
    autograd needs gradients the layer that ran the forward stays with that forward's graph until the
    graph is freed, so several forwards may precede their backward (and ``retain_graph=True``
    backwards may repeat); a layer holds its forward's activations (the projections, and references
    to the input tensors' memory rather than copies) until it is reused. Modifying an input in place
    before the backward makes the backward raise (torch's RuntimeError for a tensor saved for
    backward; on the NumPy path, mha.Error).

    Errors: in eager mode (and while tracing), bad arguments raise mha.Error (a ValueError) naming the
    argument; in scripted code and libtorch, the operator's RuntimeError naming it.
    TorchScript: ``head_gate`` is the forward's last argument (TorchScript compiles no keyword-only
    arguments); pass it by keyword.
    """

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None, d_k=None, d_v=None):
        super().__init__()
        if device is not None and _torch.device(device).type != "cpu":
            raise _mha.Error(f"device: mha runs on the CPU only, got {device!r}")
        dtype = _torch.get_default_dtype() if dtype is None else dtype
        if dtype not in _LAYER_DTYPE:
            raise _mha.Error(f"dtype: expected {_DTYPE_NAMES}, got {dtype}")
        if embed_dim <= 0 or num_heads <= 0:
            raise _mha.Error(f"embed_dim, num_heads: expected positive sizes, got {embed_dim}, {num_heads}")
        if (d_k is None or d_v is None) and embed_dim % num_heads != 0:
            raise _mha.Error(f"embed_dim: must be divisible by num_heads ({embed_dim} % {num_heads} != 0) "
                             "unless d_k and d_v are given")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.d_k = d_k if d_k is not None else embed_dim // num_heads
        self.d_v = d_v if d_v is not None else embed_dim // num_heads
        self.head_dim = self.d_k
        self.dropout = dropout
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        # True when the q, k, v weights live in one in_proj_weight (torch: kdim == vdim == E).
        self._qkv_same_embed_dim = (self.kdim == embed_dim and self.vdim == embed_dim
                                    and self.d_k == self.d_v)

        qk, vw = num_heads * self.d_k, num_heads * self.d_v  # widths of all heads' q/k and v
        # Registered in torch's order, which is also the state_dict order.
        if self._qkv_same_embed_dim:
            self.in_proj_weight = _torch.nn.Parameter(_torch.empty((2 * qk + vw, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = _torch.nn.Parameter(_torch.empty((qk, embed_dim), **factory))
            self.k_proj_weight = _torch.nn.Parameter(_torch.empty((qk, self.kdim), **factory))
            self.v_proj_weight = _torch.nn.Parameter(_torch.empty((vw, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = _torch.nn.Parameter(_torch.empty(2 * qk + vw, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = _OutProj(vw, embed_dim, bias=bias, **factory)  # weight [E, h*d_v]
        if add_bias_kv:
            self.bias_k = _torch.nn.Parameter(_torch.empty((1, 1, qk), **factory))
            self.bias_v = _torch.nn.Parameter(_torch.empty((1, 1, vw), **factory))
        else:
            self.bias_k = self.bias_v = None

        self._workers = _WorkerPool()
        self._reset_parameters()

    def _reset_parameters(self):
        """torch's initialisation, in torch's order (so the same seed gives the same numbers)."""
        if self._qkv_same_embed_dim:
            _torch.nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            _torch.nn.init.xavier_uniform_(self.q_proj_weight)
            _torch.nn.init.xavier_uniform_(self.k_proj_weight)
            _torch.nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            _torch.nn.init.constant_(self.in_proj_bias, 0.0)
            _torch.nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            _torch.nn.init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            _torch.nn.init.xavier_normal_(self.bias_v)

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, d_k={self.d_k}, "
                f"d_v={self.d_v}, kdim={self.kdim}, vdim={self.vdim}, dropout={self.dropout}, "
                f"batch_first={self.batch_first}, add_zero_attn={self.add_zero_attn}")

    # The internal mha layers are a cache, not state: copy.deepcopy (which
    # torch.nn.TransformerEncoder uses to clone its layers) and pickling start with none.
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_workers"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._workers = _WorkerPool()

    # Without the operator library the forward runs mha's C++ layer through NumPy, which TorchScript cannot
    # express: say so instead of torch's parse error.
    def __prepare_scriptable__(self):
        if not _OPERATORS_LOADED:
            raise RuntimeError(_NOT_SCRIPTABLE)
        return self

    def forward(self, query: _Tensor, key: _Tensor, value: _Tensor, key_padding_mask: Optional[_Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[_Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False, head_gate: Optional[_Tensor] = None) -> Tuple[_Tensor, Optional[_Tensor]]:
        """Multi-head attention of query over key/value; returns (attn_output, attn_output_weights or None).

        Args:
            query: [B, L, E] (batch_first), [L, B, E] (not batch_first) or unbatched [L, E].
            key: [B, S, kdim], [S, B, kdim] or [S, kdim].
            value: [B, S, vdim], [S, B, vdim] or [S, vdim].
            key_padding_mask: [B, S] ([S] unbatched); True (or a nonzero integer) marks padding; a
                float mask is added to the logits.
            need_weights: also return the attention weights (without gradient: requires_grad is
                False and no gradient flows back through them).
            attn_mask: boolean (True = may not attend), byte (nonzero = may not attend) or float
                (added to the logits) mask, [L, S] or [B*h, L, S].
            average_attn_weights: average the weights over heads ([B, L, S']) instead of returning
                them per head ([B, h, L, S']).
            is_causal: also apply a causal mask over the S keys (query i sees key j <= i + S - L).
            head_gate (extra; pass it by keyword): a float32 / float64 tensor g, [h] or [B, h] ([h]
                unbatched), multiplying head i's attention output before out_proj:
                Concat(g_1 head_1, ..., g_h head_h) W^O + b_O (0 switches a head off; the weights
                returned are not gated). When it requires grad, autograd gives its gradient, the
                head-importance score of Michel et al. 2019.

        Returns:
            attn_output shaped like query with width E; attn_output_weights [B, L, S'] or
            [B, h, L, S'] ([L, S'] / [h, L, S'] unbatched) when need_weights, else None.
        """
        if not _torch.jit.is_scripting():
            return self._forward_eager(query, key, value, key_padding_mask, need_weights, attn_mask,
                                       average_attn_weights, is_causal, head_gate)
        return self._forward_operator(query, key, value, key_padding_mask, need_weights, attn_mask,
                                      average_attn_weights, is_causal, head_gate)

    def _forward_operator(self, query: _Tensor, key: _Tensor, value: _Tensor, key_padding_mask: Optional[_Tensor],
                          need_weights: bool, attn_mask: Optional[_Tensor], average_attn_weights: bool,
                          is_causal: bool, head_gate: Optional[_Tensor]) -> Tuple[_Tensor, Optional[_Tensor]]:
        """The forward as one call of the registered operator mha::multi_head_attention (python/torch_ops),
        whose autograd is in C++: what eager mode, torch.jit.script and torch.jit.trace all run."""
        out, weights = _torch.ops.mha.multi_head_attention(
            query, key, value, self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight,
            self.in_proj_bias, self.bias_k, self.bias_v, self.out_proj.weight, self.out_proj.bias, self.num_heads,
            self.d_k, self.d_v, self.add_zero_attn, self.batch_first, self.dropout if self.training else 0.0,
            _bool_mask(key_padding_mask), _bool_mask(attn_mask), need_weights, average_attn_weights, is_causal,
            head_gate)
        if need_weights:
            return out, weights
        return out, None

    @_torch.jit.unused
    def _forward_eager(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                       is_causal, head_gate):
        """The forward outside TorchScript (eager mode and torch.jit.trace): the operator after the module's
        own checks, its argument errors raised as mha.Error (as the NumPy path raises them); without the
        operator library, the NumPy path."""
        if not _OPERATORS_LOADED:
            return self._forward_numpy(query, key, value, key_padding_mask, need_weights, attn_mask,
                                       average_attn_weights, is_causal, head_gate)
        key_padding_mask, attn_mask = self._check_eager_arguments(query, key, value, key_padding_mask, attn_mask,
                                                                  head_gate)
        try:
            return self._forward_operator(query, key, value, key_padding_mask, bool(need_weights), attn_mask,
                                          bool(average_attn_weights), bool(is_causal), head_gate)
        except RuntimeError as e:
            message = str(e)
            if message.startswith(_OPERATOR_ERROR):  # an argument mha's layer refused
                raise _mha.Error(message[len(_OPERATOR_ERROR):]) from None
            raise

    @_torch.jit.unused
    def _check_eager_arguments(self, query, key, value, key_padding_mask, attn_mask, head_gate):
        """The checks of the eager forward, raising mha.Error naming the argument (TorchScript leaves them to the
        operator, which raises RuntimeErrors naming it); returns the masks as tensors."""
        names, params = self._named_tensors()
        dtype = _check_parameters(names, params)
        for t, name in ((query, "query"), (key, "key"), (value, "value")):
            _check_input(t, name, dtype)
        _check_head_gate(head_gate)
        masks = []
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is not None and not isinstance(mask, _torch.Tensor):
                mask = _torch.as_tensor(np.asarray(mask))
            if mask is not None:
                _dense_cpu(mask, name, "a mask on ")
                if mask.requires_grad and _torch.is_grad_enabled():
                    raise _mha.Error(f"{name}: no gradient flows into masks; pass {name}.detach()")
            masks.append(mask)
        return masks[0], masks[1]

    @_torch.jit.unused
    def _forward_numpy(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                       is_causal, head_gate):
        """The forward without the operator library (a pip install): mha's layer through NumPy (not TorchScript)."""
        if _torch.jit.is_tracing():
            raise RuntimeError(_NOT_SCRIPTABLE)
        names, params = self._named_tensors()
        dtype = _check_parameters(names, params)
        tensors = [_check_input(t, name, dtype) for t, name in
                   ((query, "query"), (key, "key"), (value, "value"))]
        # One NumPy view per distinct tensor, so that mha sees self-attention as one array.
        views = {}
        arrays = [views.setdefault(id(t), _array_of(t)) for t in tensors]
        masks = {name: _mask_array(m, name) for name, m in
                 (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask))}
        gate = _check_head_gate(head_gate)

        dropout = float(self.dropout) if self.training else 0.0
        differentiable = tensors + params + ([] if gate is None else [gate])
        needs_grad = _torch.is_grad_enabled() and any(t.requires_grad for t in differentiable)
        call = _Call(
            worker=self._workers.checkout(self._layer_config(dtype, dropout)),
            names=names, params=params, arrays=arrays, masks=masks,
            head_gate=None if gate is None else _array_of(gate),
            training=needs_grad or dropout > 0.0,
            need_weights=bool(need_weights), average_attn_weights=bool(average_attn_weights),
            is_causal=bool(is_causal))
        if needs_grad:
            results = _MultiheadAttentionFunction.apply(call, *tensors, gate, *params)
            out, weights = (results if need_weights else (results, None))
        else:
            out, weights = call.forward()
            out = _tensor_of(out)
            weights = None if weights is None else _tensor_of(weights)
            del call  # its mha layer goes back to the pool now
        return out, weights


    def _named_tensors(self):
        """([state_dict name], [tensor]) of the parameters, read through getattr so that a
        parametrised parameter (torch.nn.utils.parametrize) is seen as the tensor it computes."""
        names = (["in_proj_weight"] if self._qkv_same_embed_dim
                 else ["q_proj_weight", "k_proj_weight", "v_proj_weight"])
        tensors = [getattr(self, name) for name in names]
        if self.in_proj_bias is not None:
            names.append("in_proj_bias")
            tensors.append(self.in_proj_bias)
        if self.bias_k is not None:
            names += ["bias_k", "bias_v"]
            tensors += [self.bias_k, self.bias_v]
        names.append("out_proj.weight")
        tensors.append(self.out_proj.weight)
        if self.out_proj.bias is not None:
            names.append("out_proj.bias")
            tensors.append(self.out_proj.bias)
        return names, tensors

    def _layer_config(self, dtype, dropout):
        """The constructor arguments of the internal mha.MultiheadAttention (a hashable tuple)."""
        return (("embed_dim", self.embed_dim), ("num_heads", self.num_heads),
                ("dropout", dropout), ("bias", self.in_proj_bias is not None),
                ("add_bias_kv", self.bias_k is not None), ("add_zero_attn", bool(self.add_zero_attn)),
                ("kdim", self.kdim), ("vdim", self.vdim), ("batch_first", bool(self.batch_first)),
                ("d_k", self.d_k), ("d_v", self.d_v), ("dtype", _LAYER_DTYPE[dtype]))


class _WorkerPool:
    """Idle internal mha layers by constructor arguments: creating one initialises parameters that
    are overwritten at once (tens of milliseconds at E = 1024), so layers are reused."""

    def __init__(self):
        self._idle = {}  # config tuple -> [mha.MultiheadAttention]

    def checkout(self, config):
        idle = self._idle.get(config)
        layer = idle.pop() if idle else None  # list.pop is atomic under the GIL
        if layer is None:
            kwargs = dict(config)
            # Dropout masks come from the layer's seed; draw it from torch's generator so that
            # torch.manual_seed governs them. Without dropout, leave torch's generator untouched.
            seed = (int(_torch.randint(0, 2**62, (1,), dtype=_torch.int64))
                    if kwargs["dropout"] > 0.0 else 0)
            layer = _mha.MultiheadAttention(**kwargs, seed=seed)
        return _Worker(self, config, layer)

    def give_back(self, config, layer):
        idle = self._idle.setdefault(config, [])
        if len(idle) < _MAX_IDLE_WORKERS:
            idle.append(layer)


class _Worker:
    """An internal mha layer checked out of a pool; it returns to the pool when this is freed
    (for a forward that autograd differentiates: when its graph is freed)."""

    def __init__(self, pool, config, layer):
        self._pool, self._config, self.layer = pool, config, layer

    def __del__(self):
        try:
            self._pool.give_back(self._config, self.layer)
        except Exception:  # interpreter shutdown: nothing to give back to
            pass


class _Call:
    """One forward in mha terms: the internal layer, NumPy views of the inputs and masks, the flags."""

    def __init__(self, worker, names, params, arrays, masks, head_gate, training, need_weights,
                 average_attn_weights, is_causal):
        self.worker = worker            # _Worker: the internal mha layer
        self.names = names              # state_dict names of params
        self.params = params            # parameter tensors (read at forward)
        self.arrays = arrays            # NumPy views (or BFloat16Bits) of query, key, value
        self.masks = masks              # {"key_padding_mask": ..., "attn_mask": ...}, NumPy or None
        self.head_gate = head_gate      # NumPy view of the gate [h] or [B, h], or None
        self.training = training        # mha's training mode: dropout, and keep what backward needs
        self.need_weights = need_weights
        self.average_attn_weights = average_attn_weights
        self.is_causal = is_causal

    def forward(self):
        """Runs the internal layer with the current parameter values; returns (out, weights or None)
        as NumPy arrays (BFloat16Bits for bfloat16), and drops the references to the inputs (the layer keeps the arrays it needs
        for backward until its next forward)."""
        layer = self.worker.layer
        layer.load_state_dict({n: _array_of(p) for n, p in zip(self.names, self.params)})
        layer.train(self.training)
        query, key, value = self.arrays
        result = layer.forward(query, key, value, need_weights=self.need_weights,
                               average_attn_weights=self.average_attn_weights,
                               is_causal=self.is_causal, head_gate=self.head_gate, **self.masks)
        self.params = self.arrays = self.masks = self.head_gate = None
        return result


class _MultiheadAttentionFunction(_torch.autograd.Function):
    """autograd's view of one mha forward: inputs (query, key, value, head_gate or None, *parameters)
    -> out (and the weights, marked non-differentiable); backward asks the layer that ran the forward."""

    @staticmethod
    def forward(ctx, call, query, key, value, head_gate, *params):
        # query, key, value, head_gate, params are here for autograd's bookkeeping; call holds their views.
        out, weights = call.forward()
        ctx.worker, ctx.names = call.worker, call.names  # the layer stays with this graph
        out = _tensor_of(out)  # shares mha's memory
        if weights is None:
            return out
        weights = _tensor_of(weights)
        ctx.mark_non_differentiable(weights)
        return out, weights

    @staticmethod
    def backward(ctx, grad_out, *grad_weights):
        # grad_out: dLoss/d attn_output, shaped like it; grad_weights: ignored (non-differentiable).
        # Grad mode is on here only under create_graph=True, i.e. for a gradient to be differentiated.
        if _torch.is_grad_enabled():
            raise RuntimeError(_NO_DOUBLE_BACKWARD)
        if _is_vmapped(grad_out):
            raise RuntimeError(_NO_BATCHED_GRADIENTS)
        grads = ctx.worker.layer.backward(_array_of(grad_out.detach()))
        wanted = ctx.needs_input_grad  # (call, query, key, value, head_gate, *params)
        inputs = [_tensor_of(grads[n]) if wanted[1 + i] else None
                  for i, n in enumerate(("query", "key", "value"))]
        gate = _tensor_of(grads["head_gate"]) if wanted[4] else None
        params = [_tensor_of(grads[n]) if wanted[5 + i] else None
                  for i, n in enumerate(ctx.names)]
        # query is key is value (self-attention): autograd sums the three gradients.
        return (None, *inputs, gate, *params)


def _is_vmapped(t):
    """Whether t is a BatchedTensor of torch's vmap (torch 1.13's Batched dispatch key; functorch's
    FuncTorchBatched in torch 2.x). torch has no public test for it."""
    dispatch_keys = getattr(_torch._C, "_dispatch_keys", None)
    return dispatch_keys is not None and "Batched" in str(dispatch_keys(t))


def _dense_cpu(t, name, what=""):
    """Raises mha.Error naming `name` unless t is a dense (strided, not nested) CPU tensor; a nested
    tensor reports torch.strided as its layout in torch 1.13, so it is asked for by is_nested."""
    if t.device.type != "cpu" or t.layout != _torch.strided or getattr(t, "is_nested", False):
        layout = "nested" if getattr(t, "is_nested", False) else str(t.layout)
        raise _mha.Error(f"{name}: mha runs on dense CPU tensors only, got {what}{t.device} {layout}")


def _array_of(t):
    """What mha's layer reads for a detached CPU tensor, on its memory (no copy): a NumPy view, or
    for torch.bfloat16 (NumPy has none) a BFloat16Bits of the memory viewed as int16 (same strides)."""
    t = t.detach()
    if t.dtype == _torch.bfloat16:
        return _mha.BFloat16Bits(t.view(_torch.int16).numpy())
    return t.numpy()


def _tensor_of(result):
    """A torch tensor on the memory of a result of mha's layer (no copy): torch.bfloat16 for a
    BFloat16Bits (its int16 bits reinterpreted), else the NumPy array's dtype."""
    if isinstance(result, _mha.BFloat16Bits):
        return _torch.from_numpy(result.bits).view(_torch.bfloat16)
    return _torch.from_numpy(result)


def _check_parameters(names, params):
    """The parameters' common dtype (torch.float32, torch.float64 or torch.bfloat16); raises mha.Error otherwise."""
    dtype = params[0].dtype
    for name, p in zip(names, params):
        if p.device.type != "cpu":
            raise _mha.Error(f"{name}: mha runs on the CPU only, got a parameter on {p.device}")
        if p.dtype not in _LAYER_DTYPE or p.dtype != dtype:
            raise _mha.Error(f"{name}: expected every parameter in one of {_DTYPE_NAMES}, "
                             f"got {p.dtype} (and {dtype} for {names[0]})")
    return dtype


def _check_input(t, name, dtype):
    """t itself, once checked to be a strided CPU tensor of the layer's dtype."""
    if not isinstance(t, _torch.Tensor):
        raise _mha.Error(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _dense_cpu(t, name)
    if t.dtype != dtype:
        raise _mha.Error(f"{name}: expected {dtype} (the layer's dtype), got {t.dtype} {list(t.shape)}")
    return t


def _check_head_gate(gate):
    """The head gate tensor itself (or None), once checked to be a dense CPU tensor; its dtype and
    shape are checked by mha (float32 or float64, [h] or [B, h])."""
    if gate is None:
        return None
    if not isinstance(gate, _torch.Tensor):
        raise _mha.Error(f"head_gate: expected a torch.Tensor, got {type(gate).__name__}")
    _dense_cpu(gate, "head_gate")
    return gate


def _bool_mask(mask: Optional[_Tensor]) -> Optional[_Tensor]:
    """An integer (byte) mask as the bool mask it means (nonzero = forbidden, as torch's module reads it);
    bool and float masks as they are."""
    if mask is None or mask.is_floating_point() or mask.dtype == _torch.bool:
        return mask
    return mask != 0


def _mask_array(mask, name):
    """A mask as a NumPy array (a view of a CPU tensor; BFloat16Bits for torch.bfloat16), or None."""
    if mask is None:
        return None
    if not isinstance(mask, _torch.Tensor):
        return np.asarray(mask)
    _dense_cpu(mask, name, "a mask on ")
    if mask.requires_grad and _torch.is_grad_enabled():
        raise _mha.Error(f"{name}: no gradient flows into masks; pass {name}.detach()")
    return _array_of(mask)
