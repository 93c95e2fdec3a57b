#!/usr/bin/env python3
"""Time to first token of `rewind serve` replicas sharing a Redis prefix cache (docs/server.md section 4).

Starts a redis-server on 127.0.0.1 (a free port) and, per repeat, two
`rewind serve` processes on it (a fresh key prefix each repeat): the first
answers the prompt cold (nothing stored), then a second process, which
has never seen the prompt, answers it from the entries the first stored.
A third server with --no-prefix-cache gives the time without any cache.
Each request streams (greedy, MAX_TOKENS tokens); time to first token is
from sending the request to the first chunk with text. Checks that every
response is the same text, then prints the median, min and max of each.

usage: scripts/serve_prefix_bench.py CLI MODEL PROMPT_FILE [PROMPT_BYTES] [REPEATS] [MAX_TOKENS] [THREADS]
"""
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from serve_bench import free_port, start_server


def stop_server(proc):
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    return err


def stream(port, prompt, max_tokens):
    """(time to first text chunk, whole text)"""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    ttft, text = None, ""
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        piece = json.loads(line[6:])["choices"][0]["text"]
        if piece and ttft is None:
            ttft = time.perf_counter() - t0
        text += piece
    return ttft, text


def metric(port, name):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith(name + " "):
            return int(line.split()[1])
    return None


def main():
    cli, model, prompt_file = sys.argv[1:4]
    prompt_bytes = int(sys.argv[4]) if len(sys.argv) > 4 else 1500
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    max_tokens = int(sys.argv[6]) if len(sys.argv) > 6 else 32
    threads = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    with open(prompt_file, encoding="utf-8") as f:
        prompt = f.read()[:prompt_bytes]
    work = tempfile.mkdtemp(prefix="rewind-serve-prefix-bench-")
    rport = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", work], stdout=subprocess.DEVNULL)
    names = ["no prefix cache", "first server (cold, stores)", "second server (hit)"]
    ttft = {n: [] for n in names}
    texts = set()
    hit_tokens = []
    try:
        for _ in range(100):
            ping = subprocess.run(["redis-cli", "-p", str(rport), "ping"], capture_output=True, text=True)
            if ping.stdout.strip() == "PONG":
                break
            time.sleep(0.05)
        for r in range(repeats):
            url = f"redis://127.0.0.1:{rport}/bench{r}:"
            proc, port = start_server(cli, model, threads, ["--no-prefix-cache"])
            t, text = stream(port, prompt, max_tokens)
            stop_server(proc)
            ttft[names[0]].append(t)
            texts.add(text)
            proc, port = start_server(cli, model, threads, ["--prefix-cache", url])
            t, text = stream(port, prompt, max_tokens)
            stop_server(proc)
            ttft[names[1]].append(t)
            texts.add(text)
            proc, port = start_server(cli, model, threads, ["--prefix-cache", url])
            t, text = stream(port, prompt, max_tokens)
            hit_tokens.append(metric(port, "rewind_prefix_hit_tokens_total"))
            stop_server(proc)
            ttft[names[2]].append(t)
            texts.add(text)
    finally:
        redis.terminate()
        redis.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(f"prompt: {prompt_bytes} bytes of {os.path.basename(prompt_file)}, {max_tokens} tokens greedy, "
          f"{threads} thread(s), {repeats} repeats")
    print("identical text in every run:", len(texts) == 1)
    print("tokens restored by the second server:", hit_tokens)
    for n in names:
        v = ttft[n]
        print(f"{n:30s} TTFT median {statistics.median(v) * 1e3:8.1f} ms  (min {min(v) * 1e3:.1f}, "
              f"max {max(v) * 1e3:.1f}; {', '.join(f'{x * 1e3:.1f}' for x in v)})")
    cold = statistics.median(ttft[names[1]])
    warm = statistics.median(ttft[names[2]])
    print(f"second server vs cold first server: {cold / warm:.1f}x faster TTFT")
    print(f"second server vs no prefix cache:   {statistics.median(ttft[names[0]]) / warm:.1f}x faster TTFT")
    return 0 if len(texts) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
