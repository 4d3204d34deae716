"""What the tests of `mha bench` share: where the built program is, and one run of it that must succeed,
with the JSON report it writes. Performance is measured, not timed in tests: the tests read a run's rows,
never judge a time's value."""
import json
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
MHA = ROOT / "build" / "mha"


def run_bench(args, out, report):
    """`mha bench ARGS --out OUT` (at most 300 s), which must exit 0: (its stdout, the JSON in OUT/REPORT)."""
    result = subprocess.run([str(MHA), "bench", *args, "--out", str(out)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    return result.stdout, json.loads((pathlib.Path(out) / report).read_text())
