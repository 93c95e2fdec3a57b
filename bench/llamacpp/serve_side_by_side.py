#!/usr/bin/env python3
"""`rewind serve` against llama.cpp's `llama-server` on the same random-weight checkpoint, alternating runs.

    /usr/bin/python3 bench/llamacpp/serve_side_by_side.py --llama-src /path/to/llama.cpp --out /tmp/sbs \\
        [--model lfm2-350m] [--threads 2] [--clients 1 4 16] [--runs 3]

The checkpoint and its GGUF files are made as side_by_side.py makes them (same OUT layout, so one OUT serves
both scripts): `rewind init-random --dtype bf16` of bench/llamacpp/configs/MODEL.json, converted by to_gguf.py,
quantized to Q8_0 by llama-quantize; llama.cpp is built from the snapshot at --llama-src (kept outside this
tree) into LLAMA_SRC/build-rewind-sbs, llama-server included.

Each run starts every server in turn (rewind bf16 and Q8; llama-server f16, bf16 and Q8_0), each with the same
slots (rewind --max-batch B, llama-server -np B with one unified KV cache), the same compute threads and enough
HTTP threads, its output in OUT/serve-ENGINE-WEIGHTS.log, on a free port of 127.0.0.1. The time from starting the
process to /health answering 200 is its start-up figure. Then, for each client count C, C concurrent clients
(standard library: http.client and threads) send max(2 C, 8) streamed /v1/completions requests, greedy, each with a
prompt of --prompt-tokens token ids (the same ids for both servers, so tokenization plays no part) drawn afresh for
every request of the run: no request shares a prefix with an earlier one, so neither server's prefix reuse helps.
Each asks for --max-tokens tokens (`ignore_eos` for llama-server; rewind stops at EOS, and its tokens/s counts the
tokens it did generate, from `usage`). Figures per run: aggregate completion tokens/s over the wall time, time to
first token p50 / p99 (sending the request to its first non-empty text event). The table gives medians over the
runs with [min-max]. In the first run, --check-alone prompts of the largest client count are sent again one at a
time: "batched = alone" counts the greedy texts that equal what the same prompt got inside the batch (rewind
promises all of them; llama.cpp's results may depend on what else is batched).
"""

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side  # noqa: E402 - the same build, checkpoint and GGUF files

sys.path.insert(0, os.path.join(side_by_side.REPO, "scripts"))
import serve_bench  # noqa: E402 - its concurrent clients and percentiles

log = side_by_side.log


def get(port, path, timeout=5):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


