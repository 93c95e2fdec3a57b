#!/usr/bin/env python3
"""What a decode step's cache work costs, rewind.DynamicCache against transformers' DynamicCache, on one device.

Shapes of a current model's attention layer: batch 1, 8 KV heads x 128 head dim, float16 on CUDA (float32 on the
CPU), 4 layers. Three operations, each at lengths L = 1024 and 8192:

- update: one decode step, ``cache.update(k, v, i)`` on every layer with one new token (transformers:
  ``torch.cat`` of the whole history per step);
- crop: a speculative round's rollback, update with 5 tokens then ``crop(-4)`` (transformers: a slice of every
  layer, whose history the next ``torch.cat`` copies);
- fork: ``copy.deepcopy(cache)`` (transformers' way to reuse a prompt cache for a second continuation).

Times are medians over 7 repeats of a loop (CUDA: synchronised before and after), with the spread (min-max)
across repeats, in microseconds per operation. Without transformers installed the comparison column is a
``torch.cat`` per step written here (the operation transformers' ``DynamicLayer.update`` performs), named so.

    PYTHONPATH=build/python python3 scripts/gpu_cache_bench.py --device cuda
"""

import argparse
import copy
import statistics
import sys
import time

import torch

import rewind

HEADS, HEAD_DIM, LAYERS = 8, 128, 4


class CatCache:
    """transformers' DynamicLayer.update as an operation: keys and values concatenated per step."""

    def __init__(self):
        self.keys, self.values = [None] * LAYERS, [None] * LAYERS

    def update(self, k, v, i):
        if self.keys[i] is None:
            self.keys[i], self.values[i] = k, v
        else:
            self.keys[i] = torch.cat([self.keys[i], k], dim=-2)
            self.values[i] = torch.cat([self.values[i], v], dim=-2)
        return self.keys[i], self.values[i]

    def crop(self, n):  # transformers' rule: n < 0 removes -n tokens
        if n < 0:
            n = self.keys[0].shape[-2] + n
        for i in range(LAYERS):
            self.keys[i], self.values[i] = self.keys[i][..., :n, :], self.values[i][..., :n, :]


def baseline():
    try:
        import transformers
        return "transformers " + transformers.__version__ + " DynamicCache", transformers.DynamicCache
    except ImportError:
        return "torch.cat per step (transformers not installed)", CatCache


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn, n, repeats=7):
    """Median and (min, max) microseconds per call of fn over `repeats` loops of n calls."""
    per_call = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync(device)
        per_call.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(per_call), min(per_call), max(per_call)


def filled(make, device, dtype, length):
    cache = make()
    k = torch.randn(1, HEADS, length, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn(1, HEADS, length, HEAD_DIM, device=device, dtype=dtype)
    for i in range(LAYERS):
        cache.update(k.clone(), v.clone(), i)  # distinct tensors per layer, as a model's
    return cache


def bench(make, device, dtype, length):
    one = [torch.randn(1, HEADS, 1, HEAD_DIM, device=device, dtype=dtype) for _ in range(2)]
    five = [torch.randn(1, HEADS, 5, HEAD_DIM, device=device, dtype=dtype) for _ in range(2)]
    out = {}
    cache = filled(make, device, dtype, length)

    def step():
        for i in range(LAYERS):
            cache.update(one[0], one[1], i)
    out["update"] = timed(device, step, 32)

    cache = filled(make, device, dtype, length)

    def round_trip():
        for i in range(LAYERS):
            cache.update(five[0], five[1], i)
        cache.crop(-4)
    out["crop"] = timed(device, round_trip, 16)

    cache = filled(make, device, dtype, length)
    out["fork"] = timed(device, lambda: copy.deepcopy(cache), 4, repeats=5)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", default="1024,8192")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_cache_bench: torch sees no CUDA device")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    name, other = baseline()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"{dtype}, {LAYERS} layers of [1, {HEADS}, L, {HEAD_DIM}]; rewind {rewind.__version__} against {name}")
    print(f"{'operation':<8} {'L':>6} {'rewind us':>22} {'baseline us':>22} {'ratio':>7}")
    for length in lengths:
        mine = bench(lambda: rewind.DynamicCache(), device, dtype, length)
        theirs = bench(other, device, dtype, length)
        for op in ("update", "crop", "fork"):
            a, b = mine[op], theirs[op]
            print(f"{op:<8} {length:>6} {a[0]:>9.1f} ({a[1]:.1f}-{a[2]:.1f}) {b[0]:>9.1f} ({b[1]:.1f}-{b[2]:.1f}) "
                  f"{b[0] / a[0]:>6.2f}x")


if __name__ == "__main__":
    main()
