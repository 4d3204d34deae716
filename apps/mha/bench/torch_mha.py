#!/usr/bin/python3
"""The peer of `mha bench`: PyTorch's nn.MultiheadAttention on one shape, in a process of its own.

Self-attention on x: [B, N, E] (batch_first), E = d_model, h heads, with or without a causal mask.
  --pass fwd      eval mode, under torch.no_grad(): mha(x, x, x, need_weights=False)
  --pass fwdbwd   train mode: out = mha(x, x, x, need_weights=False); (out * dout).sum().backward(),
                  x.requires_grad, so the gradients of x and of every parameter are computed, as
                  mha::MultiHeadAttention::backward does.
Protocol (the same as `mha bench-one`): one warm-up call, then timed calls until at least
--min-reps calls and --min-time seconds, stopping early (after at least one) past --max-time seconds.
Prints one JSON object on stdout: the times, the peak resident set of this process after the first
call and at the end, and the peak before the first call (the baseline: Python, torch, the module and
the inputs). The peak is VmHWM from /proc/self/status rather than resource.getrusage's ru_maxrss,
which Linux carries over fork and exec from the parent process (here `mha bench`).

With --shapes B:N:E:h,... (the grid of `mha bench`, as `mha bench-grid` runs ours) it times every
shape, non-causal, --pass fwd then fwdbwd, in this one process, and prints one JSON object per shape and
pass as it goes: the times, without memory figures (a peak over many shapes says nothing about one).

Both modes report "blas_library": the BLAS library this process loaded (its sgemm_ serves PyTorch's
float32 products), so that a run shows which one it measured.

Run with Debian's /usr/bin/python3 (python3-torch 1.13).
"""
import argparse
import json
import resource
import statistics
import sys
import time

import torch


def max_rss_bytes():
    """The peak resident set of this process's address space so far, in bytes."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def blas_library():
    """The BLAS shared object mapped into this process (libmha_onednn_blas.so wins: it is preloaded)."""
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                name = path.rsplit("/", 1)[-1]
                if "blas" in name or "blis" in name or "mkl_rt" in name:
                    found.add(path)
    except OSError:
        return ""
    for path in sorted(found):
        if "libmha_onednn_blas" in path:
            return path
    return ", ".join(sorted(found))


def parse_shapes(spec):
    """"B:N:E:h,..." (h = E / 64 when left out) into (B, N, E, h) tuples."""
    shapes = []
    for entry in spec.split(","):
        fields = [int(x) for x in entry.split(":")]
        if len(fields) == 3:
            fields.append(fields[2] // 64)
        if len(fields) != 4 or min(fields) < 1 or fields[2] % fields[3]:
            raise SystemExit(f"torch_mha.py: --shapes: bad entry {entry!r} (expected B:N:E or B:N:E:h)")
        shapes.append(tuple(fields))
    return shapes


def make_call(batch, n, e, heads, causal, pass_, dtype=torch.float32):
    """The timed call: one forward (eval, no_grad) or one training step (train, forward + backward),
    with the module's parameters and the inputs in `dtype` (float32, or bfloat16: the module as
    `.to(torch.bfloat16)` makes it, whose products run on oneDNN)."""
    module = torch.nn.MultiheadAttention(e, heads, batch_first=True).to(dtype)
    x = torch.randn(batch, n, e).to(dtype)  # [B, N, E]
    dout = torch.randn(batch, n, e).to(dtype)  # [B, N, E]
    # torch 1.13 has no is_causal: the causal mask is a boolean [N, N], True = may not attend.
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1) if causal else None

    if pass_ == "fwd":
        module.eval()

        def call():
            with torch.no_grad():
                module(x, x, x, need_weights=False, attn_mask=mask)
        return call

    module.train()
    x.requires_grad_(True)

    def call():
        module.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = module(x, x, x, need_weights=False, attn_mask=mask)
        (out * dout).sum().backward()
    return call


def time_call(call, args):
    """The protocol of `mha bench-one`: the times of the timed calls and the peak RSS after the first call."""
    for _ in range(args.warmup):
        call()
    if args.warmup == 0:  # the first timed call is the first call
        start = time.perf_counter()
        call()
        times = [time.perf_counter() - start]
    else:
        times = []
    peak_first = max_rss_bytes()
    elapsed = sum(times)
    while len(times) < args.max_reps and (len(times) < args.min_reps or elapsed < args.min_time):
        if len(times) >= 1 and elapsed > args.max_time:
            break
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        elapsed += times[-1]
    return times, peak_first


def print_json(fields):
    fields.update({"version": torch.__version__, "python": sys.version.split()[0], "blas_library": blas_library()})
    json.dump(fields, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()


def run_grid(args):
    for batch, n, e, heads in parse_shapes(args.shapes):
        for pass_ in ("fwd", "fwdbwd"):
            torch.manual_seed(0)
            times, _ = time_call(make_call(batch, n, e, heads, False, pass_), args)
            print_json({"impl": "torch", "batch": batch, "n": n, "d_model": e, "heads": heads,
                        "threads": torch.get_num_threads(), "pass": pass_, "median_s": statistics.median(times),
                        "min_s": min(times), "reps": len(times)})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, help="sequence length N = L = S (required without --shapes)")
    parser.add_argument("--shapes", help="the grid: B:N:E:h entries, comma-separated (non-causal, both passes)")
    parser.add_argument("--causal", type=int, choices=(0, 1), default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "fwdbwd"), default="fwd")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--min-reps", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=1.0)
    parser.add_argument("--max-time", type=float, default=8.0)
    parser.add_argument("--max-reps", type=int, default=100)
    args = parser.parse_args()
    if (args.n is None) == (args.shapes is None):
        parser.error("give --n (one shape) or --shapes (the grid)")

    torch.set_num_threads(args.threads)
    if args.shapes is not None:
        run_grid(args)
        return
    torch.manual_seed(0)
    call = make_call(args.batch, args.n, args.d_model, args.heads, args.causal, args.pass_,
                     getattr(torch, args.dtype))
    baseline = max_rss_bytes()
    times, peak_first = time_call(call, args)
    print_json({
        "impl": "torch",
        "n": args.n,
        "causal": bool(args.causal),
        "threads": torch.get_num_threads(),
        "pass": args.pass_,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "reps": len(times),
        "baseline_rss_bytes": baseline,
        "peak_rss_first_bytes": peak_first,
        "peak_rss_bytes": max_rss_bytes(),
    })


if __name__ == "__main__":
    main()
