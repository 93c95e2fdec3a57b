"""Speculative decoding in PyTorch with rewind's Python cache.

Runs the PyTorch definition of the shipped hybrid (scripts/train/model.py:
2 LFM2 short-conv layers, 2 sliding-window attention layers, a Gated
DeltaNet layer and a full-attention layer) on the shipped weights
(models/kjv-hybrid), with rewind.DynamicCache as its cache:

  1. greedy decoding, one token per forward;
  2. speculative decoding with the shipped draft (models/kjv-draft, its own
     rewind cache): the draft proposes K tokens, the target verifies them in
     one forward of K + 1 tokens, and both caches crop the rejected tokens
     (crop(-(K - accepted)), also when that is 0). The Gated DeltaNet state
     rolls back too: that is what transformers cannot do.

It prints IDENTICAL when both token streams are equal, then compares the
PyTorch logits of the prompt with the C++ runtime's (rewind.Model) within
1e-4 of the logit scale.

  /usr/bin/python3 examples/python/speculative.py [--tokens 48] [--draft-k 4]
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "train"))

import rewind  # noqa: E402
from export import load_model  # noqa: E402  (scripts/train: reads config.json + model.safetensors)


def new_cache(model, rollback):
    """The one line a transformers user changes: rewind's DynamicCache from the model's config."""
    cache = rewind.DynamicCache(config=model.config)
    cache.activate_past_recording(rollback)
    return cache


@torch.no_grad()
def forward(model, tokens, cache):
    return model(torch.tensor([tokens]), past_key_values=cache)[0]


@torch.no_grad()
def greedy(model, prompt, n):
    cache = new_cache(model, 1)
    out = [int(forward(model, prompt, cache)[-1].argmax())]
    while len(out) < n:
        out.append(int(forward(model, [out[-1]], cache)[-1].argmax()))
    return out


@torch.no_grad()
def speculative(target, draft, prompt, n, k):
    """Returns (tokens, rounds, accepted drafts). Invariant at each round: the
    target cache holds seq[:-1], the draft cache seq[:draft_len]."""
    tcache, dcache = new_cache(target, k), new_cache(draft, k)
    seq = list(prompt)
    seq.append(int(forward(target, prompt, tcache)[-1].argmax()))
    draft_len = 0
    rounds = accepted_total = 0
    while len(seq) - len(prompt) < n:
        proposals = []
        logits = forward(draft, seq[draft_len:], dcache)
        for i in range(k):
            proposals.append(int(logits[-1].argmax()))
            if i + 1 < k:
                logits = forward(draft, [proposals[-1]], dcache)
        # the draft cache now holds seq + proposals[:-1]
        verify = forward(target, [seq[-1]] + proposals, tcache)
        best = verify.argmax(-1).tolist()
        a = 0
        while a < k and proposals[a] == best[a]:
            a += 1
        seq.extend(proposals[:a] + [best[a]])
        tcache.crop(-(k - a))  # also crop(0) when everything was accepted
        keep = min(a, k - 1)
        dcache.crop(-(k - 1 - keep))
        draft_len = len(seq) - 1 - a + keep
        assert tcache.get_seq_length() == len(seq) - 1
        assert dcache.get_seq_length() == draft_len
        rounds += 1
        accepted_total += a
    return seq[len(prompt):len(prompt) + n], rounds, accepted_total


def compare_with_runtime(target_dir, model, tokens, split):
    """Max |PyTorch - C++| over the logits of `tokens`, relative to max(1, max |PyTorch|). The C++ runtime
    takes them in one forward; PyTorch in two (tokens[:split], then the rest through the cache), so the
    comparison covers the cache's carried state, past the sliding window when the sequence is long enough."""
    cpp = rewind.Model.load(target_dir)
    cpp_logits = torch.from_numpy(cpp.forward(tokens, cpp.make_cache()))
    cache = new_cache(model, 1)
    py_logits = torch.cat([forward(model, tokens[:split], cache), forward(model, tokens[split:], cache)])
    scale = max(1.0, float(py_logits.abs().max()))
    return float((cpp_logits - py_logits).abs().max()) / scale, cpp


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=os.path.join(ROOT, "models", "kjv-hybrid"))
    ap.add_argument("--draft", default=os.path.join(ROOT, "models", "kjv-draft"))
    ap.add_argument("--prompt", default="And it came to pass, when the king")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--draft-k", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    target, draft = load_model(args.target), load_model(args.draft)
    prompt = [target.config.bos_token_id] + list(args.prompt.encode())

    t0 = time.perf_counter()
    plain = greedy(target, prompt, args.tokens)
    t1 = time.perf_counter()
    spec, rounds, accepted = speculative(target, draft, prompt, args.tokens, args.draft_k)
    t2 = time.perf_counter()
    text = bytes(t for t in plain if t < 256).decode(errors="replace")
    print(f"prompt: {args.prompt!r}")
    print(f"greedy      ({t1 - t0:.2f} s): {text!r}")
    print(f"speculative ({t2 - t1:.2f} s, K={args.draft_k}, {rounds} rounds, "
          f"{accepted}/{rounds * args.draft_k} drafts accepted)")
    identical = plain == spec
    print("IDENTICAL" if identical else "DIFFERENT")

    error, cpp = compare_with_runtime(args.target, target, prompt + plain[:-1], len(prompt))
    ok = error <= 1e-4
    print(f"logits of {len(prompt) + len(plain) - 1} tokens vs the C++ runtime: max |diff| / max(1, max |logit|) = {error:.2e} "
          f"({'within' if ok else 'ABOVE'} 1e-4)")
    cpp_tokens, _ = cpp.generate(prompt, max_new_tokens=args.tokens, stop_at_eos=False)
    print("C++ runtime greedy tokens:", "same" if cpp_tokens == plain else "different")
    return 0 if identical and ok else 1


if __name__ == "__main__":
    sys.exit(main())
