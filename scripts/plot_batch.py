#!/usr/bin/env python3
"""Draws docs/img/batch_tokens_per_s.png: aggregate tokens/s of batched
decoding against the batch size, from `rewind bench --batch ... --json` runs.

usage: /usr/bin/python3 scripts/plot_batch.py OUT_PNG LABEL=RUN1.json,RUN2.json,... [LABEL=...]

Each point is the median over the runs (each run's rows are already medians
of its repeats); the bars span the smallest and largest run. The dashed line
is the model's one-prompt greedy decoding. Needs Debian's python3-matplotlib.
"""
import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows_by_key(runs):
    table = {}
    for run in runs:
        for row in run:
            table.setdefault((row["method"], row["batch"], row["k"]), []).append(row["tokens_per_second"])
    return table


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out = sys.argv[1]
    models = []
    for arg in sys.argv[2:]:
        label, files = arg.split("=", 1)
        models.append((label, [json.load(open(f)) for f in files.split(",")]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, (label, runs) in zip(axes[0], models):
        table = rows_by_key(runs)
        solo = statistics.median(table[("greedy", 1, 0)])
        for method, style in (("greedy_batch", "o-"), ("draft_batch", "s-"), ("lookup_batch", "^-")):
            points = sorted((b, k, v) for (m, b, k), v in table.items() if m == method)
            if not points:
                continue
            xs = [b for b, _, _ in points]
            med = [statistics.median(v) for _, _, v in points]
            lo = [m - min(v) for m, (_, _, v) in zip(med, points)]
            hi = [max(v) - m for m, (_, _, v) in zip(med, points)]
            source = method.split("_")[0]
            name = "greedy, batched" if source == "greedy" else f"speculative ({source}, K={points[0][1]}), batched"
            ax.errorbar(xs, med, yerr=[lo, hi], fmt=style, capsize=3, label=name)
        ax.axhline(solo, linestyle="--", color="gray", label="greedy, one prompt")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences decoded together (batch)")
        ax.set_ylabel("tokens/s, all sequences")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
