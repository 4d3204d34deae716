"""Started by test_distributed.py as RANK of WORLD_SIZE processes (env: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT): trains a small model built on mha.torch.MultiheadAttention for a few SGD steps inside
torch.nn.parallel.DistributedDataParallel over gloo, each rank on its share of one fixed batch, and
saves the final parameters to OUT (argv[1]) from rank 0. With WORLD_SIZE=1 it is the single process on
the combined batch that the test compares against."""
import os
import sys

import numpy as np
import torch
import torch.distributed as torch_dist

import mha.torch

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch_dist.init_process_group("gloo", rank=rank, world_size=world)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = mha.torch.MultiheadAttention(16, 2, batch_first=True, dtype=torch.float64)
        self.head = torch.nn.Linear(16, 1, dtype=torch.float64)

    def forward(self, x):
        out, _ = self.attention(x, x, x, need_weights=False)
        return self.head(out).mean(dim=(1, 2))


torch.manual_seed(0)  # the same initial parameters everywhere (DDP also broadcasts rank 0's)
model = torch.nn.parallel.DistributedDataParallel(Model()) if world > 1 else Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(1)
batch = torch.randn(8, 5, 16, generator=generator, dtype=torch.float64)  # the combined batch, B = 8
target = torch.randn(8, generator=generator, dtype=torch.float64)
share = slice(rank * 8 // world, (rank + 1) * 8 // world)
for step in range(5):
    optimizer.zero_grad()
    # DDP averages the ranks' gradients: each rank's mean over its equal share averages to the
    # combined batch's mean.
    loss = ((model(batch[share]) - target[share]) ** 2).mean()
    loss.backward()
    optimizer.step()
if rank == 0:
    module = model.module if world > 1 else model
    np.savez(sys.argv[1], **{name: p.detach().numpy() for name, p in module.named_parameters()})
torch_dist.destroy_process_group()
