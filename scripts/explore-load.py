#!/usr/bin/env python3
"""A bounded load test of `mha explore` (docs/EXPLORE.md): REQUESTS requests from CLIENTS concurrent
clients, each on its own keep-alive connection, within TIME_LIMIT seconds; reports the errors and the
median and 99th-percentile latency. Standard library only.

    scripts/explore-load.py http://127.0.0.1:8765 [--requests 2000] [--clients 16] [--time-limit 300]

The requests: translations of a rotating set of inputs, each with no head off or with one of a few
head sets switched off, and one in 20 an /api/accuracy of one of those head sets (computed once by
the server, then cached). An error is a transport failure or any status but 200. Exit status 0 when
every request was answered with 200 within the time limit, 1 otherwise."""
import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse

INPUTS = ["Friday, 5 March 2021", "05/03/2021", "the fifth of March 2021", "Fri, 5 Mar 21", "1999-12-31",
          "March 5th, 2021", "5-Mar-2021", "20210305", "31 February 2021", "5.3.2021"]
HEAD_SETS = [[], [[0, "cross", 0]], [[0, "encoder_self", 1]], [[0, "decoder_self", 0], [0, "cross", 1]]]


def request_body(i):
    heads = HEAD_SETS[i % len(HEAD_SETS)]
    if i % 20 == 19:
        return "/api/accuracy", {"heads_off": heads}
    return "/api/translate", {"text": INPUTS[i % len(INPUTS)], "heads_off": heads}


class Client(threading.Thread):
    def __init__(self, url, next_index, deadline, results):
        super().__init__(daemon=True)
        self.url, self.next_index, self.deadline, self.results = url, next_index, deadline, results
        self.connection = None

    def connect(self):
        self.connection = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=60)

    def run(self):
        while time.monotonic() < self.deadline:
            i = self.next_index()
            if i is None:
                return
            path, body = request_body(i)
            start = time.monotonic()
            try:
                if self.connection is None:
                    self.connect()
                self.connection.request("POST", path, body=json.dumps(body),
                                        headers={"Content-Type": "application/json"})
                response = self.connection.getresponse()
                response.read()
                error = None if response.status == 200 else f"HTTP {response.status} on {path}"
                if response.getheader("Connection", "").lower() == "close":
                    self.connection.close()
                    self.connection = None
            except (OSError, http.client.HTTPException) as e:
                error = f"{type(e).__name__} on {path}: {e}"
                if self.connection is not None:
                    self.connection.close()
                self.connection = None
            self.results.append((time.monotonic() - start, error))


def percentile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8765")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds")
    args = parser.parse_args()
    url = urllib.parse.urlsplit(args.url)
    if url.scheme != "http" or not url.hostname or not url.port:
        parser.error(f"expected http://HOST:PORT, got {args.url!r}")
    if args.requests < 1 or args.clients < 1 or not args.time_limit > 0:
        parser.error("--requests and --clients must be positive, --time-limit above 0")

    lock, counter = threading.Lock(), iter(range(args.requests))

    def next_index():
        with lock:
            return next(counter, None)

    results = []  # (seconds, error or None); list.append is atomic
    start = time.monotonic()
    clients = [Client(url, next_index, start + args.time_limit, results) for _ in range(args.clients)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=max(0.0, start + args.time_limit + 65 - time.monotonic()))
    elapsed = time.monotonic() - start
    done = list(results)
    errors = [e for _, e in done if e]
    latencies = sorted(t for t, _ in done)
    print(f"requests {len(done)} of {args.requests}, clients {args.clients}, {elapsed:.1f} s "
          f"({len(done) / elapsed:.1f} requests/s)")
    print(f"errors {len(errors)}" + (f" (first: {errors[0]})" if errors else ""))
    if latencies:
        print(f"latency median {1000 * statistics.median(latencies):.1f} ms, "
              f"p99 {1000 * percentile(latencies, 0.99):.1f} ms, max {1000 * latencies[-1]:.1f} ms")
    complete = len(done) == args.requests
    if not complete:
        print(f"stopped by the time limit ({args.time_limit:g} s)")
    return 0 if complete and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
