"""No silent wrong answers, no crashes, at the file boundary of the Python API.

* The writers store float32, float64 and bool arrays and refuse every other dtype, naming it (an
  integer array used to be stored as bool: [0, 1, 2, 300] read back as [False, True, True, True]).
* Saving follows a symbolic link to its target (the link stays) and refuses a path holding anything but
  a regular file: a FIFO, a directory, a socket, a character device (made in tmp_path, root only).
* A path with a NUL byte is refused, not cut; bytes and os.PathLike paths are the names the OS gets.
* mha.load refuses bad metadata with mha.Error naming the key and the value.
* Sizes whose products overflow 64 bits raise mha.Error; sizes that fit but cannot be allocated raise
  MemoryError.
"""
import os
import pathlib
import socket
import stat
import subprocess

import numpy as np
import pytest

import mha

F32 = np.arange(6, dtype=np.float32).reshape(2, 3)


def _layer():
    return mha.MultiheadAttention(4, 2, seed=3)


# Every writer, as (name, write(path), wrote(path)): wrote is True when path holds what write wrote.
WRITERS = [
    ("write_npy", lambda p: mha.write_npy(p, F32),
     lambda p: np.array_equal(mha.read_npy(p), F32)),
    ("write_safetensors", lambda p: mha.write_safetensors(p, {"t": F32}, {"k": "v"}),
     lambda p: np.array_equal(mha.read_safetensors(p)[0]["t"], F32)),
    ("save", lambda p: _layer().save(p),
     lambda p: np.array_equal(mha.load(p).parameter("in_proj_weight"),
                              _layer().parameter("in_proj_weight"))),
]
WRITER_IDS = [w[0] for w in WRITERS]


# ---- dtypes the writers do not store --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int16, np.int8, np.uint8, np.uint64, np.float16,
                                   np.complex64, np.longdouble])
def test_writers_refuse_dtypes_they_do_not_store(tmp_path, dtype):
    array = np.array([0, 1, 2, 300]).astype(dtype)
    name = np.dtype(dtype).name
    with pytest.raises(mha.Error, match=rf"^tensors\['x'\]: expected a bool, float32 or float64 .*got {name}$"):
        mha.write_safetensors(tmp_path / "a.safetensors", {"x": array})
    with pytest.raises(mha.Error, match=rf"^array: expected a bool, float32 or float64 .*got {name}$"):
        mha.write_npy(tmp_path / "a.npy", array)
    assert os.listdir(tmp_path) == []


def test_writers_still_store_bool_float32_and_float64(tmp_path):
    arrays = {"b": np.array([True, False, True]), "f": F32, "d": np.array([0.1, 1e300])}
    mha.write_safetensors(tmp_path / "a.safetensors", arrays)
    read = mha.read_safetensors(tmp_path / "a.safetensors")[0]
    for key, array in arrays.items():
        assert read[key].dtype == array.dtype and np.array_equal(read[key], array)
        mha.write_npy(tmp_path / f"{key}.npy", array)
        again = mha.read_npy(tmp_path / f"{key}.npy")
        assert again.dtype == array.dtype and np.array_equal(again, array)


def test_masks_still_accept_integer_arrays():
    """Only the writers became strict: a uint8 / int64 mask is still read as bool (nonzero = True)."""
    layer = _layer().eval()
    x = np.random.default_rng(0).standard_normal((3, 1, 4)).astype(np.float32)
    want = layer(x, x, x, attn_mask=np.triu(np.ones((3, 3), bool), 1))[0]
    for dtype in (np.uint8, np.int64):
        got = layer(x, x, x, attn_mask=np.triu(np.ones((3, 3), dtype), 1))[0]
        assert np.array_equal(got, want)


@pytest.mark.parametrize("name", ["a\udcff", 5, b"x"])
def test_write_safetensors_refuses_names_that_are_not_utf8_str(tmp_path, name):
    with pytest.raises(mha.Error, match="^tensors key: "):
        mha.write_safetensors(tmp_path / "a.safetensors", {name: F32})
    with pytest.raises(mha.Error, match="^metadata"):
        mha.write_safetensors(tmp_path / "a.safetensors", {"t": F32}, {"k": name})
    with pytest.raises(mha.Error, match="^state_dict key: "):
        _layer().load_state_dict({name: F32})


# ---- what is at the path ---------------------------------------------------------------------------
@pytest.mark.parametrize("writer", WRITERS, ids=WRITER_IDS)
def test_symbolic_links_are_written_through_to_their_target(tmp_path, writer):
    _, write, wrote = writer
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "target").write_bytes(b"old contents")
    os.symlink("sub/target", tmp_path / "relative")
    os.symlink(tmp_path / "relative", tmp_path / "chained")
    os.symlink("sub/not_yet", tmp_path / "dangling")
    for link in ("relative", "chained", "dangling"):
        write(tmp_path / link)
        assert os.path.islink(tmp_path / link), f"{link} was replaced"
    assert wrote(tmp_path / "sub" / "target") and wrote(tmp_path / "sub" / "not_yet")
    assert sorted(os.listdir(tmp_path)) == ["chained", "dangling", "relative", "sub"]
    assert sorted(os.listdir(tmp_path / "sub")) == ["not_yet", "target"]


