"""The command line refuses bad values clearly (issue 10: no silent wrong answers, no crashes): every number
option reads a decimal integer or a finite number in its stated range, an error names the option and the
value, and text from outside reaches the terminal escaped. Each run stops at the command line (a demo that
wrongly got past it trains two tiny steps), so the file takes seconds."""
import json
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MHA = ROOT / "build" / "mha"

pytestmark = pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built")

# A demo small enough that an accepted value trains in a second (not the default 3000 steps).
TINY_DEMO = {"--steps": 2, "--batch": 4, "--d-model": 8, "--heads": 2, "--d-ff": 8, "--layers": 1, "--eval": 2,
             "--eval-every": 2, "--maps": 0, "--threads": 1}
TIMEOUT_S = 120  # a run that gets past the command line when it should not must not hang the suite


def tiny_demo(*overridden):
    """TINY_DEMO's arguments but the options a test gives itself (CLI11 refuses an option given twice)."""
    return [str(x) for option, value in TINY_DEMO.items() if option not in overridden for x in (option, value)] + \
        ["--no-progress"]


def mha(*args, stdin=None, text=True):
    return subprocess.run([str(MHA), *map(str, args)], capture_output=True, text=text, input=stdin,
                          timeout=TIMEOUT_S)


def refused(result, *needles):
    """A usage error (status 2) whose message holds every needle, on one short line per error."""
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    assert max(map(len, result.stderr.splitlines())) < 200, result.stderr  # no 300-digit range


# ---- floating options: finite, in range -------------------------------------------------------------

DEMO_FLOATS = {"--dropout": "[0, 0.99]", "--attention-dropout": "[0, 0.99]", "--label-smoothing": "[0, 0.99]",
               "--lr-factor": "[1e-06, 1000]"}


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "infinity"])
@pytest.mark.parametrize("option", sorted(DEMO_FLOATS))
def test_demo_refuses_non_finite_values(tmp_path, option, value):
    result = mha("demo", "--out", tmp_path / "report", *tiny_demo(), option, value)
    refused(result, option, value, "not a finite number", DEMO_FLOATS[option])
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("option, value", [("--dropout", "1"), ("--dropout", "-0.1"), ("--label-smoothing", "1e9"),
                                           ("--lr-factor", "0"), ("--lr-factor", "1e400"), ("--dropout", "0.5x"),
                                           ("--dropout", "")])
def test_demo_refuses_floats_out_of_range_or_malformed(tmp_path, option, value):
    refused(mha("demo", "--out", tmp_path / "report", *tiny_demo(), option, value), option)
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("args, option", [
    (["bench", "--torch-memory-limit", "nan"], "--torch-memory-limit"),
    (["bench", "--torch-timeout", "inf"], "--torch-timeout"),
    (["bench", "--torch-timeout", "-5"], "--torch-timeout"),
    (["bench-one", "--n", "8", "--min-time", "nan"], "--min-time"),
    (["bench-one", "--n", "8", "--max-time", "-inf"], "--max-time"),
])
def test_every_floating_option_refuses_non_finite_and_negative_values(tmp_path, args, option):
    # --out keeps a bench that wrongly starts (it would take minutes, hence the timeout) out of the tree
    extra = ["--out", tmp_path / "bench", "--quick", "--no-torch"] if args[0] == "bench" else []
    refused(mha(*args, *extra), option, args[-1])


# ---- integer options: decimal, in a stated range ----------------------------------------------------

@pytest.mark.parametrize("args, option, value, expected", [
    (["run"], "--heads", "-1", "[1, 65536]"),
    (["run"], "--heads", "0", "[1, 65536]"),
    (["run"], "--heads", "9223372036854775808", "[1, 65536]"),  # 2^63: strtoll clamped it to 2^63 - 1
    (["run"], "--heads", "1e3", "not a decimal integer"),
    (["run"], "--threads", "100000", "[0, "),
    (["run"], "--threads", "-1", "[0, "),
    (["demo", *tiny_demo()], "--seed", "-1", "[0, 18446744073709551615]"),  # strtoull read -1 as 2^64 - 1
    (["demo", *tiny_demo()], "--seed", "18446744073709551616", "[0, 18446744073709551615]"),
    (["demo", *tiny_demo("--steps")], "--steps", "0x10", "not a decimal integer"),
    (["demo", *tiny_demo("--steps")], "--steps", "99999999999999999999", "[1, 10000000]"),
    (["demo", *tiny_demo("--threads")], "--threads", "2147483648", "[0, "),
    (["heads"], "--threads", "4096", "[0, "),
    (["bench-one"], "--n", "-3", "[1, 4194304]"),
    (["translate"], "--threads", "4096", "[0, "),
    (["explore"], "--port", "65536", "[0, 65535]"),
    (["explore"], "--port", "-1", "[0, 65535]"),
    (["explore"], "--threads", "0", "[1, "),
    (["bench"], "--threads", "1,0", "[1, "),
    (["bench"], "--sizes", "512,-3", "[1, 4194304]"),
    (["bench-one"], "--warmup", "-1", "[0, 1000000]"),
    (["bench-one"], "--heads", "-1", "[1, 65536]"),
])
def test_integer_options_refuse_values_outside_their_range_naming_option_and_value(tmp_path, args, option,
                                                                                   value, expected):
    extra = {"run": ["--weights", "w", "--query", "q", "--out", tmp_path / "o.npy"],
             "bench": ["--out", tmp_path / "bench", "--quick", "--no-torch"],
             "demo": ["--out", tmp_path / "report"]}.get(args[0], [])
    refused(mha(*args, *extra, option, value), option, value.split(",")[-1], expected)


