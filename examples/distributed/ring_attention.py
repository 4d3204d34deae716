"""Ring attention over MPI from Python: causal self-attention over a sequence cut among the ranks,
forward and backward, checked against one process on rank 0. Run it with

    PYTHONPATH=build/python mpirun -np 2 /usr/bin/python3 examples/distributed/ring_attention.py

(as root add --allow-run-as-root; with more ranks than cores, --oversubscribe). tests/python/
test_distributed.py runs it."""
import numpy as np
from mpi4py import MPI

import mha
import mha.distributed as dist

comm = MPI.COMM_WORLD
rng = np.random.default_rng(0)  # every rank draws the same whole sequence here; real code loads its shard
B, h, N, d = 1, 4, 1000, 64
q, k, v, dout = (rng.standard_normal((B, h, N, d), dtype=np.float32) for _ in range(4))

# This rank's rows (the zigzag layout: two chunks, one from each end, so causal work is balanced).
q_r, k_r, v_r, dout_r = (dist.shard_sequence(x, 2, comm.size, comm.rank) for x in (q, k, v, dout))
out_r, lse_r = dist.ring_attention(q_r, k_r, v_r, comm, causal=True)
dq_r, dk_r, dv_r = dist.ring_attention_backward(dout_r, q_r, k_r, v_r, out_r, lse_r, comm, causal=True)

# Rank 0 joins the shards (gather is collective: every rank calls it) and compares with one process.
out_shards, dk_shards = comm.gather(out_r), comm.gather(dk_r)
if comm.rank == 0:
    out, dk = dist.unshard_sequence(out_shards, 2), dist.unshard_sequence(dk_shards, 2)
    want, lse = mha.scaled_dot_product_attention(q, k, v, is_causal=True, need_lse=True)
    _, want_dk, _ = mha.scaled_dot_product_attention_backward(dout, q, k, v, want, lse, is_causal=True)
    print(f"{comm.size} ranks: out differs by {np.abs(out - want).max():.1e}, dk by {np.abs(dk - want_dk).max():.1e}")