@pytest.mark.parametrize("writer", WRITERS, ids=WRITER_IDS)
def test_fifos_directories_and_sockets_are_refused_and_left_as_they_were(tmp_path, writer):
    _, write, _ = writer
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "directory").mkdir()
    os.symlink("fifo", tmp_path / "link_to_fifo")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(tmp_path / "socket"))
    try:
        for name, kind in [("fifo", "is a FIFO"), ("directory", "is a directory"),
                           ("link_to_fifo", "links to .* a FIFO"), ("socket", "is a socket")]:
            with pytest.raises(mha.Error, match=f"^{tmp_path / name}: {kind}, not a regular file"):
                write(tmp_path / name)
    finally:
        server.close()
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    assert stat.S_ISDIR(os.lstat(tmp_path / "directory").st_mode)
    assert os.path.islink(tmp_path / "link_to_fifo")
    assert stat.S_ISSOCK(os.lstat(tmp_path / "socket").st_mode)
    assert sorted(os.listdir(tmp_path)) == ["directory", "fifo", "link_to_fifo", "socket"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mknod of a device needs root")
@pytest.mark.parametrize("writer", WRITERS, ids=WRITER_IDS)
def test_a_character_device_is_refused_and_left_as_it_was(tmp_path, writer):
    """A /dev/null-like node (major 1, minor 3) made in tmp_path; no real device is written to."""
    _, write, _ = writer
    device = tmp_path / "null_like"
    os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with pytest.raises(mha.Error, match="is a character device, not a regular file"):
        write(device)
    st = os.lstat(device)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert os.listdir(tmp_path) == ["null_like"]


# ---- what the path is ------------------------------------------------------------------------------
@pytest.mark.parametrize("writer", WRITERS, ids=WRITER_IDS)
def test_a_path_with_a_nul_byte_is_refused_not_cut(tmp_path, writer):
    _, write, _ = writer
    for path in (f"{tmp_path}/zz\0.out", os.fsencode(f"{tmp_path}/zz\0.out")):
        with pytest.raises(mha.Error, match=r"zz\\x00\.out'?: the path contains a NUL byte"):
            write(path)
    assert os.listdir(tmp_path) == []


def test_readers_refuse_a_path_with_a_nul_byte(tmp_path):
    mha.write_npy(tmp_path / "zz", F32)  # what a cut path would find
    for read in (mha.read_npy, mha.read_safetensors, mha.load):
        with pytest.raises(mha.Error, match="NUL byte"):
            read(f"{tmp_path}/zz\0.npy")


@pytest.mark.parametrize("writer", WRITERS, ids=WRITER_IDS)
def test_bytes_and_pathlike_paths_are_the_names_the_os_gets(tmp_path, writer):
    _, write, wrote = writer
    write(os.fsencode(tmp_path / "from_bytes"))
    write(tmp_path / "from_pathlib")
    undecodable = os.fsencode(tmp_path) + b"/\xff\xfe"  # not UTF-8: Python names it '\udcff\udcfe'
    write(undecodable)
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"from_bytes", b"from_pathlib", b"\xff\xfe"]
    assert wrote(undecodable) and wrote(os.fsdecode(undecodable)) and wrote(tmp_path / "from_bytes")


@pytest.mark.parametrize("path", [5, None, 1.5])
def test_a_path_of_another_type_is_refused(path):
    with pytest.raises(mha.Error, match="^path: expected a str, bytes or os.PathLike path"):
        mha.read_npy(path)


def test_errors_on_undecodable_paths_keep_their_message(tmp_path):
    """Undecodable bytes of a path show as \\xNN; the message used to be lost (empty)."""
    missing = os.fsencode(tmp_path) + b"/missing\xff.npy"
    with pytest.raises(mha.Error, match=r"missing\\xff\.npy: cannot open"):
        mha.read_npy(missing)
    plain = os.fsencode(tmp_path) + b"/plain\xff.safetensors"
    mha.write_safetensors(plain, {"t": F32}, {"format": "mha"})
    with pytest.raises(mha.Error, match=r"plain\\xff\.safetensors: __metadata__: missing 'd_model'"):
        mha.load(plain)


# ---- mha.load and the file's metadata --------------------------------------------------------------
def _saved_with(tmp_path, **changes):
    path = tmp_path / "layer.safetensors"
    _layer().save(path)
    tensors, meta = mha.read_safetensors(path)
    for key, value in changes.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    mha.write_safetensors(path, tensors, meta)
    return path


