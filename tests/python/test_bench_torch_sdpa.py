"""`mha bench --torch-sdpa` run tiny (N 256, 1 thread, one timed call per figure): the header names the machine
and torch's BLAS, every row of the speed-and-memory table and of the overhead table comes out, on stdout and in
bench-torch-sdpa.json, each printed ratio is the ratio of the printed figures, and the target lines agree with
the JSON. Performance is measured, not judged, here: no time or ratio's value is asserted, except what follows
from the shapes alone: torch's forward holds the [1, 8, N, N] float32 logits, so its measured peak is at least
their size, and mha's fused forward stays below it. Takes about 10-15 s on 2 busy cores."""
import math
import re
import subprocess

import pytest

from bench_run import MHA, ROOT, run_bench

OPS = ROOT / "build" / "python" / "mha" / "libmha_torch_ops.so"

pytestmark = pytest.mark.skipif(not (MHA.exists() and OPS.exists()),
                                reason="build/mha or the PyTorch operator library is not built")

N, HEADS = 256, 8
CASES = [(dtype, causal, pass_) for dtype in ("float32", "bf16") for causal in ("no", "yes")
         for pass_ in ("fwd", "fwd+bwd")]
NUMBER = r"(\d+\.\d+)"


def run_sdpa_bench(out, *extra):
    args = ["--torch-sdpa", "--sizes", str(N), "--threads", "1", "--repeats", "1", *extra]
    return run_bench(args, out, "bench-torch-sdpa.json")


@pytest.fixture(scope="module")
def sdpa_run(tmp_path_factory):
    return run_sdpa_bench(tmp_path_factory.mktemp("bench"))


