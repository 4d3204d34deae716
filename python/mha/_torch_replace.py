"""mha.torch.replace_attention: swap every torch.nn.MultiheadAttention in a model for mha's.

    model = torch.nn.Transformer(d_model=512, nhead=8, batch_first=True)
    count = mha.torch.replace_attention(model)   # 12: 6 encoder self_attn, 6 decoder self_attn + multihead_attn
    out = model(src, tgt, tgt_mask=mask)         # the same model, attention computed by mha

torch's own Transformer layers have fast paths that compute attention without calling their
``self_attn`` module; this file also switches those off where the module is mha's (see
:func:`replace_attention`). Kept apart from mha/torch.py (the module itself): one concern per file.

Legend: E = embed_dim, h heads.
"""

import torch as _torch

import mha as _mha

__all__ = ["replace_attention"]

# The dtypes mha.torch.MultiheadAttention computes in.
_DTYPES = (_torch.float32, _torch.float64, _torch.bfloat16)

# torch.nn.Module's forward hook registries (the last three exist from torch 2.0 on).
_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def replace_attention(model):
    """Replaces every ``torch.nn.MultiheadAttention`` inside ``model`` by an
    ``mha.torch.MultiheadAttention`` holding the same parameters; returns how many it replaced.

    Args:
        model: a ``torch.nn.Module`` (not itself a MultiheadAttention: it has no parent to be
            swapped in; build ``mha.torch.MultiheadAttention`` and ``load_state_dict`` instead).

    Returns:
        The number of distinct modules replaced (a module reached by two paths, e.g. shared
        between layers, is replaced once, by one new module, at both places).

    What the new module keeps from the old one:
        * the constructor options: embed_dim, num_heads, dropout, bias, add_bias_kv,
          add_zero_attn, kdim, vdim, batch_first;
        * the parameters themselves: the new module holds the very same ``torch.nn.Parameter``
          objects (and the same ``out_proj`` Linear), so dtype, values, ``requires_grad``, tying
          and an optimizer built before the call are all kept, and ``model.state_dict()`` has the
          same keys, shapes and values as before;
        * the training mode, and the forward hooks and pre-hooks registered on the old module.
    Only modules whose type is exactly ``torch.nn.MultiheadAttention`` are replaced: a subclass
    (e.g. torch.ao's quantizable one) may change the forward, so it is left as it is.

    torch's fast paths are switched off where they would bypass mha's module. In eval mode with
    gradients off, ``torch.nn.TransformerEncoderLayer.forward`` (torch 1.13) may skip its
    ``self_attn`` and call ``torch._transformer_encoder_layer_fwd`` on ``self_attn``'s parameters;
    it does so only when every check in a list passes, one of which is
    ``activation_relu_or_gelu`` (an int torch stores at construction, 1 for relu, 2 for gelu,
    read by nothing but the fast path's checks and its gelu flag). Setting it to 0 on each
    encoder layer whose ``self_attn`` is mha's fails that check, so the layer runs its ordinary
    forward (``self_attn``, then the feed-forward, with ``self.activation``, which is untouched)
    in train and eval mode alike. The same attribute of ``layers[0]`` also gates
    ``torch.nn.TransformerEncoder``'s nested-tensor path (which would hand the layers a nested
    tensor); each encoder holding an mha layer also gets ``enable_nested_tensor = False`` (and
    ``use_nested_tensor = False`` where torch has it), the switch torch gives users for it. The
    decoder layers have no fast path in torch 1.13. These are plain attributes, not state: the
    state_dict does not change, and copy.deepcopy / pickling keep them.

    Raises:
        mha.Error (a ValueError) naming the module's path, before anything is replaced, for a
        module mha cannot compute: parameters off the CPU or in a dtype other than float32,
        float64 or bfloat16; and for a ``model`` that is not a torch.nn.Module, is a
        MultiheadAttention itself, or is a TorchScript module.
    """
    from mha.torch import MultiheadAttention  # here, not at import: mha.torch imports this file

    _check_model(model)
    old_modules = [(path, module) for path, module in model.named_modules()
                   if type(module) is _torch.nn.MultiheadAttention]
    for path, module in old_modules:
        _check_replaceable(path, module)
    new_of = {id(module): _replacement(module, MultiheadAttention) for _, module in old_modules}
    # named_modules lists each module once; a module held by several parents is swapped in each.
    for parent in model.modules():
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in new_of:
                setattr(parent, name, new_of[id(child)])
    _disable_fast_paths(model, MultiheadAttention)
    return len(new_of)


def _check_model(model):
    """Raises mha.Error unless model is an eager torch.nn.Module with a place for its children."""
    if not isinstance(model, _torch.nn.Module):
        raise _mha.Error(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, _torch.jit.ScriptModule):
        raise _mha.Error("model: a TorchScript module cannot have its submodules replaced; call "
                         "replace_attention on the eager model before torch.jit.script / trace")
    if type(model) is _torch.nn.MultiheadAttention:
        raise _mha.Error("model: is itself a torch.nn.MultiheadAttention, which has no parent to swap it in; "
                         "build mha.torch.MultiheadAttention with the same arguments and load its state_dict")


def _check_replaceable(path, module):
    """Raises mha.Error naming the module's path unless mha can compute it (CPU, one mha dtype)."""
    for name, p in module.named_parameters():
        if p.device.type != "cpu":
            raise _mha.Error(f"{path}.{name}: mha runs on the CPU only, got a parameter on {p.device}")
        if p.dtype not in _DTYPES:
            raise _mha.Error(f"{path}.{name}: mha computes in torch.float32, torch.float64 or torch.bfloat16, "
                             f"got {p.dtype}")


def _replacement(old, module_class):
    """An mha.torch.MultiheadAttention with old's options, holding old's Parameter objects."""
    dtype = old.out_proj.weight.dtype
    # The new module initialises parameters that are dropped at once; fork the generator so that
    # the call leaves torch's random numbers where they were.
    with _torch.random.fork_rng(devices=[]):
        new = module_class(old.embed_dim, old.num_heads, dropout=old.dropout,
                           bias=old.in_proj_bias is not None, add_bias_kv=old.bias_k is not None,
                           add_zero_attn=old.add_zero_attn, kdim=old.kdim, vdim=old.vdim,
                           batch_first=old.batch_first, dtype=dtype)
    for name, p in old._parameters.items():  # in_proj_weight or q/k/v_proj_weight, biases
        if p is not None:
            setattr(new, name, p)
    new.out_proj = old.out_proj  # the same NonDynamicallyQuantizableLinear type in both
    new_shapes = {k: v.shape for k, v in new.state_dict().items()}
    old_shapes = {k: v.shape for k, v in old.state_dict().items()}
    assert new_shapes == old_shapes, (new_shapes, old_shapes)
    new.train(old.training)
    # The hook dictionaries themselves, so that a handle from before the call still removes its hook.
    for hooks in _FORWARD_HOOK_DICTS:
        if hasattr(old, hooks):
            setattr(new, hooks, getattr(old, hooks))
    return new


def _disable_fast_paths(model, module_class):
    """Switches off torch's encoder fast paths wherever a layer's self_attn is mha's (see replace_attention)."""
    for module in model.modules():
        if isinstance(module, _torch.nn.TransformerEncoderLayer) and isinstance(module.self_attn, module_class):
            module.activation_relu_or_gelu = 0
        if isinstance(module, _torch.nn.TransformerEncoder) and any(
                isinstance(getattr(layer, "self_attn", None), module_class) for layer in module.layers):
            module.enable_nested_tensor = False
            if hasattr(module, "use_nested_tensor"):
                module.use_nested_tensor = False