# ---- the bench's grid options: shapes read strictly, options that cannot apply refused ------------------

@pytest.mark.parametrize("spec, message", [
    ("1:16", 'entry "1:16": expected B:N:E or B:N:E:h'),
    ("1:16:64:2:1", "expected B:N:E or B:N:E:h"),
    ("1:16:64,,2:16:64", 'entry "": expected B:N:E or B:N:E:h'),
    ("0:16:64", "B must be a decimal integer in [1, 65536]"),
    ("1:0x10:64", "N must be a decimal integer in [1, 4194304]"),
    ("1:16:-64", "E must be a decimal integer in [1, 65536]"),
    ("1:16:100", "E must be a multiple of 64 (h = E / 64), or give h: B:N:E:h"),
    ("1:16:64:3", "E must be a multiple of h"),
    ("1:16:64:0", "h must be a decimal integer in [1, 65536]"),
    ("1:16:\x1b[31m", "\\x1b[31m"),  # text from outside reaches the terminal escaped
])
def test_bench_refuses_bad_grid_shapes(tmp_path, spec, message):
    result = mha("bench", "--out", tmp_path / "bench", "--grid-only", "--grid-shapes", spec)
    refused(result, "--grid-shapes", message)
    assert "\x1b" not in result.stderr
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("args, message", [
    (["--grid-only", "--no-grid"], "--no-grid excludes --grid-only"),
    (["--quick", "--grid-only"], "--quick excludes --grid-only"),
    (["--grid-only", "--sizes", "512"], "--sizes excludes --grid-only"),
    (["--grid-only", "--big", "0"], "--big excludes --grid-only"),
    (["--no-grid", "--grid-shapes", "1:16:64"], "--no-grid excludes --grid-shapes"),
    (["--quick", "--grid-shapes", "1:16:64"], "--quick excludes --grid-shapes"),
    (["--torch-blas", "blis"], "blis not in {onednn,openblas,installed}"),
])
def test_bench_refuses_grid_options_that_cannot_apply(tmp_path, args, message):
    refused(mha("bench", "--out", tmp_path / "bench", *args), message)
    assert not (tmp_path / "bench").exists()


@pytest.mark.skipif(pathlib.Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3").exists(),
                    reason="OpenBLAS is installed: the run would start")
def test_bench_on_missing_openblas_says_how_to_install_it(tmp_path):
    result = mha("bench", "--out", tmp_path / "bench", "--grid-only", "--grid-shapes", "1:16:64",
                 "--torch-blas", "openblas")
    assert result.returncode == 1, result.stderr
    assert "apt-get install libopenblas0-pthread" in result.stderr, result.stderr
    assert not (tmp_path / "bench" / "bench.json").exists()


def test_integers_are_read_as_decimal():
    # bench-one reports the n it ran; 0 itself is no leading zero (--warmup 0).
    result = mha("bench-one", "--impl", "core", "--n", "10", "--warmup", "0", "--min-reps", "1", "--max-reps", "1",
                 "--min-time", "0", "--max-time", "0")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["n"] == 10


def test_bench_one_core_refuses_bf16():
    # The core workload is float32 only: a bf16 request is refused, not run as float32 under a bf16 label.
    result = mha("bench-one", "--impl", "core", "--n", "10", "--dtype", "bf16", "--warmup", "0", "--min-reps", "1",
                 "--max-reps", "1", "--min-time", "0", "--max-time", "0")
    assert result.returncode != 0 and result.stdout == ""
    assert "--impl core runs float32 only" in result.stderr, result.stderr


