"""Trains a rewind hybrid model on the KJV corpus for a fixed wall-clock
budget and exports it (config.json + model.safetensors, f16).

  /usr/bin/python3 scripts/train/train.py --config scripts/train/configs/target.json \
      --out models/kjv-hybrid --minutes 40

Batches are random windows of the training text: inputs BOS + bytes
[o, o + T - 1), targets bytes [o, o + T) (so every window is a "document"
that starts with BOS, as `rewind eval` and `rewind generate` feed text).
The learning rate warms up linearly, then follows a cosine to 10% of the
peak planned over the wall-clock budget (not a step count: the machine is
shared and its speed varies); training stops when the budget is spent.
Progress lines: step, loss, held-out bits per byte (periodically), tokens/s,
elapsed, ETA. A checkpoint (OUT/../<name>.ckpt.pt unless --checkpoint) is
written every few minutes and at the end; the summary goes to
OUT/training.json for the model card.

Distillation (--distill-from TARGET_DIR, how the shipped draft is made):
the model learns the target's next-token distribution instead of, or
besides, the data's next byte. The target is loaded from its exported files
(export.load_model: the shipped f16 weights, f32 compute) and run under
torch.no_grad on every batch; the loss is

  alpha * KL(target || model) + (1 - alpha) * cross-entropy(model, data)

per position, KL over the full softmax at temperature 1 (soft labels),
alpha = --alpha (default 1: the target's distribution alone). The target's
forward costs about three of the draft's training steps, so
--distill-start F trains on the data alone (cheap steps, no target forward)
for the first fraction F of the budget and switches the distillation loss
on after that; the learning-rate schedule is unchanged. Progress lines and
OUT/training.json then also report the held-out top-1 agreement with the
target (agreement.py: the fraction of the positions of the held-out text
where both models' argmax is the same token), which greedy speculative
decoding's acceptance follows. --alpha 0 trains on the data alone and only
measures the agreement. The final agreement in training.json is the
exported (f16) model's.

  /usr/bin/python3 scripts/train/train.py --config scripts/train/configs/draft.json \
      --out models/kjv-draft --minutes 12 --lr 3e-3 --threads 1 \
      --distill-from models/kjv-hybrid --alpha 1 --distill-start 0.4
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
from agreement import agreement, argmax_tokens  # noqa: E402
from export import export_model, load_model  # noqa: E402
from model import Config, Model  # noqa: E402

BOS = 256
LN2 = math.log(2.0)


def load_bytes(path):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()


def batch(data, B, T, gen):
    o = torch.randint(0, len(data) - T, (B,), generator=gen)
    idx = o[:, None] + torch.arange(T)[None, :]
    y = data[idx]
    x = torch.cat([torch.full((B, 1), BOS, dtype=torch.long), y[:, :-1]], dim=1)
    return x, y


@torch.no_grad()
def held_out_bpb(model, valid, T, windows=16):
    """Bits per byte on `windows` evenly spaced held-out windows (a quick
    estimate for the log; the model card reports `rewind eval`)."""
    model.eval()
    starts = torch.linspace(0, len(valid) - T - 1, windows).long()
    idx = starts[:, None] + torch.arange(T)[None, :]
    y = valid[idx]
    x = torch.cat([torch.full((windows, 1), BOS, dtype=torch.long), y[:, :-1]], dim=1)
    total = 0.0
    for i in range(0, windows, 4):
        lg = model(x[i:i + 4])
        total += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y[i:i + 4].reshape(-1), reduction="sum").item()
    model.train()
    return total / (windows * T) / LN2


def fmt_time(s):
    s = int(s)
    return f"{s // 60}:{s % 60:02d}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="architecture JSON (scripts/train/configs/)")
    ap.add_argument("--out", required=True, help="model directory to export to")
    ap.add_argument("--data", default="build-data/kjv", help="corpus directory (made by corpus.py if absent)")
    ap.add_argument("--minutes", type=float, default=40.0, help="wall-clock training budget")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads; 0 = auto: every 100 steps time 3 steps on 1 and on 2 threads and "
                         "keep the faster (on a shared 2-core machine 2 threads can be 3x slower than 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--dtype", default="f16", choices=["f16", "bf16", "f32"])
    ap.add_argument("--distill-from", default=None, metavar="DIR",
                    help="target model directory: train on its next-token distributions (see above) and "
                         "report the held-out top-1 agreement with it")
    ap.add_argument("--alpha", type=float, default=1.0,
                    help="with --distill-from: weight of KL(target || model); 1 - alpha weighs the "
                         "cross-entropy on the data (0: data alone, agreement only measured)")
    ap.add_argument("--distill-start", type=float, default=0.0, metavar="F",
                    help="with --distill-from: train on the data alone (cross-entropy, no target forward) for "
                         "the first fraction F of the budget, then switch the distillation loss on")
    args = ap.parse_args()
    if not 0.0 <= args.distill_start < 1.0:
        ap.error("--distill-start must be in [0, 1)")
    if args.distill_start > 0 and not args.distill_from:
        ap.error("--distill-start needs --distill-from")
    if not 0.0 <= args.alpha <= 1.0:
        ap.error("--alpha must be in [0, 1]")

    threads = args.threads or 2
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    train_path, valid_path = corpus.ensure(args.data)
    train, valid = load_bytes(train_path), load_bytes(valid_path)
    with open(args.config) as f:
        cfg = json.load(f)
    cfg.setdefault("vocab_size", 258)
    config = Config.from_dict(cfg)
    model = Model(config)
    n_params = model.parameter_count()
    teacher, valid_target_argmax = None, None
    if args.distill_from:
        teacher = load_model(args.distill_from)
        for p in teacher.parameters():
            p.requires_grad_(False)
        if teacher.config.vocab_size != config.vocab_size:
            sys.exit(f"--distill-from: the target's vocabulary ({teacher.config.vocab_size}) is not the model's "
                     f"({config.vocab_size})")
        valid_target_argmax = argmax_tokens(teacher, valid, args.seq)
    ckpt_path = args.checkpoint or os.path.join("build-data", os.path.basename(os.path.normpath(args.out)) + ".ckpt.pt")
    os.makedirs(os.path.dirname(ckpt_path) or ".", exist_ok=True)

    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    budget = args.minutes * 60.0
    print(f"model: {n_params} parameters, layers {config.layer_types}", flush=True)
    print(f"data: {len(train)} training bytes, {len(valid)} held-out bytes; batch {args.batch} x {args.seq}; "
          f"budget {args.minutes:.1f} min; threads {args.threads or 'auto'}", flush=True)
    if teacher is not None and args.alpha > 0:
        print(f"distilling from {args.distill_from} ({teacher.parameter_count()} parameters): "
              f"loss = {args.alpha:g} * KL(target || model) + {1 - args.alpha:g} * cross-entropy"
              + (f", from {100 * args.distill_start:g}% of the budget on (cross-entropy alone before)"
                 if args.distill_start > 0 else ""),
              flush=True)
    elif teacher is not None:
        print(f"alpha 0: cross-entropy on the data only; agreement measured with {args.distill_from}", flush=True)

    def save(step, tokens, elapsed):
        torch.save({"config": config.to_dict(), "model": model.state_dict(), "step": step,
                    "tokens": tokens, "elapsed": elapsed}, ckpt_path)

    start = time.time()
    step, tokens, ema, ema_kl, last_ck, last_log = 0, 0, None, None, start, start
    bpb, agree = None, None
    history = []
    while True:
        elapsed = time.time() - start
        if elapsed >= budget:
            break
        progress = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        phase = step % 100
        if args.threads == 0 and phase < 6:
            if phase == 0:
                probe = {1: [], 2: []}
            torch.set_num_threads(1 if phase < 3 else 2)
        t_step = time.time()
        x, y = batch(train, args.batch, args.seq, gen)
        logits = model(x)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss = ce
        if teacher is not None and args.alpha > 0 and progress >= args.distill_start:
            with torch.no_grad():
                target_logp = F.log_softmax(teacher(x).reshape(-1, logits.shape[-1]), dim=-1)
            # KL(target || model) per position, summed over the vocabulary.
            kl = F.kl_div(F.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1), target_logp,
                          reduction="batchmean", log_target=True)
            loss = args.alpha * kl + (1.0 - args.alpha) * ce
            ema_kl = kl.item() if ema_kl is None else 0.98 * ema_kl + 0.02 * kl.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if args.threads == 0 and phase < 6:
            probe[1 if phase < 3 else 2].append(time.time() - t_step)
            if phase == 5:  # the first of each 3 may include the switch: use the best 2
                threads = min((1, 2), key=lambda n: sum(sorted(probe[n])[:2]))
                torch.set_num_threads(threads)
        step += 1
        tokens += x.numel()
        ema = ce.item() if ema is None else 0.98 * ema + 0.02 * ce.item()
        now = time.time()
        if step % args.eval_every == 0:
            bpb = held_out_bpb(model, valid, args.seq)
            history.append({"step": step, "tokens": tokens, "minutes": round((now - start) / 60, 2),
                            "train_bpb": round(ema / LN2, 4), "held_out_bpb": round(bpb, 4)})
            if teacher is not None:
                agree = agreement(model, valid, valid_target_argmax, args.seq)
                history[-1]["held_out_agreement"] = round(agree, 4)
                if ema_kl is not None:
                    history[-1]["train_kl_bits"] = round(ema_kl / LN2, 4)
        if now - last_log >= 15 or step % args.eval_every == 0:
            last_log = now
            el = now - start
            print(f"step {step:6d}  {'cross-entropy' if ema_kl is not None else 'loss'} {ema:.4f} ({ema / LN2:.3f} bpb)"
                  + (f"  KL {ema_kl / LN2:.3f} bits" if ema_kl is not None else "")
                  + (f"  held-out {bpb:.3f} bpb" if bpb is not None else "")
                  + (f"  agreement {agree:.4f}" if agree is not None else "")
                  + f"  lr {lr:.2e}  {tokens / el:7.0f} tok/s  {tokens / 1e6:.2f}M tokens"
                  f"  {fmt_time(el)} elapsed, ETA {fmt_time(max(0.0, budget - el))}  [{torch.get_num_threads()} threads]",
                  flush=True)
        if now - last_ck >= 300:
            last_ck = now
            save(step, tokens, now - start)
    elapsed = time.time() - start
    bpb = held_out_bpb(model, valid, args.seq)
    print(f"done: {step} steps, {tokens} tokens ({tokens / len(train):.2f} epochs) in {fmt_time(elapsed)}; "
          f"held-out estimate {bpb:.3f} bpb", flush=True)
    save(step, tokens, elapsed)
    export_model(model, args.out, args.dtype, {"steps": step, "tokens": tokens})
    if teacher is not None:  # the exported (rounded) weights, as the runtime will run them
        agree = agreement(load_model(args.out), valid, valid_target_argmax, args.seq)
        print(f"held-out top-1 agreement with {args.distill_from}: {agree:.4f} (exported {args.dtype})", flush=True)
    summary = {"parameters": n_params, "steps": step, "tokens": tokens, "epochs": round(tokens / len(train), 3),
               "minutes": round(elapsed / 60, 2), "batch": args.batch, "seq": args.seq, "lr": args.lr,
               "warmup": args.warmup, "weight_decay": args.weight_decay, "threads": args.threads or "auto (1 or 2)",
               "seed": args.seed, "final_train_bpb": round(ema / LN2, 4),
               "held_out_bpb_python_estimate": round(bpb, 4), "history": history,
               "config": os.path.relpath(args.config)}
    if teacher is not None:
        summary.update({"distill_from": os.path.relpath(args.distill_from), "alpha": args.alpha,
                        "distill_start": args.distill_start,
                        "loss": f"{args.alpha:g} * KL(target || model) + {1 - args.alpha:g} * cross-entropy",
                        "final_train_kl_bits": round(ema_kl / LN2, 4) if ema_kl is not None else None,
                        "held_out_agreement": round(agree, 4)})
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    print(f"exported {args.out} ({args.dtype})", flush=True)


if __name__ == "__main__":
    main()
