#!/usr/bin/env python3
"""rewind against llama.cpp on the same random-weight checkpoints: prefill, decode and load, alternating runs.

    /usr/bin/python3 bench/llamacpp/side_by_side.py --llama-src /path/to/llama.cpp --out /tmp/sbs \\
        [--models qwen3-0.6b] [--threads 1 2] [--runs 3]

--llama-src is a snapshot of llama.cpp's source kept outside this tree (never committed here); it is built
once, CPU only, native, OpenMP, into LLAMA_SRC/build-rewind-sbs (llama-bench, llama-quantize,
llama-completion, and llama-server for serve_side_by_side.py; no web UI). Each model of
bench/llamacpp/configs/ is written by `rewind init-random --dtype bf16` (seed 1) beside a byte-level
tokenizer.json of its vocabulary size (the 256 bytes, unused tokens, two special ones last: both engines read a
prompt as its bytes, so they see the same tokens), converted by to_gguf.py to bf16 and f16 GGUF files and
quantized to Q8_0 by llama-quantize. Then, --runs times, each
engine in turn at each thread count (so that drift on a shared machine hits both alike):

- prefill: rewind `generate --stats -n 1` on a prompt of N tokens (the first 512 bytes of
  tests/fixtures/kjv_prompt_4000.txt), N / time_to_first_token_s (which also holds the first token's forward,
  so it slightly understates rewind); llama-bench `-p N -n 0` on the same N;
- decode: rewind `generate --stats -n 65` from a 4-token prompt, decode_tokens_per_second (64 tokens);
  llama-bench `-p 0 -n 64`;
- load: the wall time of one process that loads the model and computes one token from a one-token prompt
  (rewind generate; llama-completion -c 1024 --no-warmup), warm page cache. rewind's model directory holds
  the pack files `rewind pack` writes (as stored and q8, made once, as the GGUF files are), which its loads
  map, as llama.cpp maps its GGUF; "bf16 no pack" / "q8 no pack" rows load the same checkpoint with
  --no-pack (packing at load, and for q8 quantizing at load).

rewind's weights: as stored (bf16) and `--weights q8`; llama.cpp's: bf16, f16 and Q8_0. --load-only measures
the load column alone. Every figure goes to
OUT/results.jsonl as it is measured; the end prints medians with [min-max] per engine, dtype and threads.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "bench", "llamacpp", "configs")


def log(msg):
    print(f"side_by_side: {msg}", file=sys.stderr, flush=True)


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"side_by_side: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def build_llama(src, jobs):
    build = os.path.join(src, "build-rewind-sbs")
    tools = {t: os.path.join(build, "bin", t) for t in ("llama-bench", "llama-quantize", "llama-completion",
                                                               "llama-server")}
    if all(os.path.exists(p) for p in tools.values()):
        return tools
    log(f"building llama.cpp in {build} (CPU, native, OpenMP; a few minutes)")
    run(["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF",
         "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
         "-DLLAMA_BUILD_TOOLS=ON"])
    run(["cmake", "--build", build, "-j", str(jobs), "--target", *tools])
    return tools


def byte_tokenizer(vocab_size):
    """A tokenizer.json (byte-level BPE, GPT-2's pre-tokenizer) of `vocab_size` tokens: ids 0-255 the bytes in
    GPT-2's byte-to-character mapping, 256 the one merge (bytes 0 and 1, which no prompt here holds: llama.cpp
    refuses a BPE vocabulary without merges), unused tokens, then <|startoftext|> and <|endoftext|>."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {chars[b]: b for b in range(256)}
    vocab[chars[0] + chars[1]] = 256
    for i in range(257, vocab_size - 2):
        vocab[f"[UNUSED{i}]"] = i
    added = [{"id": vocab_size - 2 + k, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for k, c in enumerate(("<|startoftext|>", "<|endoftext|>"))]
    for a in added:
        vocab[a["content"]] = a["id"]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": True},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": [f"{chars[0]} {chars[1]}"]}}


def prepare(name, args, tools):
    """The model directory and its GGUF files (made once)."""
    d = os.path.join(args.out, name)
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        log(f"{name}: rewind init-random (bf16, seed 1)")
        run([args.rewind, "init-random", "--config", os.path.join(CONFIGS, name + ".json"), "--out", d, "--seed", "1",
             "--dtype", "bf16", "--force"])
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    vocab_size = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]  # Qwen3.5: its text model's
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(byte_tokenizer(vocab_size), f, ensure_ascii=False)
    ggufs = {}
    for t in ("bf16", "f16"):
        ggufs[t] = os.path.join(args.out, f"{name}-{t}.gguf")
        if not os.path.exists(ggufs[t]):
            log(f"{name}: to_gguf {t}")
            run([sys.executable, os.path.join(REPO, "bench", "llamacpp", "to_gguf.py"), d, ggufs[t], "--outtype", t,
                 "--gguf-py", os.path.join(args.llama_src, "gguf-py"), "--pre", "gpt-2"])
    for weights in ("as-stored", "q8"):
        # Every time: a pack an older build wrote may be of another version.
        log(f"{name}: rewind pack --weights {weights}")
        run([args.rewind, "pack", "-m", d, "--weights", weights])
    ggufs["q8_0"] = os.path.join(args.out, f"{name}-q8_0.gguf")
    if not os.path.exists(ggufs["q8_0"]):
        log(f"{name}: llama-quantize Q8_0")
        run([tools["llama-quantize"], ggufs["bf16"], ggufs["q8_0"], "Q8_0"])
    return d, ggufs


