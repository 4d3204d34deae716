"""Run under mpirun by test_distributed.py: ring attention (mha.distributed) on this run's ranks against
the single-process call, on random configurations every rank draws alike (awkward sizes, both layouts,
causal or not, padding, key lengths, dropout, sinks, sliding windows, ALiBi, soft-capping, float32 and
float64, non-contiguous and negative-stride shards), plus the error paths. Prints "ring worker ok" on
success; any failure raises (exit status 1)."""
import sys

import numpy as np
from mpi4py import MPI

import mha
import mha.distributed as dist

comm = MPI.COMM_WORLD
P, rank = comm.size, comm.rank


def awkward_strides(x, rng):
    """The same values in a differently laid out array: transposed memory, reversed rows, or plain."""
    kind = rng.integers(3)
    if kind == 0:
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if kind == 1:
        return np.flip(np.ascontiguousarray(np.flip(x, 2)), 2)  # negative row stride
    return x


def max_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaN positions differ"
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)]), "infinities differ"
    return float(np.max(np.abs(got[finite] - want[finite]), initial=0.0)), float(np.max(np.abs(want[finite]), initial=1.0))


def one_case(seed):
    rng = np.random.default_rng(seed)
    dtype = np.float32 if rng.integers(2) else np.float64
    causal = bool(rng.integers(2))
    B, h = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    L = int(rng.integers(1, 90))
    S = L if causal else int(rng.integers(1, 90))
    d_k, d_v = int(rng.integers(1, 20)), int(rng.integers(1, 20))
    layout = ["zigzag", "contiguous"][rng.integers(2)]
    q, k, v, dout = (rng.standard_normal(s).astype(dtype) for s in
                     ((B, h, L, d_k), (B, h, S, d_k), (B, h, S, d_v), (B, h, L, d_v)))
    padding = rng.random((B, S)) < 0.3 if rng.integers(3) == 0 else None
    lengths = [int(n) for n in rng.integers(0, S + 1, B)] if rng.integers(3) == 0 else None
    dropout = 0.25 if rng.integers(4) == 0 else 0.0
    sinks = (rng.standard_normal(h) * 2).astype(dtype) if rng.integers(3) == 0 else None
    # The score's variants at whole-sequence positions: a window (either side -1, unbounded, or narrow
    # enough to hide whole chunks), ALiBi slopes, a soft cap; each in about half the cases.
    reach = max(L, S) // 2 + 2
    window = (int(rng.integers(-1, reach)), int(rng.integers(-1, reach))) if rng.integers(2) else None
    slopes = (rng.random(h) * 0.5).astype([np.float32, np.float64][rng.integers(2)]) if rng.integers(2) else None
    softcap = float(rng.uniform(0.5, 5.0)) if rng.integers(3) == 0 else 0.0
    options = dict(key_padding_mask=padding, key_lengths=lengths, dropout_p=dropout, dropout_seed=seed, sinks=sinks,
                   window=window, alibi_slopes=slopes, softcap=softcap)

    def single(x, kernel):
        out, lse = mha.scaled_dot_product_attention(*x[:3], is_causal=causal, need_lse=True, kernel=kernel, **options)
        grads = mha.scaled_dot_product_attention_backward(x[3], *x[:3], out, lse, is_causal=causal,
                                                          kernel=kernel, **options)
        return (out, lse) + tuple(grads)

    ref = single([a.astype(np.float64) for a in (q, k, v, dout)], "reference")
    one = single([q, k, v, dout], "flash")

    def shard(x, n_dim=2):
        return awkward_strides(dist.shard_sequence(x, n_dim, P, rank, layout), rng) if x.ndim == 4 else \
            dist.shard_sequence(x, n_dim, P, rank, layout)
    q_r, k_r, v_r, dout_r = (shard(a) for a in (q, k, v, dout))
    ring_options = dict(options, causal=causal, layout=layout,
                        key_padding_mask=None if padding is None else dist.shard_sequence(padding, 1, P, rank, layout))
    out_r, lse_r = dist.ring_attention(q_r, k_r, v_r, comm, **ring_options)
    grads_r = dist.ring_attention_backward(dout_r, q_r, k_r, v_r, out_r, lse_r, comm, **ring_options)
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")  # dsinks [h], with sinks: the whole sequence's on every rank
    for name, got, want, single_one in zip(names, (out_r, lse_r) + tuple(grads_r), ref, one):
        if name == "dsinks":
            assert comm.allgather(got.tobytes()) == [got.tobytes()] * P, "ranks got different dsinks"
        whole = name == "dsinks"
        want_r = want if whole else dist.shard_sequence(want, 2, P, rank, layout)
        single_r = single_one if whole else dist.shard_sequence(single_one, 2, P, rank, layout)
        error, magnitude = max_error(got, want_r)
        if dtype == np.float64:
            allowed = 1e-12 * magnitude
        else:
            allowed = 4 * max_error(single_r, want_r)[0] + 1e-5 * magnitude
        assert error <= allowed, (f"seed {seed} rank {rank}/{P}: {name} error {error} > {allowed} "
                                  f"(B {B} h {h} L {L} S {S} d {d_k},{d_v} causal {causal} {layout} {dtype.__name__} "
                                  f"padding {padding is not None} lengths {lengths} dropout {dropout} sinks {sinks} "
                                  f"window {window} slopes {slopes} softcap {softcap})")


