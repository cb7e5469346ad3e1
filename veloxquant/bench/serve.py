"""Serving load: how many concurrent sequences a memory budget holds, and aggregate decode speed.

    veloxquant bench serve --recipes fp16,kivi --context 1024 --budget-mib 256 --concurrency 1,4,8,16

On a random-init Llama of the given shapes (no weights needed), for each recipe and each concurrency N:
N sequences of `context` random tokens each decode `decode` tokens through mlx-lm's BatchGenerator (as
mlx_lm.server runs them) where the recipe batches (compiler/batching.py), else one after the other, as
`veloxquant serve` then serves them. Figures are measured, never modelled:
- held: the bytes the N sequences' caches hold at the end (each sequence's own caches' nbytes, extracted
  from the batch as it finished), per sequence;
- fit in budget: budget // held per sequence (the cache alone; the weights are the same for every row);
- decode tok/s: mlx-lm's aggregate generation tokens/s over all N sequences (serial: their total decode
  tokens over their total decode time);
- MLX peak: mx.get_peak_memory over the round (weights, caches and transients); process peak: the
  process's maximum resident set so far (ru_maxrss: it only grows, so it is the run's peak up to that row).
"""

import argparse
import resource
import sys
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step

from ..compiler.batching import refusal
from ..eval.rows import spec_caches, split_specs
from ..runtime import uninstall
from ..runtime.cache_list import recipe_caches
from .e2e import random_model
from .presets import add_preset_args, apply_preset, quantized
from .registry import bench


def _batched(model, prompts, caches, decode):
    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=min(8, len(prompts)))
    uids = gen.insert(prompts, [decode] * len(prompts), caches=caches)
    held = {}
    with gen.stats() as stats:
        while responses := gen.next_generated():
            for r in responses:
                if r.finish_reason is not None:
                    held[r.uid] = sum(c.nbytes for c in recipe_caches(r.prompt_cache))
    gen.close()
    return stats.generation_tps, [held[u] for u in uids]


def _serial(model, prompts, caches, decode):
    tokens, seconds, held = 0, 0.0, []
    for prompt, cache in zip(prompts, caches):
        steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=decode)
        next(steps)  # the prompt's prefill and first token
        mx.synchronize()
        t0 = time.perf_counter()
        tokens += sum(1 for _ in steps)
        mx.synchronize()
        seconds += time.perf_counter() - t0
        held.append(sum(c.nbytes for c in recipe_caches(cache)))
    return tokens / seconds if seconds else 0.0, held


def measure(model, recipe: str, n: int, context: int, decode: int, vocab: int):
    prompts = mx.random.randint(0, vocab, (n, context)).tolist()
    caches = [spec_caches(model, recipe) for _ in range(n)]
    batched = refusal(recipe_caches(caches[0])[0].plan_root) is None
    mx.synchronize()
    mx.reset_peak_memory()
    try:
        tps, held = (_batched if batched else _serial)(model, prompts, caches, decode)
    finally:
        uninstall(model)
    return {
        "batched": batched,
        "decode_tok_s": tps,
        "held_per_seq": sum(held) / n,
        "mlx_peak": mx.get_peak_memory(),
        "process_peak": _maxrss(),
    }


def _maxrss() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


@bench("serve", "concurrent sequences per memory budget and aggregate decode tok/s, batched through mlx-lm")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="veloxquant bench serve", description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default="fp16,kivi")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    ap.add_argument("--decode", type=int, default=16, help="tokens each sequence decodes")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--budget-mib", type=float, default=256.0, help="cache memory budget for the 'fit' column")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", default="8/2", help="query/kv heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--hidden", type=int, default=0, help="model width (default heads x head_dim)")
    ap.add_argument("--intermediate", type=int, default=0, help="MLP width (default 2 x hidden)")
    add_preset_args(ap)
    args = apply_preset(ap.parse_args(argv))
    heads, kv_heads = map(int, args.heads.split("/"))
    mx.random.seed(0)
    shape = (args.layers, heads, kv_heads, args.head_dim, args.vocab, getattr(mx, args.dtype), args.hidden)
    model, name = random_model("llama", shape + (args.intermediate,))
    model, name = quantized(model, args.weights_bits, name)
    budget = args.budget_mib * 2**20
    print(
        f"{name}: {args.layers} layers, {heads}/{kv_heads} heads, D={args.head_dim}, {args.dtype}; context "
        f"{args.context}, decode {args.decode} per sequence; budget {args.budget_mib:g} MiB; {mx.default_device()}"
    )
    print(
        "| recipe | N | served | decode tok/s (all N) | held KiB / seq | fit in budget | MLX peak MiB | "
        "process peak MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for recipe in split_specs(args.recipes):
        for n in map(int, args.concurrency.split(",")):
            r = measure(model, recipe, n, args.context, args.decode, args.vocab)
            print(
                f"| {recipe} | {n} | {'batched' if r['batched'] else 'one at a time'} | "
                f"{r['decode_tok_s']:.1f} | {r['held_per_seq'] / 1024:.0f} | {int(budget // r['held_per_seq'])} | "
                f"{r['mlx_peak'] / 2**20:.0f} | {r['process_peak'] / 2**20:.0f} |",
                flush=True,
            )
    return 0
