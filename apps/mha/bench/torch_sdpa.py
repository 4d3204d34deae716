#!/usr/bin/python3
"""The Python side of `mha bench --torch-sdpa` (issue 34's benchmark), one mode per process.

Two implementations of attention on q, k, v [1, h, N, d] (h 8, d 64), float32 or bfloat16:
  mha     mha.torch.scaled_dot_product_attention(q, k, v, is_causal=causal): the registered operator
  torch   torch 1.13's best by hand: s = (q * scale) @ k^T [1, h, N, N]; s += mask (causal: a float
          [N, N], -inf above the diagonal); softmax(s, -1) @ v. float32 products go to the BLAS the
          parent process chose (its LD_PRELOAD / LD_LIBRARY_PATH); bfloat16 ones to oneDNN (torch's
          mkldnn bf16 matmul).
A call is a forward under torch.no_grad() (--pass fwd), or a forward and out.backward(dout) with q, k
and v requiring grad (--pass fwdbwd).

Modes (each prints JSON lines on stdout, one per case of --cases at N = --n):
  --mode speed     both implementations, one warm-up call each, then --repeats calls of each
                   alternately (mha, torch, mha, torch, ...): every call's time, medians and mins.
  --mode memory    one implementation per case, in a child forked for the case from this process (which
                   has imported torch and mha and run nothing): the inputs are made, the peak resident
                   set (VmHWM) is reset through /proc/self/clear_refs ("5"), one call runs, and the new
                   VmHWM less the resident set before the call is the call's peak memory; then again,
                   after malloc_trim(0) has returned the first call's freed pages: the first figure
                   includes what a first call pages in once (library code, oneDNN's JIT), the second is
                   what each call needs. torch 1.13's CPU allocator keeps no statistics and tracemalloc
                   does not see its allocations; VmHWM counts every page touched, whoever allocated it.
  --mode overhead  the small shape [1, 8, 64, 64] float32 forward: mha.torch.scaled_dot_product_attention,
                   torch.ops.mha.scaled_dot_product_attention called directly, and the pybind11 function
                   mha.scaled_dot_product_attention on NumPy arrays, in blocks of --calls calls taken in
                   turn, --blocks blocks each: seconds per call of each block.
  --mode config    the BLAS torch was built for and the one this process loaded.

Run with Debian's /usr/bin/python3 (python3-torch 1.13) and --mha-path DIR (build/python) first on sys.path.
"""
import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback

HEADS, WIDTH = 8, 64  # h, d


