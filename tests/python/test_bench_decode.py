"""`mha bench --decode` run tiny (two short contexts, batches 1 and 2, a 16 MiB bandwidth buffer, 1 and 2
threads): the bandwidth lines, a table row per (dtype, batch, context, threads), the targets and
bench-decode.json with every row come out. Performance is measured, not timed in tests: nothing here
reads a time's value, only that each row has one. Takes a few seconds.

Which caches count as over the last-level cache is set with --llc-mib in every run here, never read
from the machine: the machines drawn have 32 MiB, 260 MiB and 480 MiB of L3, and no verdict here may
depend on which one runs the suite."""
import json
import os
import platform
import re
import subprocess

import pytest

from bench_run import MHA, run_bench


pytestmark = pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built")


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = ["--decode", "--contexts", "100,300", "--batches", "1,2", "--threads", "1,2", "--bandwidth-mib", "16",
            "--max-cache-gib", "0.005", "--llc-mib", "64"]
    return run_bench(args, out, "bench-decode.json")


def printed_row(run):
    """The figures bench_decode.cpp's print_row writes for a JSON run, computed as it computes them and
    formatted with its precisions, so that a printed row can be compared as text, exactly, whatever the
    machine's speed (comparing a figure recomputed from rounded printed figures fails at low rates)."""
    rate = {side: run["cache_bytes"] / run[f"{side}_median_s"] for side in ("packed", "per_head")}
    bandwidth = run["read_bandwidth_bytes_per_s"]
    return [f"{bandwidth * 1e-9:.1f}"] + [
        figure for side in ("packed", "per_head")
        for figure in (f"{1e3 * run[f'{side}_median_s']:.3f}", f"{rate[side] * 1e-9:.1f}",
                       f"{100 * rate[side] / bandwidth:.0f}%")] + [
        f"{run['per_head_median_s'] / run['packed_median_s']:.2f}x"]


def test_prints_bandwidth_rows_and_targets(decode_run):
    stdout, report = decode_run
    assert re.search(r"machine: .+ CPUs.+last-level cache 64 MiB \(set by --llc-mib\)", stdout)
    assert len(re.findall(r"read bandwidth, [12] thread\(s\), 16 MiB buffer: \d+\.\d GB/s", stdout)) == 2
    row_lines = [line for line in stdout.splitlines() if re.match(r"^\s*(f32|bf16|int8|fp8)\s+\d+\s+\d+", line)]
    rows = [line.split() for line in row_lines]
    measured = {(r[0], int(r[1]), int(r[2]), int(r[4].rstrip("*"))) for r in rows if "skipped" not in r}
    skipped = {(r[0], int(r[1]), int(r[2])) for r in rows if "skipped:" in r}
    # The largest cache, 2 x 300 tokens x 8 heads x 2 x 128 x 4 B = 4.9 MB, is under --max-cache-gib 0.005
    # (5.4 MB): every (dtype, batch, context) runs at both thread counts.
    assert not skipped
    assert measured == {(d, b, t, n) for d in ("f32", "bf16", "int8", "fp8") for b in (1, 2) for t in (100, 300)
                        for n in (1, 2)}
    # Every cache here (at most 4.9 MB) fits the 64 MiB set as the last-level cache: issue 33's nine targets,
    # over the bandwidth rows (caches >= 4x the size set), have no rows to judge, only issue 13's packing
    # has; every row is flagged * (within the last-level cache).
    assert "bandwidth rows (the targets' rows): caches >= 256 MiB" in stdout
    assert "Targets (issue 33)" in stdout and "Target (issue 13)" in stdout
    assert stdout.count(" rows, worst ") == 1 and stdout.count(": no rows (") == 9
    # Each row names the read bandwidth it is compared with (measured around its group), its rates and their
    # shares of it: the same figures as the JSON's run, rounded as printed. The flags after the bandwidth
    # ("!", "~" or both) may stand apart from it: the columns are read by "|" section.
    runs = {(r["dtype"], r["batch"], r["context"], r["threads"]): r for r in report["runs"]}
    for line in row_lines:
        head, packed, per_head, packing = line.split("|")
        key = head.split()
        run = runs[(key[0], int(key[1]), int(key[2]), int(key[4].rstrip("*")))]
        shown = [key[5].rstrip("!~")] + packed.split() + per_head.split() + packing.split()
        assert shown == printed_row(run), line
        assert ("!" in head) == run["read_bandwidth_moved"] and ("~" in head) == (run["steal_fraction"] > 0.02)
    assert re.search(r"the read bandwidth itself, 2 threads over 1, beside those rows: \d+\.\d\dx to \d+\.\d\dx",
                     stdout) is None  # no cache here exceeds the last-level cache: no scaling rows
    assert all(line.split("|")[0].split()[4].endswith("*") for line in row_lines)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the clock is measured on x86 only")
