#!/usr/bin/env python3
"""Time to first token with and without the prefix cache (docs/performance.md section 7).

Runs `rewind generate --stats` on one prompt, alternating per repeat:
no cache, a cold directory cache (fresh directory), a warm directory
cache, a cold Redis cache (FLUSHALL first) and a warm one, against a
redis-server this script starts on 127.0.0.1 (a free port) and stops.
Checks that every run printed the same text, then prints the median,
min and max time to first token of each, and the bytes of the entries
per layer (from `rewind snapshot inspect` of the directory's entries).

usage: scripts/prefix_bench.py CLI MODEL PROMPT_FILE [REPEATS] [JSON_OUT]
"""
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cli, model, prompt, cache=None):
    args = [cli, "generate", "--model", model, "--prompt-file", prompt, "--max-new-tokens", "32", "--stats"]
    if cache:
        args += ["--prefix-cache", cache]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    text, stats = out.rsplit("\n", 2)[0], json.loads(out.rsplit("\n", 2)[1])
    return text, stats


def main():
    cli, model, prompt = sys.argv[1:4]
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    json_out = sys.argv[5] if len(sys.argv) > 5 else None
    work = tempfile.mkdtemp(prefix="rewind-prefix-bench-")
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", work], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    try:
        for _ in range(100):
            if subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() == "PONG":
                break
            time.sleep(0.05)
        names = ["no cache", "directory, cold", "directory, warm", "redis, cold", "redis, warm"]
        ttft = {n: [] for n in names}
        hits = {n: [] for n in names}
        texts = set()
        for r in range(repeats):
            d = os.path.join(work, f"dir{r}")
            subprocess.run(["redis-cli", "-p", str(port), "flushall"], check=True, capture_output=True)
            for name, cache in [("no cache", None), ("directory, cold", d), ("directory, warm", d),
                                ("redis, cold", url), ("redis, warm", url)]:
                text, stats = run(cli, model, prompt, cache)
                texts.add(text)
                ttft[name].append(stats["time_to_first_token_s"])
                hits[name].append(stats["prefix_hit_tokens"])
            print(f"repeat {r + 1}/{repeats} done", file=sys.stderr)
        if len(texts) != 1:
            print("OUTPUT DIFFERS between runs", file=sys.stderr)
            return 1
        cold = statistics.median(ttft["no cache"])
        print(f"{'configuration':18} {'TTFT median':>12} {'min':>9} {'max':>9} {'vs no cache':>12} {'hit tokens':>10}")
        for n in names:
            m = statistics.median(ttft[n])
            print(f"{n:18} {m * 1e3:10.2f}ms {min(ttft[n]) * 1e3:7.2f}ms {max(ttft[n]) * 1e3:7.2f}ms "
                  f"{cold / m:11.1f}x {statistics.median(hits[n]):10.0f}")
        entries = sorted(os.listdir(os.path.join(work, "dir0")))
        sizes = [os.path.getsize(os.path.join(work, "dir0", e)) for e in entries]
        print(f"directory entries: {len(entries)}, {sum(sizes)} bytes in all")
        mid = next(e for e in entries if e.split("-")[2] == "256")
        print(f"entry for [0, 256): {os.path.getsize(os.path.join(work, 'dir0', mid))} bytes:")
        print(subprocess.run([cli, "snapshot", "inspect", "--file", os.path.join(work, "dir0", mid)], check=True,
                             capture_output=True, text=True).stdout)
        if json_out:
            with open(json_out, "w") as f:
                json.dump({"ttft_s": ttft, "prefix_hit_tokens": hits, "entries": len(entries),
                           "entry_bytes": sizes}, f, indent=1)
    finally:
        redis.terminate()
        redis.wait()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
