"""Writes MODEL_DIR/README.md (the model card) from MODEL_DIR/config.json,
MODEL_DIR/training.json and measurements by the rewind CLI:
held-out bits per byte (`rewind eval` on build-data/kjv/valid.txt) and a
greedy sample.

  /usr/bin/python3 scripts/train/model_card.py MODEL_DIR --rewind build/tools/rewind \
      --name "kjv-hybrid" --role target [--peer models/kjv-draft]
"""
import argparse
import json
import os
import re
import subprocess

SAMPLE_PROMPT = "And it came to pass, when the king heard"


def run(cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1")).stdout


def describe_layers(c):
    rows = []
    for i, t in enumerate(c["layer_types"]):
        if t in ("full_attention", "sliding_attention"):
            d = f"GQA {c['num_attention_heads']} query / {c['num_key_value_heads']} kv heads x {c['head_dim']}, RoPE"
            if t == "sliding_attention":
                d += f", window {c['sliding_window']}"
        elif t == "linear_attention":
            d = (f"Gated DeltaNet, {c['linear_num_key_heads']} key heads x {c['linear_key_head_dim']}, "
                 f"{c['linear_num_value_heads']} value heads x {c['linear_value_head_dim']}, "
                 f"causal conv K={c['linear_conv_kernel_dim']}")
        else:
            d = f"LFM2 short conv, K={c['conv_L_cache']}"
        rows.append(f"| {i} | `{t}` | {d} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--rewind", default="build/tools/rewind")
    ap.add_argument("--name", required=True)
    ap.add_argument("--role", choices=["target", "draft"], required=True)
    ap.add_argument("--peer", help="the other shipped model (for the speculative-decoding numbers)")
    ap.add_argument("--valid", default="build-data/kjv/valid.txt")
    ap.add_argument("--extra", default="", help="markdown appended to the card")
    args = ap.parse_args()

    c = json.load(open(os.path.join(args.model_dir, "config.json")))
    carried = ("conv / Gated DeltaNet state" if "linear_attention" in c["layer_types"] else "conv states")
    t = json.load(open(os.path.join(args.model_dir, "training.json")))
    ev = run([args.rewind, "eval", "--model", args.model_dir, "--text", args.valid, "--chunk", "128",
              "--context", "512"])
    bpb = float(re.search(r"([0-9.]+) bits per byte", ev).group(1))
    ev_long = run([args.rewind, "eval", "--model", args.model_dir, "--text", args.valid, "--chunk", "128",
                   "--context", "4096"])
    bpb_long = float(re.search(r"([0-9.]+) bits per byte", ev_long).group(1))
    sample = run([args.rewind, "generate", "--model", args.model_dir, "--prompt", SAMPLE_PROMPT,
                  "--max-new-tokens", "300"]).rstrip("\n")
    sampled = run([args.rewind, "generate", "--model", args.model_dir, "--prompt", SAMPLE_PROMPT,
                   "--max-new-tokens", "400", "--temperature", "0.7", "--top-k", "40", "--seed", "1"]).rstrip("\n")
    size = os.path.getsize(os.path.join(args.model_dir, "model.safetensors"))
    distilled = "distill_from" in t
    if distilled:
        history = "\n".join(
            f"| {h['step']} | {h['tokens'] / 1e6:.2f} M | {h['minutes']:.1f} | {h['train_bpb']:.3f} | "
            f"{h['held_out_bpb']:.3f} | {h['held_out_agreement']:.4f} |" for h in t["history"])
        history_head = ("| step | tokens | minutes | train bpb (cross-entropy) | held-out bpb (estimate) | "
                        "held-out agreement |\n|---|---|---|---|---|---|")
    else:
        history = "\n".join(f"| {h['step']} | {h['tokens'] / 1e6:.2f} M | {h['minutes']:.1f} | {h['train_bpb']:.3f} | "
                            f"{h['held_out_bpb']:.3f} |" for h in t["history"])
        history_head = "| step | tokens | minutes | train bpb | held-out bpb (estimate) |\n|---|---|---|---|---|"
    distillation, agreement_row = "", ""
    if distilled:
        start = t.get("distill_start", 0.0)
        distillation = f"""

Distilled from `{t['distill_from']}`: {f"the first {100 * start:g}% of the budget on the data alone (cross-entropy), then " if start else ""}the loss
{t['loss']} per position, on the target's next-token distribution
(soft labels, full softmax, temperature 1) computed on every batch by the
target loaded from its exported f16 file, in f32 under `torch.no_grad`
(`--distill-from {t['distill_from']} --alpha {t['alpha']:g}{f" --distill-start {start:g}" if start else ""}`).
The target's forward costs about three of this model's training steps."""
        agreement_row = (f"\n| held-out top-1 agreement with `{t['distill_from']}` | {t['held_out_agreement']:.4f} "
                         f"(`scripts/train/agreement.py`: positions of the held-out text where both argmax agree) |")
    role = ("the **target** model of `make demo`: drafted by `models/kjv-draft` in speculative decoding"
            if args.role == "target" else
            "the **draft** model of `make demo`: proposes tokens for `models/kjv-hybrid` in speculative decoding")
    card = f"""# {args.name}

A byte-level language model of the King James Bible in the rewind hybrid
architecture (`runtime/model.cc`, `scripts/train/model.py`), {role}.
Small and quickly trained on a 2-core CPU: it writes KJV-flavoured English,
not sense. Public domain text; the weights are part of rewind.

| | |
|---|---|
| parameters | {t['parameters']:,} |
| file | `model.safetensors`, {c['torch_dtype']} ({size / 1e6:.2f} MB) + `config.json` |
| vocabulary | 258: bytes 0..255, BOS 256, EOS 257 (never trained; generation stops at the token budget) |
| **held-out bits per byte** | **{bpb:.3f}** (`rewind eval`, Jude + Revelation, 65,598 bytes) |

## Architecture

Pre-norm decoder: hidden size {c['hidden_size']}, {c['num_hidden_layers']} layers, SwiGLU MLP of width
{c['intermediate_size']}, RMSNorm (eps {c['rms_norm_eps']}), RoPE theta {c['rope_theta']:g},
{'tied' if c['tie_word_embeddings'] else 'untied'} input and output embeddings, no biases.

| layer | kind | |
|---|---|---|
{describe_layers(c)}

## Data and split

King James Bible from Debian's `bible-kjv` package (`bible -f "Gen1:1-Rev22:21"`),
verse references stripped, one verse per line, ASCII (`scripts/train/corpus.py`).
Training: Genesis to 3 John, 4,072,252 bytes. Held out: **Jude and Revelation**
(the last two books), 65,598 bytes, never seen in training.

## Training

`scripts/train/train.py --config {t['config']}` (see `scripts/train/README.md`):
AdamW, peak learning rate {t['lr']}, {t['warmup']} warm-up steps, cosine decay to 10% over a
wall-clock budget, weight decay {t['weight_decay']}, batches of {t['batch']} random windows of
{t['seq']} bytes (BOS + window). Debian's PyTorch 1.13 on a shared 2-core CPU,
threads: {t['threads']}.{distillation}

| | |
|---|---|
| wall time | {t['minutes']:.1f} min |
| steps | {t['steps']:,} |
| tokens seen | {t['tokens']:,} ({t['epochs']:.2f} epochs of the training text) |
| final training loss | {t['final_train_bpb']:.3f} bits per byte (moving average) |
| held-out, PyTorch estimate | {t['held_out_bpb_python_estimate']:.3f} bits per byte (16 windows of 512 bytes) |{agreement_row}

{history_head}
{history}

## Evaluation

```
$ rewind eval --model {args.model_dir} --text build-data/kjv/valid.txt
{ev.strip()}
```

Each 512-byte segment of the held-out text is fed as its own sequence (BOS +
bytes, the length the model was trained on) through the cache in forwards of
128 tokens, so sliding-window eviction and the {carried} carried between
forwards are exercised; the result does not depend on the
chunk size (batch-invariant forward). With 4096-byte segments, 8 times the
training length, the model scores {bpb_long:.3f} bits per byte
(`--context 4096`): it does not break down beyond the length it was trained on.

## Cross-check with PyTorch

`tests/runtime/shipped_models_test.cc` compares the runtime's logits with
`tests/fixtures/shipped_models_logits.json`, computed by `scripts/train/model.py`
from this file (f16 weights, f32 compute), prompts longer than the sliding
window fed in chunks of 1, 5, 17, 64 and the rest. Tolerance per logit row:
max |C++ - PyTorch| <= 1e-3 x max(1, max |logit|); observed 1.3e-6.

## Samples

Sampled, 400 bytes, `rewind generate --model {args.model_dir} --prompt "{SAMPLE_PROMPT}"
--max-new-tokens 400 --temperature 0.7 --top-k 40 --seed 1`:

```
{SAMPLE_PROMPT}{sampled}
```

Greedy, 300 bytes (same command without the sampling options). Like most
small byte-level models, greedy decoding tends to repeat itself:

```
{SAMPLE_PROMPT}{sample}
```
{args.extra}"""
    with open(os.path.join(args.model_dir, "README.md"), "w") as f:
        f.write(card)
    print(f"wrote {args.model_dir}/README.md (held-out {bpb:.3f} bits per byte)")


if __name__ == "__main__":
    main()
