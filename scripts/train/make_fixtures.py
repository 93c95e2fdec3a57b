"""Writes tests/fixtures/shipped_models_logits.json: logits that the PyTorch
model (scripts/train/model.py) computes for fixed prompts on the shipped
models, loaded back from their exported f16 files and run in f32.
tests/runtime/shipped_models_test.cc feeds the same prompts to the C++
runtime in uneven chunks and compares.

  /usr/bin/python3 scripts/train/make_fixtures.py [--only models/kjv-draft]

--only DIR recomputes that model's entry alone and keeps the other entries
as the file stores them (after retraining one model: the other's logits
then stay byte for byte, although a different BLAS or CPU would round the
recomputed ones differently in the last bits, ~1e-6 of the logit scale).

To keep the file small only some positions are stored: the first ones, both
sides of the sliding window (64), and the end of each prompt (which is longer
than the window, so the C++ side must have evicted and carried state over).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export import load_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ["models/kjv-hybrid", "models/kjv-draft"]
PROMPTS = [
    # Held-out text (Revelation 21:1-2), 180 bytes.
    "And I saw a new heaven and a new earth: for the first heaven and the first earth were passed away; "
    "and there was no more sea.\nAnd I John saw the holy city, new Jerusalem, coming down",
    # Not from the Bible at all, 120 bytes: the models must agree off-distribution too.
    "The quick brown fox jumps over the lazy dog; 0123456789 {json: [1, 2.5e-3]} #include <cstdio> "
    "int main() { return 42; }",
]
POSITIONS = [0, 1, 2, 3, 31, 62, 63, 64, 65, 96, 127]  # plus the last 3 of each prompt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=MODELS, help="recompute this model's entry, keep the others as stored")
    args = ap.parse_args()
    path = os.path.join(ROOT, "tests", "fixtures", "shipped_models_logits.json")
    stored = {}
    if args.only:
        with open(path) as f:
            stored = {m["model"]: m for m in json.load(f)["models"]}
    out = {
        "about": "Logits of scripts/train/model.py (PyTorch, f32 compute) for the shipped models loaded from "
                 "their exported files; regenerate with /usr/bin/python3 scripts/train/make_fixtures.py. "
                 "tokens = BOS (256) + the prompt's bytes; logits[i] is the row of tokens position "
                 "positions[i] (the prediction of the token after it).",
        "tolerance": "per row: max |cpp - python| <= 1e-3 * max(1, max |python|)",
        "models": [],
    }
    torch.set_num_threads(1)
    for model_dir in MODELS:
        if args.only and model_dir != args.only:
            out["models"].append(stored[model_dir])
            continue
        model = load_model(os.path.join(ROOT, model_dir))
        entry = {"model": model_dir, "parameters": model.parameter_count(), "prompts": []}
        for text in PROMPTS:
            tokens = [model.config.bos_token_id] + list(text.encode("utf-8"))
            with torch.no_grad():
                logits = model(torch.tensor([tokens]))[0]
            n = len(tokens)
            positions = sorted({p for p in POSITIONS if p < n} | {n - 3, n - 2, n - 1})
            entry["prompts"].append({
                "text": text,
                "tokens": tokens,
                "positions": positions,
                "logits": [[float(f"{v:.7g}") for v in logits[p].tolist()] for p in positions],
            })
        out["models"].append(entry)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
