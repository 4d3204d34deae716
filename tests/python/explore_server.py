"""Helpers of the tests of `mha explore` (test_explore.py, test_explore_page.py): a short demo run for a
checkpoint, the server as a subprocess on a free loopback port, and a small HTTP client."""
import contextlib
import http.client
import json
import pathlib
import select
import signal
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
MHA = ROOT / "build" / "mha"

# A short run (about 15 s; ~10% of held-out dates right): 2 layers of each kind so that switching off a head of layer 0 changes the maps
# of layer 1; the answers need not be right.
DEMO = ["--steps", "300", "--batch", "32", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--layers", "2",
        "--eval", "100", "--eval-every", "300", "--maps", "0", "--no-progress", "--threads", "2"]


def train_checkpoint(folder):
    result = subprocess.run([str(MHA), "demo", "--out", str(folder), *DEMO], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder / "checkpoint.safetensors"


@contextlib.contextmanager
def explore_server(checkpoint, *extra, stop=signal.SIGINT):
    """`mha explore` on a free loopback port (--port 0: the server picks one and prints it); yields
    (base URL, process). Stops it with `stop` and checks that it exits with status 0 within 20 s."""
    process = subprocess.Popen([str(MHA), "explore", "--checkpoint", str(checkpoint), "--port", "0", *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready, "mha explore printed no address within 60 s"
        line = process.stdout.readline()
        assert line.startswith("mha explore: http://"), line + process.stderr.read()
        yield line.split()[2].rstrip("/"), process
        process.send_signal(stop)
        out, err = process.communicate(timeout=20)
        process.stdout_text, process.stderr_text = out, err
        assert process.returncode == 0, (process.returncode, out, err)
        assert "mha explore: stopped" in out, out
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def request(base, method, path, body=None, raw=None, timeout=60):
    """(status, JSON answer) of one request; body is sent as JSON, raw as given bytes."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": "application/json"} if data is not None else {}
        connection.request(method, path, body=data, headers=headers)
        response = connection.getresponse()
        text = response.read()
        kind = response.getheader("Content-Type", "")
        return response.status, (json.loads(text) if kind.startswith("application/json") else text.decode())
    finally:
        connection.close()


def wait_for(condition, timeout=60, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