def start(cmd, port, threads, what, log_path):
    """Starts a server, its output to `log_path` (a pipe nobody reads would fill and stall a server that logs
    every request, as llama-server does), and waits for /health 200: (process, seconds from start to healthy)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    while True:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                raise RuntimeError(f"{what} exited with {proc.returncode}: {f.read()[-3000:]}")
        try:
            if get(port, "/health", timeout=1)[0] == 200:
                return proc, time.perf_counter() - t0
        except OSError:
            pass
        if time.perf_counter() - t0 > 300:
            stop(proc)
            raise RuntimeError(f"{what} was not healthy after 300 s")
        time.sleep(0.02)


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stream_one(port, prompt, max_tokens):
    """serve_bench's streamed greedy completion, EOS ignored where the server allows it (llama-server; rewind
    ignores the field): (text, completion tokens, seconds to first text)."""
    return serve_bench.stream_one(port, prompt, max_tokens, {"ignore_eos": True})


def same_alone(port, prompts, texts, max_tokens, count):
    """How many of the first `count` prompts, sent again alone, get the text they got inside the batch."""
    return sum(stream_one(port, prompts[i], max_tokens)[0] == texts[i] for i in range(min(count, len(prompts))))


def server_command(engine, weights, args, model_dir, ggufs, port, http_threads):
    if engine == "rewind":
        cmd = [args.rewind, "serve", "-m", model_dir, "--port", str(port), "--max-batch", str(args.max_batch),
               "--threads", str(args.threads), "--http-threads", str(http_threads)]
        return cmd + (["--weights", "q8"] if weights == "q8" else [])
    ctx = args.max_batch * (args.prompt_tokens + args.max_tokens + 16)
    return [args.tools["llama-server"], "-m", ggufs[weights], "--host", "127.0.0.1", "--port", str(port), "-np",
            str(args.max_batch), "-kvu", "-c", str(ctx), "-t", str(args.threads), "-tb", str(args.threads),
            "--threads-http", str(http_threads), "--no-webui"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="lfm2-350m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--check-alone", type=int, default=8,
                    help="in the first run, resend this many prompts of the largest client count alone and count "
                         "the texts equal to those they got in the batch (0: skip)")
    ap.add_argument("--engines", nargs="+", default=["rewind:bf16", "llama.cpp:f16", "llama.cpp:bf16", "rewind:q8",
                                                      "llama.cpp:q8_0"])
    ap.add_argument("--rewind", default=os.path.join(side_by_side.REPO, "build", "tools", "rewind"))
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not os.path.exists(args.rewind):
        sys.exit(f"serve_side_by_side: {args.rewind} is missing: `make build` first (or --rewind)")
    args.tools = side_by_side.build_llama(args.llama_src, args.jobs)
    model_dir, ggufs = side_by_side.prepare(args.model, args, args.tools)
    results = os.path.join(args.out, "serve_results.jsonl")
    log(f"results in {results}")
    rng = random.Random(1)
    figures = {}
    engines = [tuple(e.split(":")) for e in args.engines]
    for r in range(args.runs):
        for engine, weights in engines:
            port = serve_bench.free_port()
            cmd = server_command(engine, weights, args, model_dir, ggufs, port, max(args.clients) + 4)
            proc, startup = start(cmd, port, args.threads, f"{engine} {weights}",
                                  os.path.join(args.out, f"serve-{engine}-{weights}.log"))
            try:
                rows = [("startup_s", startup)]
                stream_one(port, [rng.randrange(32, 127) for _ in range(8)], 4)  # first-request warm-up
                for c in args.clients:
                    prompts = [[rng.randrange(32, 127) for _ in range(args.prompt_tokens)]
                               for _ in range(max(2 * c, 8))]
                    s, answers = serve_bench.run_clients(port, prompts, c, args.max_tokens, total=len(prompts),
                                                         one=stream_one)
                    rows += [(f"c{c}_tok_s", s["tokens_per_second"]), (f"c{c}_ttft_p50_ms", s["ttft_p50"] * 1e3),
                             (f"c{c}_ttft_p99_ms", s["ttft_p99"] * 1e3), (f"c{c}_tokens", s["tokens"])]
                    if r == 0 and c == max(args.clients) and args.check_alone:
                        texts = {p: text for p, text, _, _ in answers}
                        rows.append(("batched_equal_alone", same_alone(port, prompts, texts, args.max_tokens,
                                                                       args.check_alone)))
            finally:
                stop(proc)
            for what, value in rows:
                row = {"model": args.model, "engine": engine, "weights": weights, "threads": args.threads,
                       "what": what, "value": value, "run": r}
                with open(results, "a") as f:
                    f.write(json.dumps(row) + "\n")
                figures.setdefault((engine, weights, what), []).append(value)
            log(f"run {r + 1}: {engine} {weights}: " + ", ".join(f"{w} {v:.1f}" for w, v in rows))

    def cell(engine, weights, what, fmt="{:.1f}"):
        v = figures.get((engine, weights, what), [])
        return f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}-{fmt.format(max(v))}]" if v else ""

    print(f"\n{args.model}, {args.threads} threads, {args.max_batch} slots, prompts of {args.prompt_tokens} tokens, "
          f"{args.max_tokens} new tokens each; medians of {args.runs} runs [min-max]\n")
    head = " | ".join(f"{c} clients tok/s | TTFT p50 / p99 ms" for c in args.clients)
    print(f"| engine | weights | start-up s | {head} | batched = alone |")
    print("|---|---|---|" + "---|---|" * len(args.clients) + "---|")
    for engine, weights in engines:
        cells = [cell(engine, weights, "startup_s", "{:.2f}")]
        for c in args.clients:
            cells.append(cell(engine, weights, f"c{c}_tok_s"))
            cells.append(cell(engine, weights, f"c{c}_ttft_p50_ms", "{:.0f}") + " / " +
                         cell(engine, weights, f"c{c}_ttft_p99_ms", "{:.0f}"))
        alone = figures.get((engine, weights, "batched_equal_alone"))
        cells.append(f"{int(alone[0])} of {min(args.check_alone, max(2 * max(args.clients), 8))}" if alone else "")
        print(f"| {engine} | {weights} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
