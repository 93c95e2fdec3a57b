#!/usr/bin/env python3
"""Decode and prefill speed of `rewind generate` by thread count, on an idle
machine and on one kept busy by spinning processes.

    bench/busy_threads.py --rewind build/tools/rewind --model models/kjv-hybrid \
        [--model DIR ...] [--threads 1 2] [--hogs 0 2] [--runs 3] [--out FILE]

For every run, every model, every number of hogs and every thread count (in
that nesting, so that conditions alternate), it starts HOGS processes that
spin on the CPU (`sh -c 'while :; do :; done'`, default niceness, as another
user's job would), then runs two `generate --stats` commands: a 512-byte
prompt with one new token (prefill: prompt tokens / time to first token) and
a short prompt with --new tokens (decode_tokens_per_second). The hogs are
stopped after each pair. Prints medians [min-max] per condition and writes
every raw row as JSON lines to --out when given.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

PROMPT = "And it came to pass, when the king heard"
# 512 bytes of prompt for the prefill: byte-level models read it as 512
# tokens; a tokenized model reads fewer (the row records how many).
LONG_PROMPT = (("In the beginning God created the heaven and the earth. And the earth was "
                "without form, and void; and darkness was upon the face of the deep. ") * 4)[:512]


def generate(rewind, model, threads, prompt, new_tokens):
    out = subprocess.run([rewind, "generate", "--model", model, "--prompt", prompt, "-n", str(new_tokens),
                          "--threads", str(threads), "--stats"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # --stats prints its JSON as the last line


def start_hogs(n):
    return [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]


def stop_hogs(hogs):
    for h in hogs:
        h.kill()
    for h in hogs:
        h.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rewind", required=True)
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--hogs", type=int, nargs="+", default=[0, os.cpu_count() or 2])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new", type=int, default=64, help="new tokens of the decode run")
    ap.add_argument("--label", default="", help="recorded in every row (e.g. the commit)")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for run in range(args.runs):
        for model in args.model:
            for hogs in args.hogs:
                for threads in args.threads:
                    h = start_hogs(hogs)
                    try:
                        pre = generate(args.rewind, model, threads, LONG_PROMPT, 1)
                        dec = generate(args.rewind, model, threads, PROMPT, args.new)
                    finally:
                        stop_hogs(h)
                    row = {"label": args.label, "run": run, "model": os.path.basename(model.rstrip("/")),
                           "hogs": hogs, "threads": threads, "prompt_tokens": pre["prompt_tokens"],
                           "prefill_tok_s": pre["prompt_tokens"] / pre["time_to_first_token_s"],
                           "decode_tok_s": dec["decode_tokens_per_second"]}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    def fmt(xs):
        return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"

    print("| model | busy processes | threads | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|")
    for model in args.model:
        name = os.path.basename(model.rstrip("/"))
        for hogs in args.hogs:
            for threads in args.threads:
                sel = [r for r in rows if r["model"] == name and r["hogs"] == hogs and r["threads"] == threads]
                print(f"| {name} | {hogs} | {threads} | {fmt([r['prefill_tok_s'] for r in sel])} | "
                      f"{fmt([r['decode_tok_s'] for r in sel])} |")


if __name__ == "__main__":
    main()