def rewind_stats(args, model, prompt_file, n, threads, weights):
    cmd = [args.rewind, "generate", "-m", model, "--prompt-file", prompt_file, "-n", str(n), "--stats", "-t",
           str(threads)]
    if weights == "q8":
        cmd += ["--weights", "q8"]
    r = run(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_bench(tools, gguf, threads, p, n):
    r = run([tools["llama-bench"], "-m", gguf, "-t", str(threads), "-p", str(p), "-n", str(n), "-r", "1", "-o",
             "json"])
    rows = json.loads(r.stdout)
    return rows[0]["avg_ts"]


def wall(cmd, threads):
    t = time.perf_counter()
    run(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rewind", default=os.path.join(REPO, "build", "tools", "rewind"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--load-only", action="store_true", help="measure the load column only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not os.path.exists(args.rewind):
        sys.exit(f"side_by_side: {args.rewind} is missing: `make build` first (or --rewind)")
    tools = build_llama(args.llama_src, args.jobs)
    with open(os.path.join(REPO, "tests", "fixtures", "kjv_prompt_4000.txt"), "rb") as f:
        text = f.read()[:512].decode("utf-8", "ignore")
    long_prompt = os.path.join(args.out, "prompt_long.txt")
    short_prompt = os.path.join(args.out, "prompt_short.txt")
    one_prompt = os.path.join(args.out, "prompt_one.txt")
    for path, body in ((long_prompt, text), (short_prompt, "In the beginning God"), (one_prompt, "In")):
        with open(path, "w", encoding="utf-8") as f:
            f.write(body)
    results = os.path.join(args.out, "results.jsonl")
    log(f"CPU: {platform.processor() or platform.machine()}; results in {results}")
    figures = {}

    def record(**row):
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")
        figures.setdefault((row["model"], row["engine"], row["weights"], row["threads"], row["what"]), []).append(
            row["value"])
        log(json.dumps(row))

    for name in args.models:
        model, ggufs = prepare(name, args, tools)
        n_prompt = rewind_stats(args, model, long_prompt, 1, 1, "as-stored")["prompt_tokens"]
        log(f"{name}: the prefill prompt is {n_prompt} tokens")
        for r in range(args.runs):
            for threads in args.threads:
                for weights in ("bf16", "q8"):
                    w = "as-stored" if weights == "bf16" else "q8"
                    if not args.load_only:
                        s = rewind_stats(args, model, long_prompt, 1, threads, w)
                        record(model=name, engine="rewind", weights=weights, threads=threads, what="prefill_tok_s",
                               value=s["prompt_tokens"] / s["time_to_first_token_s"], run=r)
                        s = rewind_stats(args, model, short_prompt, 65, threads, w)
                        record(model=name, engine="rewind", weights=weights, threads=threads, what="decode_tok_s",
                               value=s["decode_tokens_per_second"], run=r)
                    cmd = [args.rewind, "generate", "-m", model, "--prompt-file", one_prompt, "-n", "1", "-t",
                           str(threads), "--weights", w]
                    record(model=name, engine="rewind", weights=weights, threads=threads, what="load_s",
                           value=wall(cmd, threads), run=r)
                    record(model=name, engine="rewind", weights=weights + " no pack", threads=threads,
                           what="load_s", value=wall(cmd + ["--no-pack"], threads), run=r)
                for weights in ("bf16", "f16", "q8_0"):
                    g = ggufs[weights]
                    if not args.load_only:
                        record(model=name, engine="llama.cpp", weights=weights, threads=threads,
                               what="prefill_tok_s", value=llama_bench(tools, g, threads, n_prompt, 0), run=r)
                        record(model=name, engine="llama.cpp", weights=weights, threads=threads,
                               what="decode_tok_s", value=llama_bench(tools, g, threads, 0, 64), run=r)
                    # -c: llama.cpp allocates the whole context's KV cache up front (the model's 40,960
                    # tokens by default: gigabytes), rewind as tokens come.
                    cmd = [tools["llama-completion"], "-m", g, "-f", one_prompt, "-n", "1", "-t", str(threads),
                           "-c", "1024", "--no-warmup", "-no-cnv", "--temp", "0"]
                    record(model=name, engine="llama.cpp", weights=weights, threads=threads, what="load_s",
                           value=wall(cmd, threads), run=r)

    print("| model | threads | engine | weights | prefill tok/s | decode tok/s | load + 1 token, s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        for threads in args.threads:
            for engine, weights in (("rewind", "bf16"), ("rewind", "bf16 no pack"), ("llama.cpp", "bf16"),
                                    ("llama.cpp", "f16"), ("rewind", "q8"), ("rewind", "q8 no pack"),
                                    ("llama.cpp", "q8_0")):
                cells = []
                for what in ("prefill_tok_s", "decode_tok_s", "load_s"):
                    v = figures.get((name, engine, weights, threads, what), [])
                    cells.append(f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" if v else "")
                print(f"| {name} | {threads} | {engine} | {weights} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
