"""`mha bench --dtype bf16` run tiny (N 256, one thread, without PyTorch): the path line names the path
that ran, a core line per head width and the layer's lines come out, and the PyTorch figures that were
not measured read "not run", never a time of 0.0 ms. Nothing here reads a time's value, only that each
row has one: performance is measured, not timed in tests. Takes a few seconds."""
import re

import pytest

from bench_run import MHA, run_bench


pytestmark = pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built")


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_bf16")
    return run_bench(["--dtype", "bf16", "--threads", "1", "--sizes", "256", "--no-torch"], out, "bench-bf16.json")


def test_names_the_path_and_prints_every_row(bf16_run):
    stdout, report = bf16_run
    assert re.search(r"the library's bf16 products: (oneDNN matmul \S+|sgemm over widened operands) \(", stdout), stdout
    for d in (64, 128):
        assert re.search(rf"^  core N 256 d {d}: bf16 forward \d+ GFLOP/s", stdout, re.M), stdout
    assert [run["what"] for run in report["runs"]] == ["core", "core", "layer"]
    layer = report["runs"][2]
    assert all(layer[key] > 0 for key in ("bf16_forward_s", "bf16_step_s", "f32_forward_s", "f32_step_s"))


def test_torch_not_run_reads_not_run(bf16_run):
    stdout, report = bf16_run
    layer_lines = [line for line in stdout.splitlines() if line.startswith("  layer N 256:")]
    assert len(layer_lines) == 3, stdout
    for line in layer_lines[:2]:
        assert "PyTorch bf16 not run (-), PyTorch float32 not run (-)" in line, line
    assert layer_lines[2].endswith("PyTorch bf16 not run, float32 not run"), layer_lines[2]
    assert " 0.0 ms" not in stdout
    assert report["runs"][2]["torch_bf16_step_s"] == 0  # the JSON keeps 0 for "not measured"
