"""Beam search from the shell: `mha translate --beam K` and the greedy / beam comparison of `mha demo`
(its printed summary, summary.json and index.html), on the short demo run of test_demo_command.py; and
the quantized self-attention caches, `mha translate --kv-cache int8|fp8` and the demo's table of cache
dtypes. The search itself is tested in tests/transformer/beam_search_test.cpp, the caches on a trained
model in tests/transformer/kv_cache_storage_test.cpp."""
import json
import math
import re

from test_demo_command import assert_checked_answer, mha, report  # noqa: F401 (report: the fixture)

DATES = ["Friday, 5 March 2021", "05/03/2021", "the fifth of March 2021", "Mar 05 1999", "20210305"]


def test_translate_with_one_beam_is_greedy_decoding(report):  # noqa: F811
    checkpoint = report[0] / "checkpoint.safetensors"
    greedy = mha("translate", "--checkpoint", checkpoint, *DATES)
    one = mha("translate", "--checkpoint", checkpoint, "--beam", "1", *DATES)
    assert greedy.returncode in (0, 3), greedy.stderr
    assert (one.returncode, one.stdout) == (greedy.returncode, greedy.stdout)


def test_translate_with_beams_answers_every_input_with_its_checks(report):  # noqa: F811
    checkpoint = report[0] / "checkpoint.safetensors"
    for beams in ("2", "4", "64"):
        result = mha("translate", "--checkpoint", checkpoint, "--beam", beams, *DATES)
        assert result.returncode in (0, 3), result.stderr  # a short run may be unsure (3)
        lines = result.stdout.splitlines()
        assert len(lines) == len(DATES)
        for text, line in zip(DATES, lines):
            assert_checked_answer(text, line)


def test_translate_refuses_beams_below_one_or_above_64(report):  # noqa: F811
    checkpoint = report[0] / "checkpoint.safetensors"
    for bad, why in (("0", "0 is out of range"), ("-3", "-3 is out of range"), ("65", "65 is out of range"),
                     ("two", '"two" is not a decimal integer')):
        result = mha("translate", "--checkpoint", checkpoint, "--beam", bad, "5 March 2021")
        assert result.returncode == 2, (bad, result.stdout, result.stderr)
        assert "--beam" in result.stderr and why in result.stderr and "expected an integer in [1, 64]" in result.stderr
        assert result.stdout == ""


def test_demo_reports_greedy_and_beam_accuracy_and_time_side_by_side(report):  # noqa: F811
    out, stdout = report
    summary = json.loads((out / "summary.json").read_text())
    assert [b["beams"] for b in summary["beam_search"]] == [2, 4]  # the default --beams
    for b in summary["beam_search"]:
        assert 0.0 <= b["held_out_exact_match"] <= 1.0 and b["decode_seconds"] > 0
        assert 0 <= b["differs_from_greedy"] <= summary["held_out_examples"]
        line = re.search(rf"beam search, {b['beams']} beams: ([0-9.]+)% exact match in ([0-9.]+) s", stdout)
        assert line, stdout
        assert line.group(1) == f"{100 * b['held_out_exact_match']:.1f}"
    html = (out / "index.html").read_text()
    table = html[html.index('<table class="s" id="beams">'):]
    table = table[:table.index("</table>")]
    assert f"<td>greedy</td><td>{100 * summary['held_out_exact_match']:.1f}%</td>" in table
    for b in summary["beam_search"]:
        assert f"<td>beam search, {b['beams']} beams</td><td>{100 * b['held_out_exact_match']:.1f}%</td>" in table


def test_demo_refuses_a_beam_width_of_zero():
    result = mha("demo", "--beams", "2,0", "--steps", "1")
    assert result.returncode == 2 and "--beams" in result.stderr and "0 is out of range" in result.stderr


KV_CACHES = ["float32", "int8", "fp8"]


def test_translate_with_an_int8_or_fp8_cache_answers_every_input_with_its_checks(report):  # noqa: F811
    checkpoint = report[0] / "checkpoint.safetensors"
    for kv_cache in ("int8", "fp8"):
        for beams in ("1", "4"):
            result = mha("translate", "--checkpoint", checkpoint, "--kv-cache", kv_cache, "--beam", beams, *DATES)
            assert result.returncode in (0, 3), (kv_cache, beams, result.stderr)  # a short run may be unsure (3)
            lines = result.stdout.splitlines()
            assert len(lines) == len(DATES), (kv_cache, beams, result.stdout)
            for text, line in zip(DATES, lines):
                assert_checked_answer(text, line)


def test_translate_with_the_float32_cache_named_is_the_default(report):  # noqa: F811
    checkpoint = report[0] / "checkpoint.safetensors"
    default = mha("translate", "--checkpoint", checkpoint, *DATES)
    named = mha("translate", "--checkpoint", checkpoint, "--kv-cache", "float32", *DATES)
    assert (named.returncode, named.stdout) == (default.returncode, default.stdout)


def test_translate_refuses_an_unknown_kv_cache_naming_the_option(report):  # noqa: F811
    checkpoint = report[0] / "checkpoint.safetensors"
    for bad in ("int4", "bf16", "INT8", ""):
        result = mha("translate", "--checkpoint", checkpoint, "--kv-cache", bad, "5 March 2021")
        assert result.returncode == 2, (bad, result.stdout, result.stderr)
        assert "--kv-cache" in result.stderr and result.stdout == "", (bad, result.stderr)
        assert bad in result.stderr and "float32" in result.stderr, (bad, result.stderr)
    help_text = mha("translate", "--help").stdout
    assert "--kv-cache" in help_text and "int8" in help_text and "fp8" in help_text and "greedy" in help_text


def test_demo_reports_each_cache_dtypes_accuracy_and_divergence_from_float32(report):  # noqa: F811
    out, stdout = report
    summary = json.loads((out / "summary.json").read_text())
    caches = summary["kv_caches"]
    assert [c["kv_cache"] for c in caches] == KV_CACHES
    for c in caches:
        assert c["beams"] == [1, 2, 4]  # greedy, then the default --beams
        assert all(0.0 <= a <= 1.0 for a in c["held_out_exact_match"]) and c["decode_seconds"] > 0
        assert math.isfinite(c["mean_kl"]) and c["mean_kl"] >= 0.0
        greedy, two, four = (f"{100 * a:.1f}%" for a in c["held_out_exact_match"])
        assert re.search(rf"^    {c['kv_cache']} +greedy {greedy}, 2 beams {two}, 4 beams {four}; KL ", stdout,
                         re.MULTILINE), stdout
    float32 = caches[0]
    assert float32["mean_kl"] == 0.0  # the float32 cache against itself
    assert float32["held_out_exact_match"][0] == summary["held_out_exact_match"]  # 1 beam is greedy decoding
    assert float32["held_out_exact_match"][1:] == [b["held_out_exact_match"] for b in summary["beam_search"]]
    html = (out / "index.html").read_text()
    table = html[html.index('<table class="s" id="kv-cache">'):]
    table = table[:table.index("</table>")]
    assert "<th>greedy</th><th>2 beams</th><th>4 beams</th><th>mean KL from float32</th>" in table
    for c in caches:
        cells = "".join(f"<td>{100 * a:.1f}%</td>" for a in c["held_out_exact_match"])
        assert f"<tr><td>{c['kv_cache']}</td>{cells}<td>" in table, (c, table)
    assert "<tr><td>float32</td>" in table and "<td>0</td>" in table
