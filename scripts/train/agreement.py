"""Top-1 agreement of a draft model with its target on held-out text: the
fraction of positions where argmax(draft logits) == argmax(target logits).

This is what greedy speculative decoding needs of a draft: a drafted token
is kept when it is the target's argmax, so the agreement on text is the
acceptance rate of the first drafted token of a round (later positions of a
round also need every earlier one accepted; `rewind verify` prints the
acceptance per position).

  /usr/bin/python3 scripts/train/agreement.py DRAFT_DIR TARGET_DIR [--valid build-data/kjv/valid.txt]

The text is cut into segments of --seq bytes (512, the training length),
each fed as its own sequence, BOS + bytes, as `rewind eval --context 512`
does; every byte of the text is one position (65,598 for Jude +
Revelation). Both models are loaded from their exported files
(export.load_model: the stored f16 weights, f32 compute), so the figure is
the shipped models'. train.py --distill-from uses the same functions.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export import load_model  # noqa: E402

BOS = 256


def segments(data, T):
    """(inputs, targets) batches covering `data` (1-D int64) in segments of
    T bytes: full segments in one [n, T] batch, the remainder alone."""
    out = []
    n_full = len(data) // T
    if n_full:
        y = data[:n_full * T].view(n_full, T)
        out.append(y)
    if len(data) % T:
        out.append(data[n_full * T:].view(1, -1))
    return [(torch.cat([torch.full((y.shape[0], 1), BOS, dtype=torch.long), y[:, :-1]], dim=1), y) for y in out]


@torch.no_grad()
def argmax_tokens(model, data, T=512, batch=8):
    """argmax of `model`'s logits at every position of `data` (1-D int64,
    segments as in segments()), as one 1-D tensor of len(data)."""
    was_training = model.training
    model.eval()
    out = []
    for x, _ in segments(data, T):
        for i in range(0, x.shape[0], batch):
            out.append(model(x[i:i + batch]).argmax(-1).reshape(-1))
    model.train(was_training)
    return torch.cat(out)


def agreement(model, data, target_argmax, T=512):
    """Fraction of the positions of `data` where `model`'s argmax equals
    `target_argmax` (argmax_tokens of the target on the same data)."""
    mine = argmax_tokens(model, data, T)
    return (mine == target_argmax).float().mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("draft")
    ap.add_argument("target")
    ap.add_argument("--valid", default="build-data/kjv/valid.txt")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with open(args.valid, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    draft, target = load_model(args.draft), load_model(args.target)
    t = argmax_tokens(target, data, args.seq)
    d = argmax_tokens(draft, data, args.seq)
    agree = (d == t).float()
    half = len(agree) // 2  # the two halves of the text, to see the spread
    print(f"{args.draft} vs {args.target} on {args.valid}: top-1 agreement {agree.mean().item():.4f} "
          f"({int(agree.sum().item())} of {len(agree)} positions; halves {agree[:half].mean().item():.4f} "
          f"{agree[half:].mean().item():.4f})")


if __name__ == "__main__":
    main()
