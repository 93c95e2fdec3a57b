#!/usr/bin/env python3
"""Throughput and time to first token of `rewind serve` under concurrent clients.

Starts `rewind serve` on a free port of 127.0.0.1, then for each client count
C runs C concurrent streaming clients (standard library only: http.client and
threads) that send the prompts of PROMPT_FILE (one per line, cycled) until
max(2 C, 32) requests are answered, each greedy with --max-tokens tokens.
Per run: aggregate tokens/s (every completion token over the wall time) and
the time to first token of each request (from sending it to the first
non-empty text event), whose p50 and p99 are taken. Each C is run
--repeats times; the table shows medians with the spread (min-max).

Then `rewind generate --prompts` decodes the same requests in batches of
--max-batch and its tokens/s is the reference: the server should be within
10 % of it at the client counts that keep its batch full. Every streamed text
is checked against generate's for its prompt (greedy: identical).

usage: scripts/serve_bench.py CLI MODEL PROMPT_FILE [--clients 1,4,16,64]
       [--max-tokens 64] [--max-batch 16] [--repeats 3] [--threads 1]
       [--json OUT] [-- extra rewind serve arguments]
"""
import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `rewind serve` on a free port of 127.0.0.1 with -t THREADS and `extra`
# arguments, once /health answers: (process, port). Its stderr stays a pipe,
# read for the message when it does not start.
def start_server(cli, model, threads, extra):
    port = free_port()
    proc = subprocess.Popen([cli, "serve", "--model", model, "--port", str(port), "-t", str(threads)] + extra,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("rewind serve did not start: " + proc.stderr.read())


def percentile(values, q):
    """The q-th percentile (0..100) by linear interpolation between ranks."""
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def stream_one(port, prompt, max_tokens, extra=None):
    """One streamed greedy completion (more request fields in `extra`): (text, completion tokens, seconds to
    first text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, **(extra or {})})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    res = conn.getresponse()
    if res.status != 200:
        raise RuntimeError(f"status {res.status}: {res.read()[:200]!r}")
    text, tokens, first = "", 0, None
    buf = b""
    while True:
        chunk = res.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.decode().strip()[len("data: "):]
            if not data or data == "[DONE]":
                continue
            j = json.loads(data)
            if j.get("usage"):
                tokens = j["usage"]["completion_tokens"]
            for choice in j.get("choices", []):
                if choice.get("text"):
                    if first is None:
                        first = time.perf_counter() - t0
                    text += choice["text"]
    conn.close()
    return text, tokens, first if first is not None else time.perf_counter() - t0


def run_clients(port, prompts, clients, max_tokens, total=None, one=None):
    """`total` requests (default max(2 clients, 32)), prompts cycled, from `clients` concurrent clients, each
    made by `one(port, prompt, max_tokens)` -> (text, tokens, ttft) (default stream_one): (figures, results)."""
    total = total if total is not None else max(2 * clients, 32)
    one = one or stream_one
    lock = threading.Lock()
    next_request = [0]
    results = []  # (prompt index, text, tokens, ttft)
    errors = []

    def client():
        while True:
            with lock:
                i = next_request[0]
                if i >= total:
                    return
                next_request[0] += 1
            p = i % len(prompts)
            try:
                text, tokens, ttft = one(port, prompts[p], max_tokens)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(repr(e))
                return
            with lock:
                results.append((p, text, tokens, ttft))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    tokens = sum(r[2] for r in results)
    ttfts = [r[3] for r in results]
    return {"requests": len(results), "tokens": tokens, "seconds": wall, "tokens_per_second": tokens / wall,
            "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99)}, results


def generate_reference(cli, model, prompts, total, max_tokens, max_batch, threads):
    """`rewind generate --prompts` over the first `total` requests: (texts by prompt, tokens/s)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        for i in range(total):
            f.write(prompts[i % len(prompts)] + "\n")
        path = f.name
    try:
        out = subprocess.run([cli, "generate", "--model", model, "--prompts", path, "--max-new-tokens",
                              str(max_tokens), "--max-batch", str(max_batch), "--threads", str(threads), "--stats"],
                             check=True, capture_output=True, text=True).stdout.strip().split("\n")
    finally:
        os.unlink(path)
    stats = json.loads(out[-1])
    texts = {}
    for line in out[:-1]:
        j = json.loads(line)
        texts[j["index"] % len(prompts)] = j["text"]
    return texts, stats["tokens_per_second"]


def spread(values, fmt):
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cli")
    ap.add_argument("model")
    ap.add_argument("prompt_file")
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    prompts = [line.rstrip("\n") for line in open(a.prompt_file, encoding="utf-8") if line.strip()]
    clients = [int(c) for c in a.clients.split(",")]
    port = free_port()
    serve = subprocess.Popen([a.cli, "serve", "--model", a.model, "--port", str(port), "--max-batch",
                              str(a.max_batch), "--threads", str(a.threads),
                              "--http-threads", str(max(clients) + 4)] + extra,
                             stderr=subprocess.PIPE, text=True)
    try:
        line = serve.stderr.readline()
        if not re.search(r"on http://", line):
            raise RuntimeError(f"rewind serve did not start: {line}{serve.stderr.read()}")
        print(line.strip(), file=sys.stderr)
        rows = []
        for c in clients:
            runs = []
            for r in range(a.repeats):
                stats, results = run_clients(port, prompts, c, a.max_tokens)
                runs.append(stats)
                print(f"clients {c} run {r + 1}: {stats['tokens_per_second']:.1f} tok/s, ttft p50 "
                      f"{stats['ttft_p50'] * 1e3:.1f} ms p99 {stats['ttft_p99'] * 1e3:.1f} ms", file=sys.stderr)
            total = runs[0]["requests"]
            ref_texts, _ = generate_reference(a.cli, a.model, prompts, total, a.max_tokens, a.max_batch, a.threads)
            for p, text, _, _ in results:
                if text != ref_texts[p]:
                    raise RuntimeError(f"prompt {p}: serve gave {text!r}, generate --prompts {ref_texts[p]!r}")
            ref = [generate_reference(a.cli, a.model, prompts, total, a.max_tokens, a.max_batch, a.threads)[1]
                   for _ in range(a.repeats)]
            rows.append({"clients": c, "requests": total, "runs": runs, "generate_tokens_per_second": ref})
        print(f"\n{'clients':>7} {'requests':>8}  {'serve tok/s':>22}  {'generate --prompts tok/s':>24}  "
              f"{'ttft p50 ms':>20}  {'ttft p99 ms':>20}")
        for row in rows:
            runs = row["runs"]
            print(f"{row['clients']:>7} {row['requests']:>8}  "
                  f"{spread([x['tokens_per_second'] for x in runs], '{:.1f}'):>22}  "
                  f"{spread(row['generate_tokens_per_second'], '{:.1f}'):>24}  "
                  f"{spread([x['ttft_p50'] * 1e3 for x in runs], '{:.1f}'):>20}  "
                  f"{spread([x['ttft_p99'] * 1e3 for x in runs], '{:.1f}'):>20}")
        print("(medians of", a.repeats, "runs, min-max in brackets; every streamed text equal to generate's)")
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump({"max_batch": a.max_batch, "max_tokens": a.max_tokens, "threads": a.threads,
                           "serve_args": extra, "rows": rows}, f, indent=1)
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()


if __name__ == "__main__":
    main()
