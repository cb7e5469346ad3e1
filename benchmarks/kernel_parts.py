"""`python -m benchmarks.kernel_parts`: each piece of a coded layer's decode-step attention
(the route, the kernel's partial, its reduce with the 16-bit tail, the dequant kernel, the
decoded paths) against a pure-MLX reference, on a random 2-layer Llama (8/2 heads, head dim 64),
with a prompt fed in one block or in three, then kivi through mlx-lm's `generate_step`.

Prints NaN/inf flags and the largest difference per piece. Made to find why kivi gave NaN on
CUDA after a prompt fed in one block (the kernel's partials from the tier's own codes were NaN,
from `mx.contiguous` copies of the same arrays finite: results/results-h100-round21.json).
"""

import os
import traceback

import mlx.core as mx
from mlx_lm.generate import generate_step

import veloxquant
from veloxquant.bench.e2e import random_llama
from veloxquant.kernels.partials import merge_partials, partial_attention
from veloxquant.runtime import fused
from veloxquant.runtime import layer_attention as la

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def model(dtype):
    mx.random.seed(0)
    return random_llama(2, HEADS, KV_HEADS, HEAD_DIM, 500, dtype, intermediate=256)


def broken(x) -> bool:
    return bool(mx.isnan(x).any() or mx.isinf(x).any())


def compare(name: str, got, want) -> None:
    got = got.astype(mx.float32)
    diff = float(mx.abs(got - want.astype(mx.float32)).max())
    print(f"  {name:30s} nan/inf={broken(got)} maxdiff={diff:.3g}", flush=True)


def pure(tier, dtype):
    """The tier's K and V through its codecs' MLX ops (no kernel)."""
    if tier.sixteen_bit:
        return tier.decoded(dtype)
    return tuple(tier.codecs[s].decode(tier.encoded(s), dtype, tier.start) for s in ("k", "v"))


def contiguous(enc):
    return {n: mx.contiguous(x) for n, x in enc.items()}


def kernel_pieces(cache, tier, tiers, q, scale, want):
    answer = tier.answer(q, scale)
    print("  answer", type(answer).__name__, "launch key", tier.launch_key, flush=True)
    if answer is None:
        return
    k, v = pure(tier, mx.float32)
    out, lse = answer()
    ref_out, ref_lse = partial_attention(q, k, v, scale)
    compare("kernel partial out", out, ref_out)
    compare("kernel partial lse", lse, ref_lse)
    tail = fused.tail([u for u in tiers if u is not tier], q, cache.dtype, {})
    if tail:
        compare("kernel + reduce_tail", answer(tail), want)
    copied = fused.KernelAnswer(tier.launch, q, contiguous(tier.encoded("k")), contiguous(tier.encoded("v")), 0)
    compare("kernel partial (copied codes)", copied()[0], ref_out)
    if tail:
        compare("reduce_tail (copied tail)", copied([tuple(map(mx.contiguous, kv)) for kv in tail]), want)


def check(dtype, length: int, blocks: int, recipe: str = "kivi") -> None:
    m = model(dtype)
    caches = veloxquant.make_prompt_cache(m, recipe, [])
    prompt = mx.array([[1 + (j * 7) % 400 for j in range(length)]])
    step = -(-length // blocks)
    for s in range(0, length, step):
        mx.eval(m(prompt[:, s : s + step], cache=caches))
    logits = m(mx.array([[5]]), cache=caches)
    print(f"{recipe} {dtype} prompt {length} in {blocks} block(s): decode nan/inf={broken(logits)}", flush=True)
    cache = caches[0]
    cache._settle()
    tiers = la.held_in_order(cache.tiers)
    print("  tiers (start, count, 16-bit)", [(t.start, t.count, t.sixteen_bit) for t in tiers], flush=True)
    mx.random.seed(1)
    q = mx.random.normal((1, HEADS, 1, HEAD_DIM)).astype(dtype)
    scale = HEAD_DIM**-0.5
    pairs = [pure(t, mx.float32) for t in tiers]
    keys, values = (mx.concatenate([p[i] for p in pairs], axis=2) for i in (0, 1))
    want = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys, values, scale=scale)
    first_q = cache.offset - 1
    pieces = (
        ("route", lambda: cache.route(cache, q, scale, None, False)),
        ("partial over decoded()", lambda: merge_partials([la.partial(cache, tiers, q, scale, first_q)])),
        ("dense (decoded_run)", lambda: la.dense(cache, tiers, q, scale, first_q, [False] * len(tiers))),
    )
    for name, piece in pieces:
        try:
            compare(name, piece(), want)
        except Exception:
            traceback.print_exc()
    for tier in tiers:
        if tier.sixteen_bit:
            continue
        k, v = pure(tier, mx.float32)
        for side, ref in (("k", k), ("v", v)):
            compare(f"decoded_side {side}", tier.decoded_side(side, dtype), ref)
        try:
            kernel_pieces(cache, tier, tiers, q, scale, want)
        except Exception:
            traceback.print_exc()


def main():
    print("env", {k: v for k, v in os.environ.items() if k.startswith("VELOXQUANT")}, mx.default_device(), flush=True)
    for dtype in (mx.float16, mx.float32):
        for length, blocks in ((300, 1), (300, 3), (1000, 1)):
            check(dtype, length, blocks)
    check(mx.float16, 300, 1, recipe="kivi_sink")
    for dtype in (mx.float16, mx.float32):
        m = model(dtype)
        caches = veloxquant.make_prompt_cache(m, "kivi", [])
        prompt = mx.array([1 + (j * 7) % 400 for j in range(300)])
        steps = zip(generate_step(prompt, m, prompt_cache=caches, max_tokens=3), range(3))
        print("generate_step", dtype, "max logprob", [round(float(lp.max()), 3) for (_, lp), _ in steps], flush=True)


if __name__ == "__main__":
    main()