def minus_inf_keys_case(seed):
    """Keys whose logits are -inf for every query (an infinite component against q's sign) have weight 0:
    a row with other keys stays finite, one whose every key is such is 0 / 0 (NaN), in the ring as in one
    call, however the keys fall on the ranks (a rank holding only such keys once made its rows NaN)."""
    rng = np.random.default_rng(1000 + seed)
    dtype = np.float32 if rng.integers(2) else np.float64
    B, h, L, d = 1, 2, int(rng.integers(2, 30)), 4
    q = (np.abs(rng.standard_normal((B, h, L, d))) + 0.1).astype(dtype)
    k, v = rng.standard_normal((B, h, L, d)).astype(dtype), rng.standard_normal((B, h, L, d)).astype(dtype)
    hidden = rng.random(L) < (1.0 if seed % 4 == 0 else 0.6)  # every key -inf in one case of four
    k[:, :, hidden, 0] = -np.inf
    layout = ["zigzag", "contiguous"][rng.integers(2)]
    causal = bool(rng.integers(2))
    for kernel in ("reference", "flash"):
        out, lse = mha.scaled_dot_product_attention(q, k, v, is_causal=causal, need_lse=True, kernel=kernel)
        q_r, k_r, v_r = (dist.shard_sequence(x, 2, P, rank, layout) for x in (q, k, v))
        out_r, lse_r = dist.ring_attention(q_r, k_r, v_r, comm, causal=causal, layout=layout, kernel=kernel)
        for name, got, want in (("out", out_r, out), ("lse", lse_r, lse)):
            error, magnitude = max_error(got, dist.shard_sequence(want, 2, P, rank, layout))
            assert error <= 1e-5 * magnitude, (seed, kernel, name, error, layout, causal, hidden)


def errors():
    x = dist.shard_sequence(np.ones((1, 2, 20, 8), np.float32), 2, P, rank)
    bad = x.astype(np.float64) if rank == P - 1 else x  # one rank's dtype differs (or, alone, is fine)
    messages = []
    for call in (lambda: dist.ring_attention(x, bad, x, comm),
                 lambda: dist.ring_attention(x, x, x, comm, layout="diagonal"),
                 lambda: dist.ring_attention(x, x, x, comm, key_lengths=[21]),
                 lambda: dist.ring_attention(x, x, x, comm, attn_mask=np.zeros((20, 20), np.bool_)),
                 lambda: dist.ring_attention(x, x, x, comm, softcap=1e39),
                 lambda: dist.ring_attention(x, x, x, comm, window=(-2, 3)),
                 lambda: dist.ring_attention(x, x, x, comm, alibi_slopes=np.ones(3, np.float32)),
                 lambda: dist.ring_attention_backward(x, x, x, x, x, x[..., 0], comm, attn_mask=np.zeros((20, 20)))):
        try:
            call()
            messages.append(None)
        except mha.Error as e:
            messages.append(str(e))
    assert messages[0] is not None and f"rank {P - 1}: " in messages[0], messages[0]
    assert messages[1] is not None and "layout" in messages[1], messages[1]
    assert messages[2] is not None and "key_lengths: expected lengths in [0, S = 20], got 21" in messages[2], messages[2]
    assert messages[3] == "ring_attention: rank 0: attn_mask: not taken across ranks (a per-position mask would " \
        "need L_r x S memory per rank); use causal, a window, key_padding_mask or key_lengths", messages[3]
    assert messages[4] is not None and messages[4].startswith(
        "ring_attention: rank 0: softcap: expected 0 (none) or a finite number in "), messages[4]
    assert messages[5] is not None and messages[5].startswith(
        "ring_attention: rank 0: window: expected extents >= 0, or -1 for unbounded"), messages[5]
    assert messages[6] is not None and messages[6].startswith(
        "ring_attention: rank 0: alibi_slopes: expected one slope per query head"), messages[6]
    assert messages[7] is not None and messages[7].startswith(
        "ring_attention_backward: rank 0: attn_mask: not taken across ranks"), messages[7]
    assert comm.allgather(messages) == [messages] * P, "ranks raised different errors"
    try:
        dist.ring_attention(x, x, x, "not a communicator")
        raise AssertionError("a string was taken as a communicator")
    except TypeError:
        pass
    out, _ = dist.ring_attention(x, x, x, comm)  # and the ring still works
    assert out.shape == x.shape


