"""Where a decode step's time goes: building the graph on the host, encoding its launches, and
the device; and how much of the device's share the cache's attention is.

    python -m benchmarks.decode_split --context 8192 --layers 30 --heads 9/3 --head-dim 64
    python -m benchmarks.decode_split --preset llama3-8b --weights-bits 4 --batch 8 --context 8192

Prefills a random-init model, then decodes with a sync after every step and times three parts:
`model(token)` (Python + MLX graph building), `mx.async_eval` (the backend encoding the graph's
launches on the calling thread) and the wait for the device to finish. Decode is host-bound when
build + encode exceeds the device's share (generate_step and BatchGenerator overlap a step's host
work with the last one's device work). Rows: mlx-lm's KVCache holding `--short` tokens (the step
with next to no attention: weights, norms, sampling), mlx-lm's KVCache, then each recipe
(`kivi@off`: kivi with VELOXQUANT_KERNELS=off), interleaved over `--rounds`, medians.

`--batch N` steps N sequences together: N caches of each kind prefilled alone (row i's prompt 7 x i
tokens shorter), merged by the caches' own `merge` (mlx-lm's KVCache into its BatchKVCache, ours into
one cache per layer holding N rows), as mlx-lm's BatchGenerator holds them. `--profile` adds a
cProfile of the last recipe's host half.
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

from benchmarks.host_step import RAGGED, prefilled
from veloxquant.bench.e2e import random_model
from veloxquant.bench.presets import add_preset_args, apply_preset, quantized
from veloxquant.eval.rows import spec_caches, split_specs
from veloxquant.runtime import uninstall


def decode(model, cache, n: int, batch: int, profile=None):
    """ms per step, of which host build, host encode and device wait, over n synced steps."""
    y = mx.ones((batch, 1), dtype=mx.int32)
    build = encode = wait = 0.0
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        if profile:
            profile.enable()
        logits = model(y, cache=cache)
        y = mx.argmax(logits[:, -1:], axis=-1)
        if profile:
            profile.disable()
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        build, encode, wait = build + t1 - t0, encode + t2 - t1, wait + t3 - t2
    return tuple(x / n * 1e3 for x in (time.perf_counter() - start, build, encode, wait))


def row_maker(model, spec: str):
    """A maker of one sequence's caches for a row spec (`kivi[bits=2]`), and VELOXQUANT_KERNELS for
    it: `spec@off` runs with the kernels off."""
    recipe = spec.removesuffix("@off")
    kernels = "off" if recipe != spec else ""
    return (lambda: spec_caches(model, recipe)), kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_split", description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", default="9/3")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=0)
    ap.add_argument("--intermediate", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=49152)
    add_preset_args(ap)
    ap.add_argument("--recipes", default="fp16,kivi,kivi@off")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--short", type=int, default=16, help="tokens the short-context KVCache row holds")
    ap.add_argument("--steps", type=int, default=16, help="synced decode steps per row and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--profile", action="store_true")
    args = apply_preset(ap.parse_args(argv))
    heads, kv_heads = map(int, args.heads.split("/"))
    mx.random.seed(0)
    shape = (args.layers, heads, kv_heads, args.head_dim, args.vocab, getattr(mx, args.dtype))
    model, name = random_model("llama", shape + (args.hidden, args.intermediate))
    model, name = quantized(model, args.weights_bits, name)
    prompt = mx.random.randint(0, args.vocab, (1, args.context))
    short = prompt[:, : args.short + RAGGED * (args.batch - 1)]  # the shortest row holds --short
    kv_cache = lambda: mlx_prompt_cache(model)  # noqa: E731
    rows = {f"mlx-lm KVCache, {args.short} tokens": (prefilled(model, short, kv_cache, args.batch), "")}
    rows["mlx-lm KVCache"] = (prefilled(model, prompt, kv_cache, args.batch), "")
    for spec in split_specs(args.recipes):
        make, kernels = row_maker(model, spec)
        os.environ["VELOXQUANT_KERNELS"] = kernels
        rows[spec] = (prefilled(model, prompt, make, args.batch), kernels)
    samples = {label: [] for label in rows}
    for label, (cache, kernels) in rows.items():  # warm: first-use compiles
        os.environ["VELOXQUANT_KERNELS"] = kernels
        decode(model, cache, 4, args.batch)
    for _ in range(args.rounds):
        for label, (cache, kernels) in rows.items():
            os.environ["VELOXQUANT_KERNELS"] = kernels
            samples[label].append(decode(model, cache, args.steps, args.batch))
    os.environ["VELOXQUANT_KERNELS"] = ""
    print(
        f"{name}: context {args.context}, batch {args.batch}, {args.layers} layers, {heads}/{kv_heads} heads, "
        f"D={args.head_dim}, {args.dtype}; {args.rounds} rounds x {args.steps} synced steps, medians; "
        f"device {mx.default_device()}"
    )
    print("| cache | ms/step | host build ms | host encode ms | device wait ms | tok/s (all rows) |")
    print("|---|---|---|---|---|---|")
    for label, runs in samples.items():
        ms, build, encode, wait = (statistics.median(r[i] for r in runs) for i in range(4))
        print(f"| {label} | {ms:.2f} | {build:.2f} | {encode:.2f} | {wait:.2f} | {args.batch * 1e3 / ms:.1f} |")
    if args.profile:
        cache, kernels = rows[label]
        os.environ["VELOXQUANT_KERNELS"] = kernels
        profile = cProfile.Profile()
        decode(model, cache, 16, args.batch, profile)
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue())
    uninstall(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
