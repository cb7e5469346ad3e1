"""Where a decode token's time goes: building the graph on the host vs evaluating it.

    python -m benchmarks.decode_split --context 8192 --layers 30 --heads 9/3 --head-dim 64

Prefills a random-init Llama, then decodes with a sync after every token and
times three parts: `model(token)` (Python + MLX graph building), `mx.async_eval`
(the backend encoding the graph's launches on the calling thread) and the wait
for the device to finish. Decode is host-bound when build + encode exceeds
the device's share (generate_step overlaps a token's host work with the last one's device work). mlx-lm's
KVCache, the fp16 recipe, kivi and kivi with the fused kernel switched off
(VELOXQUANT_KERNELS=off), in one run; then a cProfile of kivi's host half.
"""

import argparse
import cProfile
import io
import os
import pstats
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

from veloxquant.bench.e2e import random_llama
from veloxquant.eval.feed import prefill
from veloxquant.runtime import make_prompt_cache, uninstall


def decode(model, cache, n: int, profile=None):
    """ms per token, of which host build, host encode and device wait, over n synced steps."""
    y = mx.array([[1]])
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_split", description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", default="9/3")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args(argv)
    heads, kv_heads = map(int, args.heads.split("/"))
    mx.random.seed(0)
    model = random_llama(args.layers, heads, kv_heads, args.head_dim, args.vocab, getattr(mx, args.dtype))
    prompt = mx.random.randint(0, args.vocab, (1, args.context))
    print(
        f"random Llama: ctx={args.context} layers={args.layers} heads={heads}/{kv_heads} D={args.head_dim}; "
        f"{args.steps} decode steps, sync every step; device {mx.default_device()}"
    )
    print("| cache | ms/token | host build ms | host encode ms | device wait ms | tok/s |")
    print("|---|---|---|---|---|---|")
    rows = [
        ("mlx-lm KVCache", lambda: mlx_prompt_cache(model), ""),
        ("fp16", lambda: make_prompt_cache(model, "fp16"), ""),
        ("kivi", lambda: make_prompt_cache(model, "kivi"), ""),
        ("kivi kernels off", lambda: make_prompt_cache(model, "kivi"), "off"),
    ]
    for label, make, kernels in rows:
        os.environ["VELOXQUANT_KERNELS"] = kernels
        cache = make()
        prefill(model, prompt, cache, 2048)
        decode(model, cache, 8)  # warm: first-use compiles
        ms, build, encode, wait = decode(model, cache, args.steps)
        print(f"| {label} | {ms:.2f} | {build:.2f} | {encode:.2f} | {wait:.2f} | {1e3 / ms:.1f} |", flush=True)
        uninstall(model)
        del cache
    os.environ["VELOXQUANT_KERNELS"] = ""
    cache = make_prompt_cache(model, "kivi")
    prefill(model, prompt, cache, 2048)
    decode(model, cache, 8)
    profile = cProfile.Profile()
    decode(model, cache, 32, profile)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(15)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