# Issue 30: "010" is 8 to CLI11 (base 0), C and the shell, 10 to Python: README promises it is refused,
# not read either way. Where a refusal failed, the run stops at once (no checkpoint, no weights) or is a
# two-step demo.
@pytest.mark.parametrize("args, option, value, expected", [
    (["translate", "--checkpoint", "none.safetensors", "5 March 2021"], "--beam", "010", "[1, 64]"),
    (["translate", "--checkpoint", "none.safetensors", "5 March 2021"], "--beam", "0100", "[1, 64]"),  # octal 64
    (["translate", "--checkpoint", "none.safetensors", "5 March 2021"], "--threads", "01", "[0, "),
    (["explore", "--checkpoint", "none.safetensors"], "--port", "010", "[0, 65535]"),
    (["explore", "--checkpoint", "none.safetensors"], "--port", "00", "[0, 65535]"),
    (["run"], "--heads", "08", "[1, 65536]"),  # not even octal
    (["bench-one", "--impl", "core", "--min-reps", "1", "--max-reps", "1", "--min-time", "0", "--max-time", "0"],
     "--n", "010", "[1, 4194304]"),
    (["demo", *tiny_demo()], "--seed", "010", "[0, 18446744073709551615]"),
    (["demo", *tiny_demo("--steps")], "--steps", "-01", "[1, 10000000]"),
    (["demo", *tiny_demo()], "--beams", "1,02", "[1, 64]"),
])
def test_integers_with_a_leading_zero_are_refused(tmp_path, args, option, value, expected):
    extra = {"run": ["--weights", tmp_path / "w", "--query", tmp_path / "q", "--out", tmp_path / "o.npy"],
             "demo": ["--out", tmp_path / "report"]}.get(args[0], [])
    result = mha(*args, *extra, option, value)
    refused(result, option, value.split(",")[-1], "leading zero", expected)
    assert not (tmp_path / "report").exists()


def test_grid_shapes_refuse_leading_zeros(tmp_path):
    result = mha("bench", "--out", tmp_path / "bench", "--grid-only", "--grid-shapes", "1:016:64", "--no-torch")
    refused(result, "--grid-shapes", 'entry "1:016:64": N must be a decimal integer in [1, 4194304] without leading')
    assert not (tmp_path / "bench").exists()


def test_thread_options_take_the_library_bound(tmp_path):
    import mha as mha_module
    bound = mha_module.max_num_threads()
    assert f"INT in [0, {bound}]" in mha("run", "--help").stdout
    refused(mha("heads", "--out", tmp_path / "heads", "--threads", bound + 1), "--threads", str(bound + 1))


@pytest.mark.parametrize("command, ranges", [
    ("run", ["--heads INT in [1, 65536]", "--threads INT in [0, "]),
    ("demo", ["--dropout FLOAT in [0, 0.99]", "--lr-factor FLOAT in [1e-06, 1000]", "--steps INT in [1, 10000000]",
              "--seed INT in [0, 18446744073709551615]", "--maps INT in [0, 6]"]),
    ("bench", ["--threads INT in [1, ", "--sizes INT in [1, 4194304]", "--torch-timeout FLOAT in [1, 604800]",
               "--grid-only", "--no-grid", "--grid-shapes TEXT:B:N:E[:h],...", "{onednn,openblas,installed}"]),
])
def test_help_states_the_ranges(command, ranges):
    result = mha(command, "--help")
    assert result.returncode == 0
    for text in ranges:
        assert text in result.stdout, (text, result.stdout)


# ---- output that cannot be written fails the command (issue 30) --------------------------------------------

@pytest.fixture(scope="module")
def command_inputs(tmp_path_factory):
    """What the commands below read: a two-step demo's checkpoint, a layer and its input."""
    import numpy as np
    import mha as mha_module
    folder = tmp_path_factory.mktemp("inputs")
    demo = mha("demo", "--out", folder / "demo", *tiny_demo())
    assert demo.returncode == 0, demo.stderr
    mha_module.MultiheadAttention(16, 4, batch_first=True).save(str(folder / "layer.safetensors"))
    np.save(folder / "x.npy", np.ones((2, 5, 16), np.float32))
    return folder


# Each writes a few lines to standard output, which sat in stdio's buffer until exit: they exited 0 (3 for
# translate's "?" answers) having written nothing.
OUTPUT_COMMANDS = {
    "--version": ["--version"],
    "--help": ["--help"],
    "help": ["help", "translate"],
    "translate": ["translate", "--checkpoint", "{inputs}/demo/checkpoint.safetensors", "5 March 2021"],
    "run": ["run", "--weights", "{inputs}/layer.safetensors", "--query", "{inputs}/x.npy", "--out", "{out}/o.npy"],
    "heads": ["heads", "--out", "{out}/heads", "--threads", "1"],
    "bench-one": ["bench-one", "--impl", "core", "--n", "8", "--warmup", "0", "--min-reps", "1", "--max-reps", "1",
                  "--min-time", "0", "--max-time", "0"],
    "demo": ["demo", "--out", "{out}/demo", *tiny_demo()],
}


