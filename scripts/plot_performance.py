#!/usr/bin/python3
"""Draws the plots of docs/performance.md.

usage: /usr/bin/python3 scripts/plot_performance.py BENCH_JSON OUT_DIR E2E_JSON[=LABEL] [E2E_JSON=LABEL ...]

  BENCH_JSON  Google Benchmark JSON of rewind_bench (repetitions, aggregates
              only), as read by bench/summarize.py
  OUT_DIR     where the PNGs go (docs/img)
  E2E_JSON    the --json file of `rewind bench`; the first is drawn solid
              (and gives the acceptance panel), further ones dotted, each
              with its LABEL in the legend

Writes OUT_DIR/update_vs_L.png (update cost vs L, log-log: rewind full
dynamic, concatenation baseline, memcpy; q = 1 and q = 128, f16) and
OUT_DIR/e2e_tokens_per_s.png (tokens/s vs K for the draft model and prompt
lookup, greedy as a horizontal line; acceptance vs K beside it).

Needs matplotlib: Debian's python3-matplotlib (`apt-get install -y
python3-matplotlib`), hence /usr/bin/python3 rather than another Python on
PATH.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# The benchmark JSON is read the way the report's tables read it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from summarize import cpu_ns, load  # noqa: E402


LENGTHS = [("1k", 1024), ("8k", 8192), ("64k", 65536)]


def load_bench(path):
    return load(path)[1]


def label_time(ns):
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.1f} µs" if ns < 1e4 else f"{ns / 1e3:.0f} µs"
    return f"{ns / 1e6:.1f} ms" if ns < 1e7 else f"{ns / 1e6:.0f} ms"


def plot_update(runs, out):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    xs = [n for _, n in LENGTHS]
    for ax, q in zip(axes, [1, 128]):
        series = [
            ("concatenate everything (torch.cat, copy only)", "concat_copy", "tab:red", "s"),
            ("rewind update + crop (full attention, dynamic)", "update/full_dynamic", "tab:blue", "o"),
        ]
        for label, prefix, color, marker in series:
            ys = [cpu_ns(runs[f"{prefix}/f16/q:{q}/L:{name}"]) for name, _ in LENGTHS]
            ax.plot(xs, ys, marker=marker, color=color, label=label, linewidth=2)
            for x, y in zip(xs, ys):
                ax.annotate(label_time(y), (x, y), textcoords="offset points", xytext=(0, 7),
                            ha="center", fontsize=8, color=color)
        mc = cpu_ns(runs[f"memcpy/f16/q:{q}"])
        ax.plot(xs, [mc] * len(xs), linestyle="--", color="black", linewidth=1.2, zorder=3,
                label=f"memcpy of the new keys + values ({label_time(mc)})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([name for name, _ in LENGTHS])
        ax.set_xlim(700, 95000)
        ax.set_xlabel("tokens in the cache (L)")
        ax.set_title(f"f16, 8 KV heads x 128, q = {q} new token{'s' if q > 1 else ''} per update")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("CPU time per update (log)")
    axes[0].set_ylim(10, 3e8)
    axes[0].set_yticks([1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8])
    axes[0].set_yticklabels(["10 ns", "100 ns", "1 µs", "10 µs", "100 µs", "1 ms", "10 ms", "100 ms"])
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles[:2], labels[:2], loc="lower center", ncol=2, fontsize=9, frameon=False)
    for ax in axes:
        ax.legend([ax.get_lines()[-1]], [ax.get_lines()[-1].get_label()], loc="center right", fontsize=8)
    fig.suptitle("KV-cache update cost vs cache length (medians of 3 repetitions)", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_e2e(runs, out):
    """runs: list of (label, rows); the first is drawn solid, the others dashed and lighter."""
    fig, (ax, acc) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    colors = {"draft": "tab:blue", "lookup": "tab:green"}
    markers = {"draft": "o", "lookup": "s"}
    names = {"draft": "draft model (kjv-draft)", "lookup": "prompt lookup"}
    top = 0.0
    for i, (label, rows) in enumerate(runs):
        style = dict(linestyle="-", linewidth=2, alpha=1.0) if i == 0 else dict(linestyle=":", linewidth=1.5,
                                                                                   alpha=0.6)
        suffix = f", {label}" if label else ""
        for method in ["draft", "lookup"]:
            sel = sorted((r for r in rows if r["method"] == method), key=lambda r: r["k"])
            if not sel:
                continue
            ax.plot([r["k"] for r in sel], [r["tokens_per_second"] for r in sel], marker=markers[method],
                    color=colors[method], label=f"speculative, {names[method]}{suffix}", **style)
            if i == 0:
                acc.plot([r["k"] for r in sel], [r["acceptance_rate"] for r in sel], marker=markers[method],
                         color=colors[method], label=names[method], linewidth=2)
        greedy = [r for r in rows if r["method"] == "greedy"]
        if greedy:
            g = greedy[0]["tokens_per_second"]
            ax.axhline(g, color="black", linestyle="--" if i == 0 else ":", alpha=style["alpha"],
                       label=f"greedy{suffix} ({g:,.0f} tok/s)")
        top = max([top] + [r["tokens_per_second"] for r in rows])
    ks = sorted({r["k"] for _, rows in runs for r in rows if r["method"] != "greedy"})
    ax.set_xticks(ks)
    ax.set_xlabel("K (drafted tokens per round)")
    ax.set_ylabel("tokens/s (median of repeats)")
    ax.set_ylim(0, 1.12 * top)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title("kjv-hybrid: greedy vs speculative decoding (all outputs = greedy)", fontsize=10)
    acc.set_xticks(ks)
    acc.set_ylim(0, 1)
    acc.set_xlabel("K")
    acc.set_ylabel("acceptance (accepted / drafted)")
    acc.grid(True, alpha=0.3)
    acc.legend(loc="upper right", fontsize=8)
    acc.set_title("acceptance rate", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv):
    if len(argv) < 4:
        sys.exit(__doc__)
    out_dir = argv[2]
    os.makedirs(out_dir, exist_ok=True)
    plot_update(load_bench(argv[1]), os.path.join(out_dir, "update_vs_L.png"))
    runs = []
    for spec in argv[3:]:
        path, _, label = spec.partition("=")
        with open(path) as f:
            runs.append((label, json.load(f)))
    plot_e2e(runs, os.path.join(out_dir, "e2e_tokens_per_s.png"))
    print(f"wrote {out_dir}/update_vs_L.png and {out_dir}/e2e_tokens_per_s.png")


if __name__ == "__main__":
    main(sys.argv)
