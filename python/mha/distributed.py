"""Ring attention over MPI: each rank holds one shard of the sequence, and the key/value shards travel
around the ring (Liu et al. 2023). Exact: the result of one process. The communicator is an mpi4py
``Comm``; run under ``mpirun``::

    from mpi4py import MPI
    import mha, mha.distributed as dist

    comm = MPI.COMM_WORLD
    q_r = dist.shard_sequence(q, 2, comm.size, comm.rank)          # [B, h, L_r, d_k]: this rank's rows
    k_r, v_r = (dist.shard_sequence(x, 2, comm.size, comm.rank) for x in (k, v))
    out_r, lse_r = dist.ring_attention(q_r, k_r, v_r, comm, causal=True)
    dq_r, dk_r, dv_r = dist.ring_attention_backward(dout_r, q_r, k_r, v_r, out_r, lse_r, comm, causal=True)
    out = dist.unshard_sequence(comm.allgather(out_r), 2)          # the whole output, where wanted

Layouts: ``"zigzag"`` (the default: rank r holds chunk r and chunk 2P-1-r of 2P chunks, which balances
causal attention) or ``"contiguous"`` (chunk r of P). ``shard_chunks`` says which rows a rank holds.
Every rank must make each call; a bad or inconsistent argument on any rank raises the same mha.Error
on every rank, before any message is exchanged. See include/mha/distributed.hpp for the rules.
"""
import numpy as np

from . import Error, _kernel_arg, _key_lengths, _variants, Kernel

try:
    from . import _distributed
except ImportError as e:  # built only where MPI and mpi4py were found
    raise ImportError("mha.distributed is not built: it needs Open MPI and mpi4py at build time "
                      "(Debian: libopenmpi-dev openmpi-bin python3-mpi4py; scripts/install-deps.sh)") from e

__all__ = ["ring_attention", "ring_attention_backward", "shard_chunks", "shard_sequence", "unshard_sequence"]


def _layout(layout):
    if isinstance(layout, _distributed.Layout):
        return layout
    if isinstance(layout, str) and layout in _distributed.Layout.__members__:
        return _distributed.Layout.__members__[layout]
    raise Error(f"layout: expected \"zigzag\" or \"contiguous\", got {layout!r}")


def shard_chunks(n, ranks, rank, layout="zigzag"):
    """The chunks (start, length) of a sequence of n rows that rank `rank` of `ranks` holds, in the
    order its shard stores them."""
    return _distributed.shard_chunks(int(n), int(ranks), int(rank), _layout(layout))


def shard_sequence(full, dim, ranks, rank, layout="zigzag"):
    """Rank `rank`'s shard of `full` along dimension `dim` (a new array)."""
    full = np.asarray(full)
    if not -full.ndim <= dim < full.ndim:
        raise Error(f"dim: {dim} is outside an array of {full.ndim} dimensions")
    rows = [np.arange(start, start + length) for start, length in shard_chunks(full.shape[dim], ranks, rank, layout)]
    return np.ascontiguousarray(np.take(full, np.concatenate(rows).astype(np.int64), axis=dim))


def _rows_of_rank(n, ranks, rank, layout):
    return sum(length for _, length in shard_chunks(n, ranks, rank, layout))


def _likeliest_length(rows, layout):
    """The whole length that shards of rows[r] rows most likely came from, so that an error names the
    shard that is wrong (their sum, which holds the wrong shard too, can blame another): the length
    whose layout the most shards fit; on a tie one that shard 0 fits, then one under which the first
    shard that does not fit is the odd one out, then the nearest to the sum. As the library's
    likeliest_length (src/distributed/agreement.hpp), which names the rank in ring_attention's errors."""
    ranks, total = len(rows), sum(rows)
    if all(_rows_of_rank(total, ranks, r, layout) == c for r, c in enumerate(rows)):
        return total
    holders = {c: rows.count(c) for c in rows}
    counts = sorted(holders, key=lambda c: (-holders[c], c))[:4] + [rows[0]]
    candidates = {total} | {n for c in counts for n in range(max(0, (c - 2) * ranks), (c + 2) * ranks + 1)}

    def score(n):
        misfits = [r for r, c in enumerate(rows) if _rows_of_rank(n, ranks, r, layout) != c]
        first = misfits[0] if misfits else None
        return (ranks - len(misfits), first != 0, 0 if first is None else -holders[rows[first]], -abs(n - total), -n)
    return max(candidates, key=score)


def unshard_sequence(shards, dim, layout="zigzag"):
    """The whole sequence from every rank's shard (shards[r] is rank r's), along `dim`."""
    shards = [np.asarray(s) for s in shards]
    if not shards:
        raise Error("shards: expected one shard per rank, got none")
    n = _likeliest_length([s.shape[dim] for s in shards], layout)
    pieces = []
    for r, s in enumerate(shards):
        chunks = shard_chunks(n, len(shards), r, layout)
        if sum(length for _, length in chunks) != s.shape[dim]:
            raise Error(f"shards: shard {r} has {s.shape[dim]} rows in dim {dim}; the layout of the {n} rows that "
                        f"the shards fit best gives it {sum(length for _, length in chunks)}")
        local = 0
        for start, length in chunks:
            pieces.append((start, np.take(s, np.arange(local, local + length), axis=dim)))
            local += length
    pieces.sort(key=lambda piece: piece[0])
    return np.concatenate([p for _, p in pieces], axis=dim)