@pytest.mark.parametrize("key", ["bias", "add_bias_kv", "add_zero_attn", "batch_first"])
@pytest.mark.parametrize("value", ["yes", "True", "False", "1", "0", ""])
def test_load_booleans_are_exactly_true_or_false(tmp_path, key, value):
    path = _saved_with(tmp_path, **{key: value})
    with pytest.raises(mha.Error, match=f"__metadata__: {key} must be true or false, got '{value}'"):
        mha.load(path)


@pytest.mark.parametrize("key, value, message", [
    ("d_model", "x", "d_model must be an integer, got 'x'"),
    ("num_heads", "2.5", "num_heads must be an integer, got '2.5'"),
    ("d_k", "99999999999999999999", "d_k must be an integer that fits 64 bits, got '99999999999999999999'"),
    ("dropout", "abc", "dropout must be a number, got 'abc'"),
    ("dtype", "int8", "dtype must be float32, float64 or bfloat16, got 'int8'"),
    ("vdim", None, "missing 'vdim'"),
])
def test_load_refuses_bad_metadata_naming_the_key_and_value(tmp_path, key, value, message):
    path = _saved_with(tmp_path, **{key: value})
    with pytest.raises(mha.Error) as error:
        mha.load(path)
    assert str(error.value).startswith(f"{path}: __metadata__: {message}")


def test_load_refuses_sizes_that_overflow_naming_the_file(tmp_path):
    """num_heads = d_k = 2**32 used to build a layer with zero-size weights."""
    big = str(2**32)
    path = _saved_with(tmp_path, d_model=big, num_heads=big, d_k=big, d_v=big, kdim=big, vdim=big)
    with pytest.raises(mha.Error, match=f"^{path}: num_heads \\* d_k = {big} \\* {big} is too large"):
        mha.load(path)


# ---- sizes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, pattern", [
    (dict(embed_dim=2**32, num_heads=2**32, d_k=2**32, d_v=2**32), r"^num_heads \* d_k = "),
    (dict(embed_dim=2**62, num_heads=1), r"^embed_dim: 4611686018427387904 is too large"),
    (dict(embed_dim=2**31, num_heads=1), r"^\(2 \* num_heads \* d_k \+ num_heads \* d_v\) \* embed_dim = "),
    (dict(embed_dim=8, num_heads=2, kdim=2**58), r"^num_heads \* d_k \* kdim = "),
    (dict(embed_dim=2**64, num_heads=1), r"^embed_dim: expected an integer that fits 64 bits"),
    (dict(embed_dim=8, num_heads=-2**63 - 1), r"^num_heads: expected an integer that fits 64 bits"),
    (dict(embed_dim=8.0, num_heads=2), r"^embed_dim: expected an integer, got 8.0"),
    (dict(embed_dim=8, num_heads=2, seed=2**64), r"^seed: expected an integer in \[0, 2\*\*64\)"),
    (dict(embed_dim=8, num_heads=2, seed=-1), r"^seed: expected an integer in \[0, 2\*\*64\)"),
])
def test_sizes_that_overflow_raise_mha_error(kwargs, pattern):
    with pytest.raises(mha.Error, match=pattern):
        mha.MultiheadAttention(**kwargs)


def test_sizes_that_fit_but_cannot_be_allocated_raise_memory_error():
    """in_proj_weight [3 * 2**29, 2**29] float32 is 3 * 2**60 bytes: representable, never allocatable
    (more than any machine's address space), so the allocation fails before any memory is touched."""
    with pytest.raises(MemoryError):
        mha.MultiheadAttention(embed_dim=2**29, num_heads=1)


# ---- the `mha run` command writes through the same writers -----------------------------------------
MHA = pathlib.Path(__file__).resolve().parents[2] / "build" / "mha"


@pytest.mark.skipif(not MHA.exists(), reason="build/mha is not built")
def test_mha_run_out_follows_links_and_refuses_a_fifo(tmp_path):
    mha.MultiheadAttention(4, 2, batch_first=True, seed=1).save(tmp_path / "layer.safetensors")
    np.save(tmp_path / "x.npy", np.ones((1, 3, 4), np.float32))
    os.mkfifo(tmp_path / "fifo")
    os.symlink("target.npy", tmp_path / "link.npy")

    def run(out, weights_out):
        return subprocess.run([str(MHA), "run", "--weights", tmp_path / "layer.safetensors", "--query",
                               tmp_path / "x.npy", "--out", out, "--weights-out", weights_out],
                              capture_output=True, text=True, timeout=60)

    refused = run(tmp_path / "fifo", tmp_path / "w.npy")
    assert refused.returncode != 0 and "is a FIFO, not a regular file" in refused.stderr, refused
    refused = run(tmp_path / "out.npy", tmp_path / "fifo")
    assert refused.returncode != 0 and "is a FIFO, not a regular file" in refused.stderr, refused
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)

    done = run(tmp_path / "link.npy", tmp_path / "w.npy")
    assert done.returncode == 0, done
    assert os.path.islink(tmp_path / "link.npy")
    assert np.load(tmp_path / "target.npy").shape == (1, 3, 4)