def table_rows(stdout, title):
    """The `|`-separated rows under the line starting with `title`, up to the first blank line (without the
    column header and the indented notes)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        if "|" in line and line.split()[0] != "thr":
            rows.append([part.split() for part in line.split("|")])
    return rows


def rounding_tolerance(a, b, decimals):
    """How far a / b of two figures printed with `decimals` decimals can be from the ratio of the true ones."""
    half = 0.5 * 10 ** -decimals
    return (a / b) * (half / a + half / b) * 1.01 + 0.005


def test_header_names_machine_torch_and_blas(sdpa_run):
    stdout, report = sdpa_run
    assert re.match(r"mha bench --torch-sdpa \(\d{4}-\d\d-\d\dT", stdout)
    assert re.search(r"^machine: .+ CPUs, .+; oneDNN [\d.]+ \(.+\); source tree .+; load average ", stdout, re.M)
    assert re.search(r"^torch 1\.13.* built with BLAS_INFO=\w+; float32 products: .+oneDNN.+; loaded: .*"
                     r"libmha_onednn_blas\.so", stdout, re.M)
    assert report["machine"] and report["onednn_isa"] and report["date"][:4].isdigit()
    assert report["torch"]["operators_loaded"] and "libmha_onednn_blas.so" in report["torch"]["blas_library"]
    assert report["torch_blas"] == "onednn" and report["load_start"] and report["load_end"]


def test_speed_and_memory_rows(sdpa_run):
    stdout, report = sdpa_run
    rows = table_rows(stdout, "== Speed and peak memory")
    assert [(int(r[0][0]), int(r[0][1]), r[0][2], r[0][3], r[0][4]) for r in rows] == [(1, N, *c) for c in CASES]
    by_case = {}
    for row in rows:
        mha_ms, torch_ms, ratio, of_mins = row[1]
        assert ratio.endswith("x") and of_mins.endswith("x")
        mha_ms, torch_ms, ratio = float(mha_ms), float(torch_ms), float(ratio[:-1])
        assert mha_ms > 0 and torch_ms > 0
        assert ratio == pytest.approx(torch_ms / mha_ms, abs=rounding_tolerance(torch_ms, mha_ms, 3))
        mha_mib, torch_mib, memory_ratio = row[2]
        if memory_ratio == "n/a":  # mha's call touched no new page
            assert float(mha_mib) == 0
        # The printed MiB are rounded to 0.1, too coarse for a ratio over mha's fraction of a MiB: the printed ratio
        # is checked against the bytes in the JSON below.
        by_case[tuple(row[0][2:5])] = (mha_ms, torch_ms, float(mha_mib), float(torch_mib), float(of_mins[:-1]),
                                       memory_ratio)
    assert [(r["dtype"], r["causal"], r["pass"]) for r in report["rows"]] == [
        ("float32" if d == "float32" else "bfloat16", c == "yes", p.replace("fwd+bwd", "fwdbwd")) for d, c, p in CASES]
    for r in report["rows"]:
        assert r["speed_status"] == "ok" and r["memory_status"] == "ok"
        assert r["mha_median_s"] == r["speed"]["mha"]["median_s"] and len(r["speed"]["mha"]["calls_s"]) == 1
        assert r["torch_median_s"] == r["speed"]["torch"]["median_s"] and len(r["speed"]["torch"]["calls_s"]) == 1
        assert r["torch_over_mha_time"] == pytest.approx(r["torch_median_s"] / r["mha_median_s"])
        memory = {line["impl"]: line for line in r["memory"]}
        assert set(memory) == {"mha", "torch"} and all(line["hwm_reset"] for line in memory.values())
        for impl in ("mha", "torch"):
            line = memory[impl]
            assert line["peak_above_inputs_bytes"] == line["peak_rss_bytes"] - line["rss_before_bytes"] >= 0
            assert r[impl + "_peak_bytes"] == line["peak_above_inputs_bytes"]
            assert line["first_call_peak_above_inputs_bytes"] >= 0 and line["first_call_s"] > 0
        key = ("float32" if r["dtype"] == "float32" else "bf16", "yes" if r["causal"] else "no",
               r["pass"].replace("fwdbwd", "fwd+bwd"))
        mha_ms, torch_ms, mha_mib, torch_mib, of_mins, printed_ratio = by_case[key]
        if r["mha_peak_bytes"] > 0:
            assert r["torch_over_mha_memory"] == pytest.approx(r["torch_peak_bytes"] / r["mha_peak_bytes"])
            assert float(printed_ratio[:-1]) == pytest.approx(r["torch_over_mha_memory"], abs=0.006)
        assert f"{1e3 * r['mha_median_s']:.3f}" == f"{mha_ms:.3f}"
        mins = r["speed"]["torch"]["min_s"] / r["speed"]["mha"]["min_s"]
        assert r["torch_over_mha_time_of_mins"] == pytest.approx(mins)
        assert f"{r['torch_over_mha_time_of_mins']:.2f}" == f"{of_mins:.2f}"
        assert f"{r['torch_peak_bytes'] / 2**20:.1f}" == f"{torch_mib:.1f}"


def test_memory_follows_from_the_shapes(sdpa_run):
    """torch's forward materialises the logits [1, h, N, N]; mha's fused forward keeps O(N) per head."""
    _, report = sdpa_run
    logits = HEADS * N * N * 4  # float32 bytes
    for r in report["rows"]:
        if r["dtype"] == "float32" and r["pass"] == "fwd":
            assert r["torch_peak_bytes"] >= logits, r
            assert r["mha_peak_bytes"] < logits, r


def test_overhead_rows(sdpa_run):
    stdout, report = sdpa_run
    rows = table_rows(stdout, "== Per-call overhead")
    assert len(rows) == 1 and rows[0][0] == ["1"]
    (kernel, pybind, operator, function), overs = ([float(x) for x in rows[0][1]]), [float(x) for x in rows[0][2]]
    assert min(kernel, pybind, operator, function) > 0
    for path, over in zip((pybind, operator, function), overs):
        assert over == pytest.approx(path - kernel, abs=0.11)
    (row,) = report["overhead"]
    assert len(row["kernel_blocks_s"]) == 2 * len(row["python"]["function"]["blocks_s"])
    blocks = sorted(row["kernel_blocks_s"])
    assert row["kernel_median_s"] == pytest.approx(0.5 * (blocks[len(blocks) // 2 - 1] + blocks[len(blocks) // 2]))
    for path in ("pybind11", "operator", "function"):
        assert row[path + "_over_kernel_s"] == pytest.approx(row["python"][path]["median_s"] - row["kernel_median_s"])


def test_targets(sdpa_run):
    stdout, report = sdpa_run
    lines = re.findall(r"^  (.+): (\d+) rows, worst (-?\d+\.\d+)( us|x) \(target (.+)\): (met|NOT met)$", stdout,
                       re.M)
    assert [(int(n), goal) for _, n, _, _, goal, _ in lines] == [(1, "< 30 us"), (4, ">= 1.00x"), (4, ">= 1.00x"),
                                                                  (8, ">= 1.00x")]
    targets = report["targets"]
    assert len(targets) == 4
    for t, (_, n, worst, _, _, verdict) in zip(targets, lines):
        assert t["rows"] == int(n) and t["met"] == (verdict == "met")
    over = report["overhead"][0]["function_over_kernel_s"]
    assert targets[0]["worst"] == pytest.approx(over) and f"{1e6 * over:.1f}" == lines[0][2]
    assert targets[0]["met"] == (over < 30e-6)
    for t, dtype in zip(targets[1:3], ("float32", "bfloat16")):
        worst = min(r["torch_over_mha_time"] for r in report["rows"] if r["dtype"] == dtype)
        assert t["worst"] == pytest.approx(worst) and t["met"] == (worst >= 1)
    measured = [r["torch_peak_bytes"] / r["mha_peak_bytes"] if r["mha_peak_bytes"] > 0 else math.inf
                for r in report["rows"]]
    assert targets[3]["met"] == (min(measured) >= 1)


def test_memory_limit_skips_torch(tmp_path):
    stdout, report = run_sdpa_bench(tmp_path, "--torch-memory-limit", "0")
    assert stdout.count("memory: torch not run: would need") == 8
    for r in report["rows"]:
        assert "torch_peak_bytes" not in r and r["mha_peak_bytes"] >= 0 and r["torch_over_mha_time"] > 0
    assert report["targets"][3]["rows"] == 0 and not report["targets"][3]["met"]


def test_refused_with_variants(tmp_path):
    result = subprocess.run([str(MHA), "bench", "--torch-sdpa", "--variants", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "excludes" in (result.stdout + result.stderr).lower()
