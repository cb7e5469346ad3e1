"""Peak memory by phase, and what each run leaves allocated for the next, on a random model.

    python -m benchmarks.run_peaks --recipes fp16,kivi,fp16 --runs 2      # 32k, 8 layers 32/8/128

Each run makes a cache (mlx-lm's KVCache for `kvcache`), prefills `--context`
random tokens through mlx-lm's generate_step, then decodes `--decode` tokens;
`mx.reset_peak_memory` between the phases. Printed per run: the memory still
allocated when it starts (what earlier runs left behind: a dropped cache must be
freed at once, not at Python's next cyclic collection), the prefill and decode
peaks, and the bytes the cache holds (GiB, weights included).
"""

import argparse

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

from veloxquant.bench.e2e import random_llama
from veloxquant.runtime import make_prompt_cache, uninstall

GiB = 2**30


def one_run(model, prompt: mx.array, recipe: str, decode: int) -> str:
    mx.synchronize()
    before = mx.get_active_memory()
    cache = mlx_prompt_cache(model) if recipe == "kvcache" else make_prompt_cache(model, recipe)
    mx.clear_cache()
    mx.reset_peak_memory()
    steps = generate_step(prompt, model, max_tokens=decode + 1, prompt_cache=cache)
    next(steps)
    mx.synchronize()
    prefill_peak = mx.get_peak_memory()
    mx.reset_peak_memory()
    for _ in steps:
        pass
    mx.synchronize()
    held = sum(c.nbytes for c in cache)
    uninstall(model)
    return (
        f"| {recipe} | {before / GiB:.2f} | {prefill_peak / GiB:.2f} | {mx.get_peak_memory() / GiB:.2f} "
        f"| {held / GiB:.3f} |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run_peaks", description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="kvcache,fp16,kivi", help="run in this order; 'kvcache' = mlx-lm's")
    ap.add_argument("--runs", type=int, default=2, help="consecutive runs of each recipe")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", default="32/8", help="query heads / kv heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args(argv)
    heads, kv_heads = map(int, args.heads.split("/"))
    mx.random.seed(0)
    model = random_llama(args.layers, heads, kv_heads, args.head_dim, args.vocab, getattr(mx, args.dtype))
    prompt = mx.random.randint(0, args.vocab, (args.context,))
    mx.eval(prompt)
    print(
        f"random Llama: {args.layers} layers, {heads}/{kv_heads} heads, D={args.head_dim}, {args.dtype}, "
        f"context {args.context}, decode {args.decode}, device {mx.default_device()}; weights and prompt "
        f"{mx.get_active_memory() / GiB:.2f} GiB"
    )
    print("| run | allocated at its start GiB | prefill peak GiB | decode peak GiB | cache GiB |")
    print("|---|---|---|---|---|")
    for recipe in args.recipes.split(","):
        for _ in range(args.runs):
            print(one_run(model, prompt, recipe, args.decode), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
