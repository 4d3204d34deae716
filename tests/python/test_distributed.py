"""mha.distributed (ring attention over MPI, through mpi4py) and mha.torch under PyTorch's
DistributedDataParallel: each runs in several processes, started here.

  - distributed_ring_worker.py under `mpirun -np P` (P = 1, 2, 3, 4; more ranks than cores:
    --oversubscribe; as root: --allow-run-as-root): random configurations against one process (masks,
    dropout, sinks, sliding windows, ALiBi, soft-capping), and the error paths (every rank raises the
    same mha.Error).
  - distributed_ddp_worker.py as 2 gloo processes on localhost against 1 process on the whole batch.
"""
import importlib.util
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pathlib.Path(__import__("mha").__file__).parents[1]),
                                                    env.get("PYTHONPATH")) if p)
    return env


def _has_ring():
    """Whether mha._distributed was built and mpirun is there. Not imported here: importing it starts
    MPI in this process (mpi4py initialises on import), whose environment variables then confuse every
    mpirun started from this process later (README's example failed silently that way)."""
    return importlib.util.find_spec("mha._distributed") is not None and shutil.which("mpirun") is not None


def run_ring_worker(ranks, cases):
    """distributed_ring_worker.py under mpirun on `ranks` ranks with `cases` random configurations; it
    prints "ring worker ok" when every check held."""
    result = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), sys.executable,
                             str(HERE / "distributed_ring_worker.py"), str(cases)],
                            capture_output=True, text=True, timeout=300, env=_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ring worker ok" in result.stdout


@pytest.mark.skipif(not _has_ring(), reason="mha.distributed or mpirun missing (scripts/install-deps.sh installs both)")
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_ring_attention_matches_one_process(ranks):
    run_ring_worker(ranks, 40)


@pytest.mark.skipif(not _has_ring(), reason="mha.distributed or mpirun missing")
@pytest.mark.parametrize("ranks", [2, 3])
def test_mismatch_messages_name_values_and_the_rank_at_fault(ranks):
    run_ring_worker(ranks, 0)  # no random cases: the error paths alone, mismatch_messages() among them


@pytest.mark.skipif(not _has_ring(), reason="mha.distributed or mpirun missing")
def test_the_python_example_runs():
    example = HERE.parents[1] / "examples" / "distributed" / "ring_attention.py"
    result = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable,
                             str(example)], capture_output=True, text=True, timeout=300, env=_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    differences = [float(x) for x in re.findall(r"by ([0-9.e+-]+)", result.stdout)]
    assert "2 ranks: out differs by" in result.stdout and len(differences) == 2, result.stdout
    assert all(d < 1e-5 for d in differences), result.stdout


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(world, out):
    env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
    processes = [subprocess.Popen([sys.executable, str(HERE / "distributed_ddp_worker.py"), str(out)],
                                  env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
    for p in processes:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stdout[-2000:] + stderr[-2000:]
    return dict(np.load(out))


def test_distributed_data_parallel_matches_one_process_on_the_whole_batch(tmp_path):
    two = _train(2, tmp_path / "two.npz")
    one = _train(1, tmp_path / "one.npz")
    assert sorted(two) == sorted(one) and any(name.startswith("attention.") for name in one)
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=0, atol=1e-12, err_msg=name)
    initial = _initial_parameters()
    assert any(not np.allclose(one[name], initial[name]) for name in one), "training changed nothing"


def _initial_parameters():
    import torch
    sys.path.insert(0, str(HERE))
    torch.manual_seed(0)
    import mha.torch
    attention = mha.torch.MultiheadAttention(16, 2, batch_first=True, dtype=torch.float64)
    head = torch.nn.Linear(16, 1, dtype=torch.float64)
    params = {f"attention.{n}": p.detach().numpy() for n, p in attention.named_parameters()}
    params.update({f"head.{n}": p.detach().numpy() for n, p in head.named_parameters()})
    return params
