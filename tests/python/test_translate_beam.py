"""Beam search from the shell: `mha translate --beam K` and the greedy / beam comparison of `mha demo`
(its printed summary, summary.json and index.html), on the short demo run of test_demo_command.py.
The search itself is tested in tests/transformer/beam_search_test.cpp."""
import json
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