def mismatch_messages():
    """Ranks that disagree are told what differs by name (float64, not 1), and a wrong shard is blamed on
    the rank that holds it, not on a rank whose shard only looks wrong beside it (issue 30)."""
    x = dist.shard_sequence(np.ones((1, 2, 20, 8), np.float32), 2, P, rank)
    short = x[:, :, :-3] if rank == 1 else x  # rank 1's rows three short (10 and 7 of 20 on two ranks)

    def error_of(call):
        try:
            call()
        except mha.Error as e:
            return str(e)
        return None
    wide = x.astype(np.float64) if rank == 1 else x
    messages = [error_of(lambda: dist.ring_attention(wide, wide, wide, comm)),
                error_of(lambda: dist.ring_attention(x, x, x, comm, layout="contiguous" if rank == 1 else "zigzag")),
                error_of(lambda: dist.ring_attention(x, x, x, comm, kernel="reference" if rank == 1 else "flash")),
                error_of(lambda: dist.ring_attention(short, x, x, comm)),  # the queries short
                error_of(lambda: dist.ring_attention(short, short, short, comm)),  # as if cut from 17 rows
                error_of(lambda: dist.ring_attention(x, x, x, comm, sinks=np.array([0.5, float(rank == 1)]))),
                error_of(lambda: dist.ring_attention(x, x, x, comm, window=(3, -1) if rank == 1 else None)),
                error_of(lambda: dist.ring_attention(x, x, x, comm, window=(4, 2 + (rank == 1)))),
                error_of(lambda: dist.ring_attention(x, x, x, comm, softcap=2.0 if rank == 1 else 0.0)),
                error_of(lambda: dist.ring_attention(x, x, x, comm,
                                                     alibi_slopes=np.array([0.5, 0.25]) if rank == 1 else None)),
                error_of(lambda: dist.ring_attention(x, x, x, comm, alibi_slopes=np.array([0.5, 0.25 + (rank == 1)])))]
    assert comm.allgather(messages) == [messages] * P, "ranks raised different errors"
    expected = ["ring_attention: rank 1: differs from rank 0 in dtype float64, rank 0 float32",
                "ring_attention: rank 1: differs from rank 0 in layout contiguous, rank 0 zigzag",
                "ring_attention: rank 1: differs from rank 0 in kernel reference, rank 0 flash",
                "ring_attention: rank 1: holds 7 query and 10 key rows" if P == 2 else "ring_attention: rank 1: holds",
                "ring_attention: rank 1: holds",
                "ring_attention: rank 1: differs from rank 0 in sinks (a digest)",
                "ring_attention: rank 1: differs from rank 0 in window_left 3, rank 0 -1",
                "ring_attention: rank 1: differs from rank 0 in window_right 3, rank 0 2",
                "ring_attention: rank 1: differs from rank 0 in softcap 2, rank 0 0",
                "ring_attention: rank 1: differs from rank 0 in alibi_slopes given, rank 0 not given",
                "ring_attention: rank 1: differs from rank 0 in alibi_slopes (a digest)"]
    for message, start in zip(messages, expected):
        assert message is not None and message.startswith(start), (start, message)
    full = np.arange(40.0).reshape(2, 20)
    shards = [dist.shard_sequence(full, 1, P, r) for r in range(P)]
    shards[1] = shards[1][:, :-3]
    message = error_of(lambda: dist.unshard_sequence(shards, 1))
    assert message is not None and message.startswith("shards: shard 1 has "), message


for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 40):
    one_case(seed)
    minus_inf_keys_case(seed)
errors()
if P >= 2:
    mismatch_messages()
comm.Barrier()
if rank == 0:
    print("ring worker ok")
