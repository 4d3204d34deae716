"""`mha bench --variants` run tiny (N 256, a packed batch of 4 sequences, one timed call per figure, 1 and 2
threads): every table row, every ratio and every target line comes out, on stdout and in bench-variants.json,
with positive finite figures. Performance is measured, not timed in tests: nothing here judges a time or a
ratio's value (nor whether a target is met), only that each is there and is a number. Takes a few seconds."""
import math
import re
import subprocess

import pytest

from bench_run import MHA, run_bench


pytestmark = pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built")

N, SEQUENCES = 256, 4
NUMBER = r"(\d+\.\d+)"


@pytest.fixture(scope="module")
def variants_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = ["--variants", "--variants-n", str(N), "--sequences", str(SEQUENCES), "--repeats", "1", "--threads", "1,2"]
    return run_bench(args, out, "bench-variants.json")


def positive(text):
    value = float(text.rstrip("x"))
    assert math.isfinite(value) and value > 0, text
    return value


def table_rows(stdout, title):
    """The rows of the table under the line starting with `title`: lines of `|`-separated sections, up to
    the first blank line."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        if "|" in line and not line.split("|")[0].split()[0] == "thr":
            rows.append([part.split() for part in line.split("|")])
    return rows


def test_header_names_machine_threads_and_date(variants_run):
    stdout, report = variants_run
    assert re.match(r"mha bench --variants \(\d{4}-\d\d-\d\dT", stdout)
    assert re.search(r"^machine: .+ CPUs, .+; oneDNN [\d.]+ \(.+\); source tree .+; load average ", stdout, re.M)
    assert len(re.findall(r"^roof: oneDNN sgemm 2048\^3 at [12] thread\(s\): \d+ GFLOP/s$", stdout, re.M)) == 2
    assert report["machine"] and report["onednn_isa"] and report["date"][:4].isdigit()
    assert [r["threads"] for r in report["roofs"]] == [1, 2] and all(r["gflops"] > 0 for r in report["roofs"])


def test_packed_rows_and_ratios(variants_run):
    stdout, report = variants_run
    packed = report["packed"]
    lengths = packed["lengths"]
    assert len(lengths) == SEQUENCES and all(64 <= length <= N for length in lengths)
    assert packed["total"] == sum(lengths) and packed["max_length"] == max(lengths)
    assert packed["flop_ratio"] == pytest.approx(sum(x * x for x in lengths) / (SEQUENCES * max(lengths) ** 2))
    assert packed["heads"] == 8 and packed["head_dim"] == 64
    # r_tiles: the logits of whole query tiles (128 or 256 rows, by the L2: src/attention/query_block.hpp), each up
    # to its last row's causal bound and the key length
    tall = packed["query_block_rows"]
    assert tall in (128, 256)

    def tile_logits(rows, key_length):
        return sum(min(tall, rows - i0) * min(key_length, i0 + min(tall, rows - i0)) for i0 in range(0, rows, tall))
    assert packed["tile_ratio"] == pytest.approx(
        sum(tile_logits(x, x) for x in lengths) / sum(tile_logits(max(lengths), x) for x in lengths))
    assert re.search(r"^  " + " ".join(str(x) for x in lengths) + "$", stdout, re.M)  # the lengths, printed
    match = re.search(r"r = sum L_i\^2 / \(n max_L\^2\) = " + NUMBER + r"; r_tiles = .+ = " + NUMBER, stdout)
    assert match and float(match.group(1)) == pytest.approx(packed["flop_ratio"], abs=5e-5)
    assert float(match.group(2)) == pytest.approx(packed["tile_ratio"], abs=5e-5)
    rows = table_rows(stdout, "== Packed against padded")
    assert [(int(r[0][0]), r[0][1]) for r in rows] == [(t, p) for t in (1, 2) for p in ("fwd", "fwd+bwd")]
    for row in rows:
        assert len(row[1]) == 4 and len(row[2]) == 3 and all(x.endswith("x") for x in row[2])
        for figure in row[1] + row[2]:
            positive(figure)
    assert [(r["threads"], r["pass"]) for r in packed["rows"]] == [(t, p) for t in (1, 2) for p in ("fwd", "fwdbwd")]
    rows_by_key = {(int(r[0][0]), r[0][1].replace("fwd+bwd", "fwdbwd")): r for r in rows}
    for r in packed["rows"]:
        for key in ("padded_median_s", "padded_min_s", "packed_median_s", "packed_min_s", "packed_gflops"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert r["packed_over_padded_times_r"] == pytest.approx(
            r["packed_median_s"] / (r["padded_median_s"] * packed["flop_ratio"]))
        dense = r["dense"]  # every padded logit, timed against packed in a pair of its own
        assert dense["dense_median_s"] > 0 and dense["packed_median_s"] > 0 and dense["reps"] == 1
        assert r["packed_over_dense_times_r"] == pytest.approx(
            dense["packed_median_s"] / (dense["dense_median_s"] * packed["flop_ratio"]))
        assert float(rows_by_key[(r["threads"], r["pass"])][2][0].rstrip("x")) == pytest.approx(
            r["packed_over_dense_times_r"], abs=5e-4)
        assert r["reps"] == 1
    assert len(re.findall(r"^  2 threads over 1, fwd(\+bwd)?: packed \d+\.\d\dx, padded \d+\.\d\dx$", stdout,
                          re.M)) == 2


@pytest.mark.parametrize("part, title, expected", [
    ("sinks", "== Sinks", [(t, c, p) for t in (1, 2) for c in ("no", "yes") for p in ("fwd", "fwd+bwd")]),
    ("rotary", "== Rotary in the layer", [(t, "yes", p) for t in (1, 2) for p in ("fwd", "fwd+bwd")]),
])
def test_variant_rows_and_ratios(variants_run, part, title, expected):
    stdout, report = variants_run
    rows = table_rows(stdout, title)
    assert [(int(r[0][0]), r[0][1], r[0][2]) for r in rows] == expected
    for row in rows:
        without, with_ = (positive(x) for x in row[1])
        ratio, of_mins = (positive(x) for x in row[2])
        assert all(x.endswith("x") for x in row[2])
    runs = report[part]["rows"]
    assert [(r["threads"], "yes" if r["causal"] else "no", r["pass"].replace("fwdbwd", "fwd+bwd")) for r in runs] \
        == expected
    for r in runs:
        for key in ("without_median_s", "without_min_s", "with_median_s", "with_min_s", "ratio", "min_ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert r["ratio"] == pytest.approx(r["with_median_s"] / r["without_median_s"])
    assert report[part]["n"] == N


def test_apply_rotary_rows(variants_run):
    stdout, report = variants_run
    lines = re.findall(r"^\s+([12])  mha::apply_rotary \[1, 8, 256, 64\] alone: forward " + NUMBER
                       + r" ms, backward " + NUMBER + " ms", stdout, re.M)
    assert [int(t) for t, _, _ in lines] == [1, 2] and all(positive(f) and positive(b) for _, f, b in lines)
    assert [r["threads"] for r in report["rotary"]["apply_rotary"]] == [1, 2]
    assert all(r["forward_median_s"] > 0 and r["backward_median_s"] > 0 for r in report["rotary"]["apply_rotary"])


def test_targets(variants_run):
    stdout, report = variants_run
    assert "Targets (issue 31), from the medians:" in stdout
    lines = re.findall(r"^  (.+): (\d+) rows, worst " + NUMBER + r"x \(target <= ([\d.]+)x\): (met|NOT met)$",
                       stdout, re.M)
    assert [(int(n), float(goal)) for _, n, _, goal, _ in lines] == [(4, 1.15), (8, 1.03), (4, 1.05)]
    assert re.search(r"over padded with key_lengths x r: worst \d+\.\d+x; x r_tiles, the logits each forward "
                     r"computes: worst \d+\.\d+x", stdout)
    targets = report["targets"]
    assert [(t["rows"], t["goal"]) for t in targets] == [(4, 1.15), (8, 1.03), (4, 1.05)]
    for t, (_, _, worst, _, verdict) in zip(targets, lines):
        assert t["worst"] > 0 and f"{t['worst']:.3f}" == worst and t["met"] == (verdict == "met")
    assert targets[0]["worst"] == pytest.approx(max(r["packed_over_dense_times_r"] for r in report["packed"]["rows"]))
    assert targets[0]["worst_over_padded_with_lengths_r"] == pytest.approx(
        max(r["packed_over_padded_times_r"] for r in report["packed"]["rows"]))
    assert targets[1]["worst"] == pytest.approx(max(r["ratio"] for r in report["sinks"]["rows"]))


def test_refused_with_decode(tmp_path):
    result = subprocess.run([str(MHA), "bench", "--variants", "--decode", "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "excludes" in (result.stdout + result.stderr).lower()
