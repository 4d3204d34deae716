"""Every example in README.md runs: the Python block here (the C++ block in tests/readme/)."""
import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_a_python_example():
    assert len(python_blocks()) >= 1


def test_readme_python_example_runs_and_prints_what_it_says():
    for block in python_blocks():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(README), "exec"), {})
        # The example's comment states the printed shapes; the printed text must match it.
        for line in block.splitlines():
            if "print(" in line and "#" in line:
                expected = line.split("#", 1)[1].strip()
                assert out.getvalue().strip().endswith(expected), (out.getvalue(), expected)


def test_readme_shell_example_runs(tmp_path):
    """The ```sh block, run with bash in a scratch folder where build/ is the project's build."""
    import subprocess
    root = README.parent
    (tmp_path / "build").symlink_to(root / "build")
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "mha-heads" / "index.html").exists()
    assert (tmp_path / "mha-demo" / "index.html").exists()
    assert (tmp_path / "mha-demo" / "checkpoint.safetensors").exists()
    import numpy as np
    assert np.load(tmp_path / "out.npy").shape == (2, 5, 16)
    assert np.load(tmp_path / "weights.npy").shape == (2, 5, 5)
