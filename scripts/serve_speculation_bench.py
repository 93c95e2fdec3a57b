#!/usr/bin/env python3
"""Aggregate tokens/s of `rewind serve` with and without speculation.

Starts `rewind serve` on a free port once per configuration (plain,
--lookup N, --draft DIR), then, for each number of concurrent clients, sends
that many greedy /v1/completions requests of one repetitive prompt at once
and times them: tokens/s = all completion tokens / wall time of the slowest.
Each figure is the median of --repeats runs (spread: min..max). Also checks
that every configuration returns the same text (greedy speculation is exact).

  python3 scripts/serve_speculation_bench.py --rewind build/tools/rewind \
      --model models/kjv-hybrid --lookup 3 --draft models/kjv-draft
"""
import argparse
import json
import statistics
import subprocess
import threading
import time
import urllib.request

from serve_bench import free_port

PROMPT = ("And God said, Let there be light: and there was light. And God saw the light, that it was good: "
          "and God divided the light from the darkness. And God said, Let there be light")


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def wait_ready(port, proc):
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"rewind serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("rewind serve did not come up")


def run_clients(port, clients, max_tokens):
    out = [None] * clients
    def one(i):
        out[i] = post(port, {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    tokens = sum(o["usage"]["completion_tokens"] for o in out)
    return tokens / seconds, [o["choices"][0]["text"] for o in out]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rewind", default="build/tools/rewind")
    ap.add_argument("--model", default="models/kjv-hybrid")
    ap.add_argument("--lookup", type=int, default=3)
    ap.add_argument("--draft", default="")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    configs = [("plain", [])]
    if args.lookup > 0:
        configs.append((f"lookup {args.lookup}", ["--lookup", str(args.lookup), "--num-draft", str(args.num_draft)]))
    if args.draft:
        configs.append((f"draft {args.draft}", ["--draft", args.draft, "--num-draft", str(args.num_draft)]))
    texts = {}
    for name, flags in configs:
        port = free_port()
        proc = subprocess.Popen([args.rewind, "serve", "-m", args.model, "--port", str(port), "-t", "1"] + flags,
                                stderr=subprocess.DEVNULL)
        try:
            wait_ready(port, proc)
            run_clients(port, 1, 8)  # warm-up
            for clients in (int(c) for c in args.clients.split(",")):
                rates = []
                for _ in range(args.repeats):
                    rate, text = run_clients(port, clients, args.max_tokens)
                    rates.append(rate)
                    texts.setdefault(clients, set()).update(text)
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                    metrics = dict(line.split(" ", 1) for line in r.read().decode().splitlines()
                                   if line and not line.startswith("#"))
                drafted = int(metrics.get("rewind_draft_tokens_total", "0"))
                accepted = int(metrics.get("rewind_accepted_tokens_total", "0"))
                acceptance = f", acceptance so far {accepted / drafted:.2f}" if drafted else ""
                print(f"{name:>24} | {clients} clients | {statistics.median(rates):8.1f} tok/s "
                      f"(min {min(rates):.1f}, max {max(rates):.1f}){acceptance}", flush=True)
        finally:
            proc.terminate()
            proc.wait()
    same = all(len(v) == 1 for v in texts.values())
    print("every configuration returned the same greedy text" if same else "TEXTS DIFFER")


if __name__ == "__main__":
    main()