def test_names_the_measured_clock(decode_run):
    """The machine line and the report name the clock a core ran at, measured (a virtual machine's "cpu MHz"
    is often the host's nominal clock): a figure between 0.3 and 8 GHz, the same in both, whatever the
    machine's actual speed."""
    stdout, report = decode_run
    printed = re.search(r"^machine: .+ \(family \d+ model \d+, runs at (\d+\.\d\d) GHz\), \d+ CPUs", stdout, re.M)
    assert printed, stdout[:400]
    assert 0.3 < float(printed.group(1)) < 8.0
    assert report["machine"].endswith(f"runs at {printed.group(1)} GHz)")


def test_skips_caches_over_the_cap(tmp_path):
    args = [str(MHA), "bench", "--decode", "--contexts", "300", "--batches", "4", "--threads", "1",
            "--bandwidth-mib", "16", "--max-cache-gib", "0.005", "--out", str(tmp_path)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    skipped = [line.split() for line in result.stdout.splitlines() if "skipped: over --max-cache-gib" in line]
    assert [r[:3] for r in skipped] == [["f32", "4", "300"]]  # 9.8 MB; the bf16 cache, 4.9 MB, runs


def test_loaded_read_bandwidth_printed_as_in_the_json(decode_run):
    """Each thread count's read bandwidth with four multiply-adds per loaded vector (the float32 kernel's
    least arithmetic at h / h_kv = 4) is printed under the plain one, as the JSON has it."""
    stdout, report = decode_run
    loaded = re.findall(r"four multiply-adds per loaded vector .*?: ([0-9.]+) GB/s \(([0-9.]+) of it\)", stdout)
    assert len(loaded) == len(report["read_bandwidth"]) == 2, stdout[:800]
    for (rate, share), b in zip(loaded, report["read_bandwidth"]):
        with_fmas = b["with_four_multiply_adds_bytes_per_s"]
        assert with_fmas > 0
        assert rate == f"{with_fmas * 1e-9:.1f}" and share == f"{with_fmas / b['bytes_per_s']:.2f}"


def test_json_has_every_row(decode_run):
    _, report = decode_run
    assert report["heads"] == 32 and report["kv_heads"] == 8 and report["head_dim"] == 128
    assert {b["threads"] for b in report["read_bandwidth"]} == {1, 2}
    assert all(b["bytes_per_s"] > 0 for b in report["read_bandwidth"])
    assert len(report["runs"]) == 32  # f32, bf16, int8, fp8 caches x 2 batches x 2 contexts x 2 thread counts
    assert {run["dtype"] for run in report["runs"]} == {"f32", "bf16", "int8", "fp8"}
    for run in report["runs"]:
        assert run["packed_median_s"] > 0 and run["per_head_median_s"] > 0
        assert run["read_bandwidth_bytes_per_s"] > 0 and isinstance(run["read_bandwidth_moved"], bool)
        assert 0 <= run["steal_fraction"] <= 1
        before, after = run["read_bandwidth_before_after"]  # measured around the row's group: the better counts
        assert run["read_bandwidth_bytes_per_s"] == max(before, after) and min(before, after) > 0
        assert run["read_bandwidth_moved"] == (abs(before - after) > 0.15 * max(before, after))
        assert run["packed_fraction_of_bandwidth"] == pytest.approx(
            run["cache_bytes"] / run["packed_median_s"] / run["read_bandwidth_bytes_per_s"])
        row_bytes = {"f32": 128 * 4, "bf16": 128 * 2, "int8": 128 + 4, "fp8": 128 + 4}[run["dtype"]]  # + a scale
        assert run["cache_bytes"] == run["batch"] * run["context"] * 8 * 2 * row_bytes
    assert report["targets"][-1]["target"].startswith("packed over per head") and len(report["targets"]) == 10
    assert report["steal_seconds"] >= 0 and report["bandwidth_rows_min_bytes"] == 256 << 20
    # the prefetch level and why: the processor's choice, or MHA_DECODE_PREFETCH's when the environment sets it
    assert re.fullmatch(r"L[12] \(prefetcht[02]; (chosen for .* family \d+|forced by MHA_DECODE_PREFETCH=l[12])\)",
                        report["prefetch_level"])
    # the int8 pages' product path and why (src/decode/amx_int8.hpp), as the process chose it
    assert re.fullmatch(r"(AMX tiles|vectors) \(.+\)", report["int8_products"])
    assert report["int8_products"].startswith("AMX") == ("amx_int8" in open("/proc/cpuinfo").read().split()
                                                         and os.environ.get("MHA_DECODE_AMX") != "off")
    assert [(t["rows"], t["worst"], t["met"]) for t in report["targets"][:-1]] == [(0, None, False)] * 9


def test_targets_judge_the_bandwidth_rows(tmp_path):
    # --llc-mib 1: the bandwidth rows are the caches >= 4 MiB. At 2048 tokens they all are: float32 16 MiB,
    # bf16 8 MiB, int8 and fp8 4.125 MiB (128 payload bytes and a 4-byte scale per row).
    args = [str(MHA), "bench", "--decode", "--contexts", "2048", "--batches", "1", "--threads", "1,2",
            "--bandwidth-mib", "16", "--llc-mib", "1", "--out", str(tmp_path)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for dtype in ("f32", "bf16", "int8", "fp8"):
        assert re.search(rf"fraction of the read bandwidth, {dtype} caches >= 4 MiB: 2 rows, worst \d+\.\d\d ", out)
    for quantized in ("int8", "fp8"):
        for reference in ("f32", "bf16"):
            assert re.search(rf"{reference} step over {quantized} step, caches >= 4 MiB \(same batch, context, "
                             rf"threads\): 2 rows, worst \d+\.\d\dx", out)
    assert re.search(r"2 threads over 1, over the read bandwidth's own 2-over-1, caches >= 4 MiB: 4 rows, worst "
                     r"(\d+\.\d\d)x", out)
    match = re.search(r"the read bandwidth itself, 2 threads over 1, beside those rows: (\d+\.\d\d)x to (\d+\.\d\d)x",
                      out)
    report = json.loads((tmp_path / "bench-decode.json").read_text())
    runs = {(run["dtype"], run["threads"]): run for run in report["runs"]}
    ratios = [runs[(d, 2)]["read_bandwidth_bytes_per_s"] / runs[(d, 1)]["read_bandwidth_bytes_per_s"]
              for d in ("f32", "bf16", "int8", "fp8")]  # each group's own bracket
    scaling = report["targets"][8]
    low, high = scaling["read_bandwidth_scaling"]
    assert (low, high) == (pytest.approx(min(ratios)), pytest.approx(max(ratios)))
    assert match and match.groups() == (f"{low:.2f}", f"{high:.2f}")  # as printed: compared as text, not re-rounded
    # Each verdict is the worst of its rows, computed here from the JSON's medians.
    worst_scaling = min(runs[(d, 1)]["packed_median_s"] / runs[(d, 2)]["packed_median_s"] / ratio
                        for d, ratio in zip(("f32", "bf16", "int8", "fp8"), ratios))
    assert scaling["worst"] == pytest.approx(worst_scaling) and scaling["met"] == (worst_scaling >= 0.9)
    speedup = report["targets"][4]  # f32 over int8
    assert speedup["target"].startswith("f32 step over int8 step") and speedup["goal"] == 3.2
    assert speedup["worst"] == pytest.approx(min(runs[("f32", n)]["packed_median_s"] / runs[("int8", n)]["packed_median_s"]
                                                 for n in (1, 2)))
    fraction = report["targets"][2]  # int8
    assert fraction["worst"] == pytest.approx(min(runs[("int8", n)]["packed_fraction_of_bandwidth"] for n in (1, 2)))


def test_other_kv_heads_measure_their_own_caches_and_judge_no_target(tmp_path):
    # --kv-heads 32: plain multi-head attention (h stays 32). Every cache holds 32 kv heads' rows; the issues'
    # targets are stated for h_kv 8 (h / h_kv = 4), so none is judged, and the run says why.
    args = [str(MHA), "bench", "--decode", "--contexts", "100", "--batches", "1", "--threads", "1",
            "--bandwidth-mib", "16", "--llc-mib", "64", "--kv-heads", "32", "--out", str(tmp_path)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Decode step: h 32, h_kv 32, d 128" in result.stdout
    assert "Targets (issues 33 and 13): judged at h_kv 8 only (this run: h_kv 32)" in result.stdout
    report = json.loads((tmp_path / "bench-decode.json").read_text())
    assert report["kv_heads"] == 32 and report["targets"] == []
    row_bytes = {"f32": 128 * 4, "bf16": 128 * 2, "int8": 128 + 4, "fp8": 128 + 4}  # a (token, kv head) row
    assert {run["dtype"]: run["cache_bytes"] for run in report["runs"]} == {
        dtype: 100 * 32 * 2 * size for dtype, size in row_bytes.items()}


@pytest.mark.parametrize("kv_heads, message", [
    ("3", "--kv-heads: 3 not in {1,2,4,8,16,32}"),
    ("0", "--kv-heads: 0 is out of range; expected an integer in [1, 32]"),
    ("64", "--kv-heads: 64 is out of range; expected an integer in [1, 32]"),
    ("010", "--kv-heads: 010 has a leading zero"),  # 8 to CLI11's own reading
])
def test_kv_heads_must_divide_the_32_query_heads(kv_heads, message):
    result = subprocess.run([str(MHA), "bench", "--decode", "--kv-heads", kv_heads], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0
    assert message in result.stderr


def test_one_kv_head_with_many_sequences_has_a_query_for_every_head(tmp_path):
    # --kv-heads 1 (multi-query attention), 64 sequences: 64 x 32 query rows, more than the 1024 x 1 rows one
    # kv head's fill block holds; the queries come from a block of their own (8192 rows).
    args = [str(MHA), "bench", "--decode", "--contexts", "16", "--batches", "64", "--threads", "1",
            "--bandwidth-mib", "16", "--llc-mib", "64", "--kv-heads", "1", "--out", str(tmp_path)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "bench-decode.json").read_text())
    assert sorted(run["dtype"] for run in report["runs"]) == ["bf16", "f32", "fp8", "int8"]
    assert all(run["batch"] == 64 and run["packed_median_s"] > 0 for run in report["runs"])