def _options(causal, scale, layout, key_padding_mask, key_lengths, dropout_p, dropout_seed, kernel, sinks=None,
             window=None, alibi_slopes=None, softcap=0.0, attn_mask=None):
    if key_padding_mask is not None:
        key_padding_mask = np.asarray(key_padding_mask)
        if key_padding_mask.dtype != np.bool_:
            raise Error(f"key_padding_mask: ring attention takes a boolean mask [B, S_r], got {key_padding_mask.dtype}")
    kernel = _kernel_arg(kernel)
    # window and softcap as given (_distributed converts them, naming what is not two 64-bit integers or
    # a real number); attn_mask other than None reaches the library, which refuses it on every rank.
    return dict(causal=bool(causal), scale=scale, layout=_layout(layout), key_padding_mask=key_padding_mask,
                key_lengths=_key_lengths(key_lengths), dropout_p=dropout_p, dropout_seed=dropout_seed,
                kernel=Kernel.flash if kernel is None else kernel,
                attn_mask=None if attn_mask is None else np.asarray(attn_mask),
                **_variants(window, alibi_slopes, softcap, sinks))


def ring_attention(q, k, v, comm, *, causal=False, scale=None, layout="zigzag", key_padding_mask=None,
                   key_lengths=None, dropout_p=0.0, dropout_seed=0, kernel=None, sinks=None, window=None,
                   alibi_slopes=None, softcap=0.0, attn_mask=None):
    """This rank's rows of softmax(q k^T * scale + masks) v over the whole sequence.

    Args:
        q: this rank's queries [B, h, L_r, d_k]; k, v: its keys [B, h, S_r, d_k] and values
            [B, h, S_r, d_v] (float32 or float64), as the layout cuts the sequence.
        comm: an mpi4py communicator; every rank of it must call.
        causal: causal over the whole sequence (needs L == S).
        scale: None (1 / sqrt(d_k)) or 0 or a normal finite number of q's dtype, as
            mha.scaled_dot_product_attention takes it.
        key_padding_mask: boolean [B, S_r], True = padding, for this rank's keys.
        key_lengths: B lengths over the whole sequence (the same on every rank).
        dropout_p, dropout_seed: dropout, drawn at global positions (the single-process mask).
        kernel: "flash" (default) or "reference", the kernel each block runs.
        sinks: attention sinks [h] (float32 or float64, the same on every rank), as
            mha.scaled_dot_product_attention takes them; each row's sink joins once.
        window: a sliding window (left, right) over the whole sequence's positions (query i at
            i + S - L, as in one call; -1 leaves a side unbounded); key chunks outside it are skipped.
        alibi_slopes: ALiBi, [h] float slopes (the same on every rank): -slope[head] * |i' - j| at the
            whole sequence's positions.
        softcap: logit soft-capping (> 0), as mha.scaled_dot_product_attention takes it; 0 or None: none.
        attn_mask: not taken across ranks (it would need L_r x S memory per rank): anything but None
            raises mha.Error on every rank.

    Every rank must pass the same options (key_padding_mask excepted: its own keys'); one that differs
    raises mha.Error on every rank naming the option and the rank.

    Returns:
        (out [B, h, L_r, d_v], lse [B, h, L_r]): keep lse for ring_attention_backward.
    """
    options = _options(causal, scale, layout, key_padding_mask, key_lengths, dropout_p, dropout_seed, kernel, sinks,
                       window, alibi_slopes, softcap, attn_mask)
    return _distributed.ring_attention(q, k, v, comm, **options)


def ring_attention_backward(dout, q, k, v, out, lse, comm, *, causal=False, scale=None, layout="zigzag",
                            key_padding_mask=None, key_lengths=None, dropout_p=0.0, dropout_seed=0, kernel=None,
                            sinks=None, window=None, alibi_slopes=None, softcap=0.0, attn_mask=None):
    """The gradients (dq [B, h, L_r, d_k], dk [B, h, S_r, d_k], dv [B, h, S_r, d_v]) of this rank's
    shards, given dout (dLoss/dout of its rows) and the forward's out and lse, with the forward's
    options (window, alibi_slopes and softcap too); with sinks also dsinks [h] (the whole sequence's,
    the same on every rank)."""
    options = _options(causal, scale, layout, key_padding_mask, key_lengths, dropout_p, dropout_seed, kernel, sinks,
                       window, alibi_slopes, softcap, attn_mask)
    return _distributed.ring_attention_backward(dout, q, k, v, out, lse, comm, **options)
