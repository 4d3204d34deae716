"""pytest setup for the Python tests of mha.

The Makefile runs ``PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python``; when `mha` is
not importable that way (pytest started by hand), fall back to <repo>/build/python.
"""
import pathlib
import sys

try:
    import mha  # noqa: F401
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "build" / "python"))
    import mha  # noqa: F401

import torch

torch.set_num_threads(2)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def explore_checkpoint(tmp_path_factory):
    """A checkpoint of a short `mha demo` run, shared by the tests of `mha explore`."""
    from explore_server import MHA, train_checkpoint
    if not MHA.exists():
        pytest.skip("build/mha is not built")
    return train_checkpoint(tmp_path_factory.mktemp("explore") / "demo")
