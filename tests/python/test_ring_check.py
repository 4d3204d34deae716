"""`mpirun -np P mha ring-check` and `mha bench-ring` when the ranks are given different options (issue
30): mpirun's MPMD form (`-np 1 mha ring-check --n 300 : -np 1 mha ring-check --n 301`) once ran two
problems as one and reported a numerical failure ("OUTSIDE the rule", 75,787x); now every rank refuses,
and rank 0 names the rank and the option. Loopback only; each run takes a second or two."""
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MHA = ROOT / "build" / "mha"
TIMEOUT_S = 120
SMALL = ["--heads", "1", "--dim", "8"]  # a problem of a moment


def _has_ring_check():
    if not MHA.exists() or shutil.which("mpirun") is None:
        return False
    return subprocess.run([str(MHA), "ring-check", "--help"], capture_output=True, timeout=TIMEOUT_S).returncode == 0


pytestmark = pytest.mark.skipif(not _has_ring_check(), reason="build/mha without ring-check (MPI), or no mpirun")


def mpmd(command, *per_rank):
    """One rank per argument list, each running `mha COMMAND ARGS`."""
    line = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
    for i, args in enumerate(per_rank):
        line += ([":"] if i else []) + ["-np", "1", str(MHA), command, *args]
    # Without the variables of an MPI this process may have started (they confuse a new mpirun).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    return subprocess.run(line, capture_output=True, text=True, timeout=TIMEOUT_S, env=dict(env, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("ranks, message", [
    ([["--n", "300"], ["--n", "301"]], "rank 1 was given --n 301, rank 0 --n 300"),
    ([["--n", "64", "--seed", "1"], ["--n", "64", "--seed", "2"]], "rank 1 was given --seed 2, rank 0 --seed 1"),
    ([["--n", "64"], ["--n", "64", "--causal"]], "rank 1 was given --causal, rank 0 no --causal"),
    ([["--n", "64"], ["--n", "64"], ["--n", "64", "--dtype", "float64"]],
     "rank 2 was given --dtype float64, rank 0 --dtype float32"),
    ([["--n", "64"], ["--n", "64", "--layout", "contiguous"]],
     "rank 1 was given --layout contiguous, rank 0 --layout zigzag"),
])
def test_ring_check_refuses_ranks_given_different_options(ranks, message):
    result = mpmd("ring-check", *[SMALL + args for args in ranks])
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert f"mha: error: ring-check: {message}: every rank must be given the same options" in result.stderr, output
    assert "OUTSIDE the rule" not in output and "worst error" not in output, output


def test_ring_check_runs_when_the_ranks_agree_and_threads_may_differ():
    result = mpmd("ring-check", SMALL + ["--n", "64", "--threads", "1"], SMALL + ["--n", "64", "--threads", "2"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ring-check: 2 ranks, N 64" in result.stdout and "(within the rule)" in result.stdout, result.stdout


def test_bench_ring_refuses_ranks_given_different_options():
    # Different --reps would leave one rank waiting for timed runs the other never starts.
    result = mpmd("bench-ring", ["--sizes", "64", "--heads", "1", "--dim", "8", "--reps", "1"],
                  ["--sizes", "64", "--heads", "1", "--dim", "8", "--reps", "2"])
    assert result.returncode != 0, result.stdout + result.stderr
    assert "mha: error: bench-ring: rank 1 was given --reps 2, rank 0 --reps 1" in result.stderr, result.stderr
