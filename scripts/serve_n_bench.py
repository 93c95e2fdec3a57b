#!/usr/bin/env python3
"""Several choices for one prompt in `rewind serve` (docs/server.md section 3, "Several choices").

Starts `rewind serve --no-prefix-cache` (every prompt computed) and, per
repeat, sends one request with n = N (the prompt prefilled once, N - 1
choices forked from it) and N concurrent requests with n = 1 of the same
prompt (the prompt computed N times, the sequences decoding in one batch).
Greedy, MAX_TOKENS tokens each. Checks that every choice of every response
is the same text, reads the prompt tokens admitted and the forks from
/metrics, then prints the median, min and max wall time of each way.

usage: scripts/serve_n_bench.py CLI MODEL [PROMPT_TOKENS] [N] [REPEATS] [MAX_TOKENS] [THREADS]
"""
import http.client
import json
import statistics
import sys
import threading
import time

from serve_bench import start_server

TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
        "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. ")


def post(port, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
    return json.loads(data)


def metric(port, name):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith(name + " "):
            return int(line.split()[1])
    raise RuntimeError("no metric " + name)


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        sys.exit(2)
    cli, model = sys.argv[1], sys.argv[2]
    prompt_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    max_tokens = int(sys.argv[6]) if len(sys.argv) > 6 else 16
    threads = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    # The shipped models are byte level: a byte is a token (BOS added).
    prompt = (TEXT * (prompt_tokens // len(TEXT) + 1))[:prompt_tokens - 1]
    proc, port = start_server(cli, model, threads, ["--max-batch", str(n), "--no-prefix-cache"])
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    texts = set()
    times = {"forked": [], "separate": []}
    admitted = {"forked": [], "separate": []}
    forks = {"forked": [], "separate": []}
    try:
        post(port, dict(body, max_tokens=1))  # warm up
        for _ in range(repeats):
            for way in ("forked", "separate"):
                p0, f0 = metric(port, "rewind_prompt_tokens_total"), metric(port, "rewind_forks_total")
                t0 = time.perf_counter()
                if way == "forked":
                    texts.update(c["text"] for c in post(port, dict(body, n=n))["choices"])
                else:
                    out = [None] * n

                    def run(i):
                        out[i] = post(port, body)

                    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()
                    texts.update(r["choices"][0]["text"] for r in out)
                times[way].append(time.perf_counter() - t0)
                admitted[way].append(metric(port, "rewind_prompt_tokens_total") - p0)
                forks[way].append(metric(port, "rewind_forks_total") - f0)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    if len(texts) != 1:
        print(f"FAIL: {len(texts)} different texts", file=sys.stderr)
        sys.exit(1)
    print(f"prompt {prompt_tokens} tokens, n = {n}, {max_tokens} tokens each, {threads} thread(s), {repeats} repeats")
    for way, label in (("forked", f"one request, n = {n}"), ("separate", f"{n} requests, n = 1")):
        t = sorted(times[way])
        print(f"  {label:22s} median {statistics.median(t) * 1e3:8.1f} ms (min {t[0] * 1e3:.1f}, max {t[-1] * 1e3:.1f});"
              f" prompt tokens admitted {admitted[way][0]}, forks {forks[way][0]}")


if __name__ == "__main__":
    main()
