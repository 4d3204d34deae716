"""`mha bench --grid-only` on a tiny subset of the grid (two shapes of microseconds, 1 and 2 threads): the
table, bench.json's "grid" section and the grid's targets come out, PyTorch's side included when torch and
the oneDNN shim are there. Performance is measured, not timed in tests: nothing here reads a time's value,
only that each cell has one. Takes a few seconds (mostly two Python start-ups importing torch)."""
import pathlib
import re

import pytest

from bench_run import MHA, ROOT, run_bench

SHIM = ROOT / "build" / "libmha_onednn_blas.so"
SHAPES = "1:16:64,2:8:128:2"  # B:N:E (h = E / 64 = 1) and B:N:E:h
EXPECTED = {(1, 16, 64, 1), (2, 8, 128, 2)}

pytestmark = pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built")


def torch_available():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return SHIM.exists() and pathlib.Path("/usr/bin/python3").exists()


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    with_torch = torch_available()
    args = ["--grid-only", "--grid-shapes", SHAPES, "--threads", "1,2"] + ([] if with_torch else ["--no-torch"])
    stdout, report = run_bench(args, out, "bench.json")
    return stdout, report, with_torch, out


def test_grid_prints_a_row_per_shape_and_thread_count(grid_run):
    stdout, _, with_torch, _ = grid_run
    assert "== Grid of small and mid shapes" in stdout
    header = next(line for line in stdout.splitlines() if line.split()[:5] == ["B", "N", "E", "h", "threads"])
    assert "mha fwd" in header and "torch train" in header and header.count("ratio") == 2
    rows = [line.split() for line in stdout.splitlines() if re.match(r"^\s*\d+\s+\d+\s+\d+\s+\d+\s+[12]\s+\|", line)]
    assert {(int(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows} == \
        {(*shape, threads) for shape in EXPECTED for threads in (1, 2)}
    for row in rows:
        cells = " ".join(row[5:])
        assert cells.count(" us") + cells.count(" ms") + cells.count(" s ") >= 2, row  # our two times at least
        if with_torch:
            assert len(re.findall(r"\d+\.\d\dx", cells)) == 2, row  # both ratios
    assert "ours, 2 threads against 1:" in stdout
    assert "bench.png" not in stdout  # a grid-only run draws no plot


def test_grid_json_has_every_cell(grid_run):
    _, report, with_torch, out = grid_run
    grid = report["grid"]
    assert grid["status"] == "ok"
    assert set(grid["policy"]) == {"warmup", "min_reps", "max_reps", "min_time_s", "max_time_s"}
    assert len(grid["rows"]) == 4
    for row in grid["rows"]:
        assert (row["batch"], row["n"], row["d_model"], row["heads"]) in EXPECTED
        assert row["threads"] in (1, 2)
        for side in ("mha", "torch") if with_torch else ("mha",):
            for pass_ in ("forward", "train"):
                cell = row[side][pass_]
                assert cell["status"] == "ok", cell
                assert cell["timing"]["min_s"] > 0 and cell["timing"]["reps"] >= 5
        if with_torch:
            assert row["forward_speedup"] > 0 and row["train_speedup"] > 0
        else:
            assert row["torch"]["forward"]["status"] == "skipped: --no-torch"
            assert row["forward_speedup"] is None
    assert report["core"] == [] and report["layer"] == [] and report["big"] == []
    assert not (out / "bench.png").exists()


def test_grid_targets_are_decided_and_the_others_not_measured(grid_run):
    _, report, with_torch, _ = grid_run
    targets = {t["name"]: t for t in report["targets"]}
    grid = [t for name, t in targets.items() if name.startswith("grid: ")]
    assert len(grid) == 5
    thread_target = next(t for t in grid if "2 threads never slower" in t["name"])
    assert isinstance(thread_target["met"], bool) and thread_target["measured"].startswith("worst ")
    never_slower = [t for t in grid if "never slower" in t["name"] and "2 threads" not in t["name"]]
    assert len(never_slower) == 2
    for t in never_slower:
        if with_torch:
            assert isinstance(t["met"], bool) and t["measured"].startswith("worst ") and " at B " in t["measured"]
        else:
            assert t["met"] is None
    # B*N is 16 at most here: the higher targets, from B*N 2048 up, have no cell.
    for t in grid:
        if "B*N >= 2048" in t["name"]:
            assert t["met"] is None and "not measured in this run" in t["measured"]
    others = [t for name, t in targets.items() if not name.startswith("grid: ")]
    assert others and all(t["met"] is None and "not measured in this run" in t["measured"] for t in others)


def test_only_judged_targets_are_printed(grid_run):
    """Targets the run could not measure are counted in one line, not printed as verdicts (issue 15)."""
    stdout, report, _, _ = grid_run
    targets_text = stdout.split("== Targets", 1)[1]
    unmeasured = sum(t["met"] is None for t in report["targets"])
    assert "NOT MEASURED" not in targets_text
    assert f"{unmeasured} of {len(report['targets'])} targets not measured in this run" in targets_text
    judged = [t for t in report["targets"] if t["met"] is not None]
    assert judged and all(t["name"] in targets_text for t in judged)