def status_kib(field):
    """A "Field:   123 kB" line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak():
    """Resets VmHWM to the current resident set (Linux 4.0+); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def blas_library():
    """The BLAS shared objects mapped into this process (libmha_onednn_blas.so when preloaded)."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            name = fields[-1].rsplit("/", 1)[-1] if len(fields) >= 6 else ""
            if "blas" in name or "blis" in name or "mkl_rt" in name:
                found.add(fields[-1])
    return ", ".join(sorted(found))


def make_inputs(torch, n, dtype, pass_):
    """q, k, v, dout [1, h, N, d] in `dtype`, seeded; q, k, v require grad for fwdbwd."""
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, HEADS, n, WIDTH).to(dtype) for _ in range(4))
    if pass_ == "fwdbwd":
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v, dout


def make_call(torch, impl, n, dtype, causal, pass_):
    """The timed call of `impl` on fresh inputs: forward (no_grad) or forward + backward."""
    import mha.torch
    q, k, v, dout = make_inputs(torch, n, dtype, pass_)
    scale = 1.0 / math.sqrt(WIDTH)
    mask = torch.full((n, n), float("-inf"), dtype=dtype).triu(1) if causal else None  # [N, N]

    def torch_attention():
        s = torch.matmul(q * scale, k.transpose(-2, -1))  # [1, h, N, N]
        if mask is not None:
            s.add_(mask)  # in place: matmul's backward needs its inputs, not s
        return torch.matmul(torch.softmax(s, dim=-1), v)

    def mha_attention():
        return mha.torch.scaled_dot_product_attention(q, k, v, is_causal=causal)

    forward = mha_attention if impl == "mha" else torch_attention
    if pass_ == "fwd":
        def call():
            with torch.no_grad():
                forward()
        return call

    def call():
        for t in (q, k, v):
            t.grad = None
        forward().backward(dout)
    return call


def timed(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def summary(times):
    return {"median_s": statistics.median(times), "min_s": min(times), "calls_s": times}


def parse_cases(spec, with_impl):
    """"[impl:]dtype:causal:pass,..." into tuples; dtype float32 or bfloat16, causal 0 or 1, pass fwd or fwdbwd."""
    cases = []
    for entry in spec.split(","):
        fields = entry.split(":")
        impl = fields.pop(0) if with_impl and fields else "mha"
        if (len(fields) != 3 or impl not in ("mha", "torch") or fields[0] not in ("float32", "bfloat16")
                or fields[1] not in ("0", "1") or fields[2] not in ("fwd", "fwdbwd")):
            raise SystemExit(f"torch_sdpa.py: --cases: bad entry {entry!r}")
        cases.append((impl, fields[0], fields[1] == "1", fields[2]))
    return cases


def case_fields(dtype, causal, pass_):
    return {"dtype": dtype, "causal": causal, "pass": pass_}


def run_speed(torch, args):
    """One line per case: both implementations, a warm-up call each, then --repeats calls of each in turn."""
    for _, dtype, causal, pass_ in parse_cases(args.cases, with_impl=False):
        calls = {impl: make_call(torch, impl, args.n, getattr(torch, dtype), causal, pass_)
                 for impl in ("mha", "torch")}
        for call in calls.values():  # warm-up: first-touch page faults, oneDNN's JIT
            call()
        times = {impl: [] for impl in calls}
        for _ in range(args.repeats):
            for impl, call in calls.items():
                times[impl].append(timed(call))
        fields = {impl: summary(t) for impl, t in times.items()}
        print_line(torch, args, {**fields, **case_fields(dtype, causal, pass_)})
        del calls


def measured_call(call):
    """(peak above the resident set before the call, that resident set, the call's seconds, whether VmHWM was
    reset): one call with the peak reset just before it."""
    gc.collect()
    reset = reset_peak()
    before = status_kib("VmRSS")
    seconds = timed(call)
    return status_kib("VmHWM") - before, before, seconds, reset


def memory_child(torch, args, impl, dtype, causal, pass_, out):
    """In the forked child: the inputs, then two measured calls, the second after glibc has returned the first's
    freed pages (malloc_trim): the first counts what a first call pages in once (library code, oneDNN's JIT),
    the second what every call needs. Its line goes to `out`."""
    import ctypes
    import mha
    torch.set_num_threads(args.threads)
    mha.set_num_threads(args.threads)
    call = make_call(torch, impl, args.n, getattr(torch, dtype), causal, pass_)
    first, first_before, first_s, first_reset = measured_call(call)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    peak, before, seconds, reset = measured_call(call)
    fields = {"impl": impl, "hwm_reset": reset and first_reset, "rss_before_bytes": before,
              "peak_rss_bytes": before + peak, "peak_above_inputs_bytes": peak, "call_s": seconds,
              "first_call_peak_above_inputs_bytes": first, "first_call_rss_before_bytes": first_before,
              "first_call_s": first_s, **case_fields(dtype, causal, pass_)}
    out.write(json.dumps(fields).encode())


def run_memory(torch, args):
    """One line per case, each measured in a child forked from this process, which has imported torch and mha
    and run nothing: a fresh heap and address space per case (forked before any OpenMP thread exists, so the
    child can start its own). A child that dies (e.g. out of memory) gives a line with "error"."""
    for impl, dtype, causal, pass_ in parse_cases(args.cases, with_impl=True):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            status = 0
            with os.fdopen(write_end, "wb") as out:
                try:
                    memory_child(torch, args, impl, dtype, causal, pass_, out)
                except BaseException as e:  # noqa: B902: the child must exit, whatever happened; why goes up
                    out.write(json.dumps({"error": "".join(traceback.format_exception_only(e)).strip()}).encode())
                    status = 1
            os._exit(status)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            text = pipe.read()
        _, status = os.waitpid(pid, 0)
        try:
            fields = json.loads(text)
        except ValueError:
            fields = {}
        if status != 0 or "error" in fields or not fields:
            why = fields.get("error", "no output")
            fields = {"impl": impl, "error": f"the measuring process ended with wait status {status}: {why}",
                      **case_fields(dtype, causal, pass_)}
        print_line(torch, args, fields)


def run_overhead(torch, args):
    import numpy as np
    import mha
    import mha.torch
    shape = (1, HEADS, args.n, WIDTH)
    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape) for _ in range(3))
    qn, kn, vn = (np.ascontiguousarray(t.numpy()) for t in (q, k, v))
    op = torch.ops.mha.scaled_dot_product_attention
    calls = {
        "function": lambda: mha.torch.scaled_dot_product_attention(q, k, v),
        "operator": lambda: op(q, k, v, None, 0.0, False, None, False, None, None, None, None),
        "pybind11": lambda: mha.scaled_dot_product_attention(qn, kn, vn),
    }
    for call in calls.values():
        for _ in range(args.calls):
            call()
    blocks = {name: [] for name in calls}
    for _ in range(args.blocks):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            blocks[name].append((time.perf_counter() - start) / args.calls)
    return {name: {"median_s": statistics.median(b), "min_s": min(b), "blocks_s": b} for name, b in blocks.items()}


def run_config(torch):
    import mha.torch
    info = torch.__config__.show()
    build_blas = next((part.split("=", 1)[1] for line in info.splitlines() for part in line.replace(",", " ").split()
                       if part.startswith("BLAS_INFO=")), "")
    return {"build_blas_info": build_blas, "mkldnn": torch.backends.mkldnn.is_available(),
            "operators_loaded": hasattr(torch.ops.mha, "scaled_dot_product_attention")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("speed", "memory", "overhead", "config"), required=True)
    parser.add_argument("--mha-path", required=True, help="the directory holding the built mha package")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n", type=int, default=64, help="N = L = S")
    parser.add_argument("--cases", default="float32:0:fwd",
                        help="speed: dtype:causal:pass,...; memory: impl:dtype:causal:pass,... (impl mha or torch)")
    parser.add_argument("--repeats", type=int, default=3, help="speed: timed calls of each after a warm-up")
    parser.add_argument("--calls", type=int, default=200, help="overhead: calls per block")
    parser.add_argument("--blocks", type=int, default=15, help="overhead: blocks of each")
    args = parser.parse_args()
    if min(args.threads, args.n, args.repeats, args.calls, args.blocks) < 1:
        parser.error("--threads, --n, --repeats, --calls and --blocks must be positive")
    sys.path.insert(0, args.mha_path)
    import torch
    import mha
    if args.mode != "memory":  # the memory children set it: no OpenMP threads before the fork
        torch.set_num_threads(args.threads)
        mha.set_num_threads(args.threads)
    if args.mode == "speed":
        run_speed(torch, args)
    elif args.mode == "memory":
        run_memory(torch, args)
    elif args.mode == "overhead":
        print_line(torch, args, run_overhead(torch, args))
    else:
        print_line(torch, args, run_config(torch))


def print_line(torch, args, fields):
    fields.update({"mode": args.mode, "n": args.n, "threads": args.threads, "version": torch.__version__,
                   "python": sys.version.split()[0], "blas_library": blas_library()})
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
