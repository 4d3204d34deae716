"""`mha demo` (train the date Transformer, write the report) and `mha translate` (read its checkpoint),
run as a user runs them, on a short training run so that the test takes seconds."""
import datetime
import json
import pathlib
import re
import subprocess

import pytest

from mha import read_safetensors, write_safetensors

ROOT = pathlib.Path(__file__).resolve().parents[2]
MHA = ROOT / "build" / "mha"

pytestmark = pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built")

SHORT = ["--steps", "40", "--batch", "32", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--layers", "1",
         "--eval", "40", "--eval-every", "20", "--maps", "2", "--no-progress", "--threads", "2"]


def mha(*args, stdin=None):
    return subprocess.run([str(MHA), *map(str, args)], capture_output=True, text=True, input=stdin)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "report"
    result = mha("demo", "--out", out, *SHORT)
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result.stdout


def test_demo_writes_the_report_folder(report):
    out, stdout = report
    # 2 examples x 3 kinds of attention x 1 layer x 2 heads
    maps = sorted(p.name for p in out.glob("example*_*_layer*_head*.png"))
    assert len(maps) == 12, maps
    for kind in ("encoder_self", "decoder_self", "cross"):
        assert (out / f"example0_{kind}_layer0_head1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "index.html").read_text()
    for name in maps + ["learning_curve.svg"]:
        assert f'src="{name}"' in html, name  # every image is on the page
    assert "exact match on 40 held-out dates" in html
    svg = (out / "learning_curve.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heads"] == 2 and summary["steps"] == 40 and summary["held_out_examples"] == 40
    assert [p["step"] for p in summary["curve"]] == [20, 40]
    assert 0.0 <= summary["held_out_exact_match"] <= 1.0
    assert summary["decode_same_outputs"] is True  # KV cache vs recomputing every prefix, on 40 dates
    assert f"{100 * summary['held_out_exact_match']:.1f}%" in stdout


def test_demo_checkpoint_holds_every_parameter_and_the_config(report):
    out, _ = report
    tensors, metadata = read_safetensors(str(out / "checkpoint.safetensors"))
    assert metadata["format"] == "mha-transformer-dates"
    assert (metadata["d_model"], metadata["heads"], metadata["encoder_layers"]) == ("32", "2", "1")
    assert tensors["embedding.weight"].shape == (int(metadata["vocab"]), 32)
    assert tensors["encoder.0.self_attn.in_proj_weight"].shape == (96, 32)
    assert tensors["decoder.0.cross_attn.out_proj.weight"].shape == (32, 32)
    assert tensors["decoder.0.ffn.linear1.weight"].shape == (64, 32)


def test_translate_arguments_and_standard_input_agree(report):
    out, _ = report
    checkpoint = out / "checkpoint.safetensors"
    dates = ["Friday, 5 March 2021", "05/03/2021", "the fifth of March 2021"]
    by_argument = mha("translate", "--checkpoint", checkpoint, *dates)
    assert by_argument.returncode in (0, 3), by_argument.stderr  # a short run may be unsure (3)
    lines = by_argument.stdout.splitlines()
    assert len(lines) == 3
    by_stdin = mha("translate", "--checkpoint", checkpoint, stdin="\n".join(dates) + "\n")
    assert by_stdin.returncode == by_argument.returncode, by_stdin.stderr
    assert by_stdin.stdout.splitlines() == lines
    for text, line in zip(dates, lines):  # a short run need not be right, but it must say when it may be wrong
        assert_checked_answer(text, line)


def assert_checked_answer(text, line):
    """A line of `mha translate`: a real date of the trained years that agrees with the input's four-digit
    year, or a line marked "? ANSWER  REASON" (the answer at most 11 tokens: 10 and <eos>)."""
    if line.startswith("? "):
        assert re.fullmatch(r"\? [A-Za-z0-9 ,./'-]{0,11}  (not a .*|outside the years .*|the input.*|no two-digit .*)",
                            line), line
        return
    date = datetime.date.fromisoformat(line)  # raises for 2021-02-31 or anything not yyyy-mm-dd
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", line) and 1950 <= date.year <= 2049, line
    runs = re.findall(r"\d+", text)  # the year the input states: its last four-digit run, or a two-digit one
    fours = [int(r[:4]) for r in runs if len(r) in (4, 8)]  # yyyy, or yyyymmdd
    if fours:
        assert fours[-1] == date.year, (text, line)
    else:
        assert date.year % 100 in [int(r) for r in runs if len(r) == 2], (text, line)


def test_translate_marks_answers_it_cannot_vouch_for(report):
    """Impossible or out-of-range inputs never come back as confident answers (issue 15)."""
    out, _ = report
    texts = ["31 February 2021", "13/13/2021", "5 March 1492", "hello", "5 March 2021", "2021-03-05", "30 June 2049",
             "Fri, 5 Mar 21", "20210305"]
    result = mha("translate", "--checkpoint", out / "checkpoint.safetensors", *texts)
    lines = result.stdout.splitlines()
    assert len(lines) == len(texts), result
    for text, line in zip(texts, lines):
        assert_checked_answer(text, line)
    assert not lines[0].startswith("2021-02-31") and not lines[2].startswith("1492")
    unsure = any(line.startswith("? ") for line in lines)
    assert result.returncode == (3 if unsure else 0), result.returncode


def test_translate_marks_answers_below_the_checkpoints_confidence_threshold(report, tmp_path):
    """The demo stores the threshold it calibrated on held-out data; translate applies it (issue 15)."""
    out, _ = report
    tensors, metadata = read_safetensors(str(out / "checkpoint.safetensors"))
    assert 0.0 <= float(metadata["unsure_below"]) <= 1.0
    texts = ["Friday, 5 March 2021", "05/03/2021", "5 March 2021"]
    lines = {}
    for value in ("1", "0", "x"):
        metadata["unsure_below"] = value
        path = tmp_path / f"checkpoint_{value}.safetensors"
        write_safetensors(str(path), tensors, metadata)
        result = mha("translate", "--checkpoint", path, *texts)
        lines[value] = result.stdout.splitlines()
        if value == "x":
            assert result.returncode == 1 and 'metadata "unsure_below" is not a probability' in result.stderr
    assert len(lines["1"]) == len(texts) and all(line.startswith("? ") for line in lines["1"])  # nothing is that sure
    assert not any("low confidence" in line for line in lines["0"])
    for sure, unsure in zip(lines["0"], lines["1"]):  # the same answers; only the marking differs
        assert unsure.startswith("? ") and unsure[2:12] == (sure[2:12] if sure.startswith("? ") else sure)
        assert sure.startswith("? ") or "low confidence" in unsure


def test_translate_answers_every_good_line_despite_bad_ones(report):
    out, _ = report
    result = mha("translate", "--checkpoint", out / "checkpoint.safetensors",
                 stdin="5 March 2021\n\n5 M\u00e4rz 2021\n5 March 2021\n")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and lines[0] == lines[3] and not lines[0].startswith("? not translated")
    assert lines[1].startswith("? not translated: line 2 is empty")
    assert lines[2].startswith("? not translated: line 3") and "not in the vocabulary" in lines[2]
    assert "line 2 is empty" in result.stderr and "line 3" in result.stderr


def test_translate_without_a_checkpoint_says_how_to_make_one(tmp_path):
    result = mha("translate", "--checkpoint", tmp_path / "none.safetensors", "5 March 2021")
    assert result.returncode == 1
    assert "no checkpoint at" in result.stderr and "mha demo" in result.stderr


def test_translate_refuses_characters_outside_the_vocabulary(report):
    out, _ = report
    result = mha("translate", "--checkpoint", out / "checkpoint.safetensors", "5 March 2021", "5 März 2021")
    assert result.returncode == 1 and len(result.stdout.splitlines()) == 2  # input 1 still gets its answer
    assert result.stdout.splitlines()[1].startswith("? not translated: input 2")
    assert "input 2" in result.stderr and "not in the vocabulary" in result.stderr
    result = mha("translate", "--checkpoint", out / "checkpoint.safetensors", stdin="5 March 2021\n\n")
    assert result.returncode == 1 and "line 2 is empty" in result.stderr


def test_translate_refuses_a_file_that_is_not_a_checkpoint(tmp_path):
    import numpy as np
    path = tmp_path / "other.safetensors"
    write_safetensors(str(path), {"x": np.ones(3, np.float32)})
    result = mha("translate", "--checkpoint", path, "5 March 2021")
    assert result.returncode == 1 and "not a date-task Transformer checkpoint" in result.stderr


def test_demo_rejects_heads_that_do_not_divide_d_model():
    result = mha("demo", "--d-model", "30", "--heads", "4", "--steps", "1")
    assert result.returncode == 1 and "--d-model 30 is not a multiple of --heads 4" in result.stderr


def test_translate_reads_inputs_as_the_formats_write_them(report):
    """Spacing, trailing periods and the case of month names do not change the answer (issue 15)."""
    out, _ = report
    variants = ["5 March 2021", "  5   march 2021. ", "5 MARCH 2021,", "\t5 March\t2021"]
    result = mha("translate", "--checkpoint", out / "checkpoint.safetensors", *variants)
    lines = result.stdout.splitlines()
    assert len(lines) == len(variants) and len(set(lines)) == 1, lines


def test_demo_measures_realistic_variations(report):
    """The report and summary.json carry the table of ways people write dates (issue 15)."""
    out, _ = report
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["variations"]
    names = [r["name"] for r in rows]
    assert "yyyy-mm-dd (the output format)" in names and "d month yyyy, lower case" in names
    assert any(not r["trained"] for r in rows) and any(r["trained"] for r in rows)
    for r in rows:
        assert r["total"] == min(summary["held_out_examples"], 200)
        assert r["right"] + r["unsure"] + r["confidently_wrong"] == r["total"], r
    html = (out / "index.html").read_text()
    assert "Realistic variations" in html and all(r["example"] in html for r in rows)


# ---- --dtype bf16: mixed-precision training beside a float32 run of the same settings (issue 12) ----

@pytest.fixture(scope="module")
def bf16_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_bf16") / "report"
    result = mha("demo", "--out", out, "--dtype", "bf16", *SHORT)
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result.stdout


def minutes(seconds):
    """The report's m:ss (demo_report.cpp's minutes(), which rounds halves up)."""
    s = int(seconds + 0.5)
    return f"{s // 60}:{s % 60:02d}"


def test_demo_bf16_reports_its_time_beside_a_float32_run_of_the_same_settings(bf16_report):
    out, stdout = bf16_report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dtype"] == "bf16" and summary["steps"] == 40
    float32 = summary["float32_run"]
    assert float32["train_seconds"] > 0 and summary["train_seconds"] > 0
    for share in (summary["held_out_exact_match"], float32["held_out_exact_match"],
                  float32["checkpoint_float32_exact_match"]):
        assert 0.0 <= share <= 1.0
    html = (out / "index.html").read_text()
    table = html[html.index('id="precision"'):]
    table = table[:table.index("</table>")]
    rows = table.split("<tr>")[2:]  # after the header: float32, then bf16
    assert len(rows) == 2 and "float32" in rows[0] and "bf16 mixed precision" in rows[1], table
    assert f"<td>{minutes(float32['train_seconds'])}</td>" in rows[0], rows[0]
    assert f"<td>{minutes(summary['train_seconds'])}</td>" in rows[1], rows[1]
    assert f"{100 * float32['held_out_exact_match']:.1f}%" in rows[0]
    assert f"{100 * summary['held_out_exact_match']:.1f}%" in rows[1]
    assert "training in float32 first" in stdout and "bfloat16 mixed precision" in stdout


def test_demo_bf16_checkpoint_holds_float32_master_weights_that_translate_reads(bf16_report):
    out, _ = bf16_report
    tensors, metadata = read_safetensors(str(out / "checkpoint.safetensors"))
    assert metadata["trained_dtype"] == "bf16"
    assert tensors and all(t.dtype == "float32" for t in tensors.values())
    # Master weights keep float32's precision: most are not bfloat16 numbers (their low 16 bits are not 0).
    weight = tensors["decoder.0.ffn.linear1.weight"]
    assert (weight.view("uint32") & 0xFFFF != 0).mean() > 0.9
    dates = ["Friday, 5 March 2021", "05/03/2021"]
    result = mha("translate", "--checkpoint", out / "checkpoint.safetensors", *dates)
    assert result.returncode in (0, 3), result.stderr  # a short run may be unsure (3)
    for text, line in zip(dates, result.stdout.splitlines()):
        assert_checked_answer(text, line)


def test_demo_float32_shows_no_precision_comparison(report):
    out, _ = report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dtype"] == "float32" and "float32_run" not in summary
    assert 'id="precision"' not in (out / "index.html").read_text()


def test_demo_help_explains_dtype_and_refuses_other_dtypes():
    help_text = mha("demo", "--help").stdout
    assert "--dtype" in help_text and "bf16" in help_text and "mixed precision" in help_text
    result = mha("demo", "--dtype", "float16", "--steps", "1")
    assert result.returncode != 0 and "float16" in result.stderr
