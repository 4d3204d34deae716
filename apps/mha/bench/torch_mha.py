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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, required=True, help="sequence length N = L = S")
    parser.add_argument("--causal", type=int, choices=(0, 1), default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "fwdbwd"), default="fwd")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--min-reps", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=1.0)
    parser.add_argument("--max-time", type=float, default=8.0)
    parser.add_argument("--max-reps", type=int, default=100)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, e = args.n, args.d_model
    module = torch.nn.MultiheadAttention(e, args.heads, batch_first=True)
    x = torch.randn(args.batch, n, e)  # [B, N, E]
    dout = torch.randn(args.batch, n, e)  # [B, N, E]
    # torch 1.13 has no is_causal: the causal mask is a boolean [N, N], True = may not attend.
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1) if args.causal else None

    if args.pass_ == "fwd":
        module.eval()

        def call():
            with torch.no_grad():
                module(x, x, x, need_weights=False, attn_mask=mask)
    else:
        module.train()
        x.requires_grad_(True)

        def call():
            module.zero_grad(set_to_none=True)
            x.grad = None
            out, _ = module(x, x, x, need_weights=False, attn_mask=mask)
            (out * dout).sum().backward()

    baseline = max_rss_bytes()
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

    json.dump({
        "impl": "torch",
        "n": n,
        "causal": bool(args.causal),
        "threads": torch.get_num_threads(),
        "pass": args.pass_,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "reps": len(times),
        "baseline_rss_bytes": baseline,
        "peak_rss_first_bytes": peak_first,
        "peak_rss_bytes": max_rss_bytes(),
        "version": torch.__version__,
        "python": sys.version.split()[0],
    }, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
