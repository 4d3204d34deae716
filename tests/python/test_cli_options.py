"""The command line and what it prints (issue 10: no silent wrong answers, no crashes): text from outside
reaches the terminal escaped."""
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MHA = ROOT / "build" / "mha"

pytestmark = pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built")

TIMEOUT_S = 120  # a run that gets past the command line when it should not must not hang the suite


def mha(*args, stdin=None, text=True):
    return subprocess.run([str(MHA), *map(str, args)], capture_output=True, text=text, input=stdin,
                          timeout=TIMEOUT_S)


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