@pytest.mark.parametrize("stdout, reason", [("/dev/full", "No space left on device"),
                                            ("closed", "Bad file descriptor")])
@pytest.mark.parametrize("command", sorted(OUTPUT_COMMANDS))
def test_output_that_cannot_be_written_fails_the_command(tmp_path, command_inputs, command, stdout, reason):
    args = [a.format(inputs=command_inputs, out=tmp_path) for a in OUTPUT_COMMANDS[command]]
    if stdout == "closed":  # `mha ... >&-`
        result = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", str(MHA), *args], stderr=subprocess.PIPE,
                                text=True, timeout=TIMEOUT_S)
    else:
        with open(stdout, "w") as full:
            result = subprocess.run([str(MHA), *args], stdout=full, stderr=subprocess.PIPE, text=True,
                                    timeout=TIMEOUT_S)
    assert result.returncode == 1, (result.returncode, result.stderr)
    # the reason on this line, or on the line of the write that failed first (a text longer than stdio's buffer)
    assert "mha: error: cannot write the output to standard output" in result.stderr, result.stderr
    assert f": {reason}\n" in result.stderr, result.stderr
    if command == "run":  # what was meant for standard output landed in no file the command wrote
        import numpy as np
        assert np.load(tmp_path / "o.npy").shape == (2, 5, 16)


def test_a_usage_error_keeps_its_status_when_standard_output_is_full():
    with open("/dev/full", "w") as full:
        result = subprocess.run([str(MHA), "translate", "--beam", "0"], stdout=full, stderr=subprocess.PIPE, text=True,
                                timeout=TIMEOUT_S)
    assert result.returncode == 2 and "cannot write" not in result.stderr, result.stderr


# ---- text from outside is escaped ---------------------------------------------------------------------

def test_translate_escapes_nul_and_escape_bytes_of_its_input(tmp_path):
    checkpoint = tmp_path / "checkpoint.safetensors"
    checkpoint.write_bytes(b"")  # the inputs are checked before the checkpoint is read
    result = mha("translate", "--checkpoint", checkpoint, stdin=b"5 March 2021\nab\x00cd\x1b[31m\n", text=False)
    assert result.returncode == 1
    stderr = result.stderr.decode("ascii")  # nothing but ASCII reaches the terminal
    assert b"\x1b" not in result.stderr and b"\x00" not in result.stderr
    assert 'line 2 "ab\\x00cd\\x1b[31m": control byte 0x00 at position 2' in stderr, stderr
    result = mha("translate", "--checkpoint", checkpoint, "\x1b[31mred", text=False)
    assert result.returncode == 1 and b"\x1b" not in result.stderr
    assert b'input 1 "\\x1b[31mred"' in result.stderr, result.stderr


def test_translate_escapes_the_checkpoint_name(tmp_path):
    result = mha("translate", "--checkpoint", str(tmp_path / "\x1b[2Jgone"), "5 March 2021", text=False)
    assert result.returncode == 1 and b"\x1b" not in result.stderr
    assert b"\\x1b[2Jgone" in result.stderr and b"no checkpoint at" in result.stderr


def test_error_messages_reach_the_terminal_without_control_bytes(tmp_path):
    result = mha("run", "--weights", str(tmp_path / "\x1b[31mw.safetensors"), "--heads", "2", "--query", "q.npy",
                 "--out", tmp_path / "o.npy", text=False)
    assert result.returncode == 1 and b"\x1b" not in result.stderr, result.stderr
    assert b"--weights" in result.stderr and b"\\x1b[31mw.safetensors" in result.stderr


# ---- the first word (issue 15, section 4) -----------------------------------------------------------------

@pytest.mark.parametrize("word, nearest", [("translat", "translate"), ("benhc", "bench"), ("dem", "demo"),
                                           ("Run", "run")])
def test_an_unknown_command_is_named_with_the_nearest_one(word, nearest):
    result = mha(word)
    refused(result, f"unknown command '{word}'", f"did you mean '{nearest}'?", "mha --help")
    assert "A subcommand is required" not in result.stderr


def test_an_unknown_command_far_from_every_command_lists_them():
    result = mha("frobnicate", "--x")
    refused(result, "unknown command 'frobnicate'", "commands: demo, translate, heads, bench, run")
    assert "did you mean" not in result.stderr


def test_help_works_as_a_command():
    assert mha("help").stdout == mha("--help").stdout != ""
    for command in ("run", "translate", "bench"):
        shown = mha("help", command)
        assert shown.returncode == 0 and shown.stdout == mha(command, "--help").stdout
    refused(mha("help", "nope"), "unknown command 'nope'")
