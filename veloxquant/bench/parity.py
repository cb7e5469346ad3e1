"""Logit parity of a recipe against mlx-lm's plain KVCache on a real model.

    veloxquant bench parity --recipe fp16 --tokens 1024 --chunk 256 --dtype float16

Feeds the same prompt (Austen by default) through both caches in chunks, as
generation prefills, and prints the max abs difference of the logits.
"""

import argparse
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

from ..data import load_text
from ..models import load_model
from ..runtime import make_prompt_cache, uninstall
from .registry import bench


def chunked_logits(model, tokens: mx.array, cache, chunk: int) -> mx.array:
    outs = []
    for s in range(0, tokens.shape[1], chunk):
        out = model(tokens[:, s : s + chunk], cache=cache)
        mx.eval(out)
        outs.append(out)
    return mx.concatenate(outs, axis=1)


@bench("parity", "logit parity of a recipe against mlx-lm's plain KVCache on a real model")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="veloxquant bench parity", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="fp16")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--model")
    ap.add_argument("--corpus", default="austen")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--dtype", default=None, help="float16 / bfloat16 / float32 (default: float32 on CPU)")
    args = ap.parse_args(argv)
    model, tokenizer = load_model(args.model, dtype=getattr(mx, args.dtype) if args.dtype else None)
    tokens = mx.array(tokenizer.encode(load_text(args.corpus))[: args.tokens])[None]
    t0 = time.perf_counter()
    ref = chunked_logits(model, tokens, mlx_prompt_cache(model), args.chunk)
    t1 = time.perf_counter()
    caches = make_prompt_cache(model, args.recipe, args.sets)
    got = chunked_logits(model, tokens, caches, args.chunk)
    t2 = time.perf_counter()
    uninstall(model)
    diff = float(mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max())
    dtype = str(next(iter(p.dtype for _, p in __import__("mlx.utils").utils.tree_flatten(model.parameters()))))
    print(
        "| recipe | model dtype | tokens | chunk | max abs logit diff vs mlx-lm KVCache | attention "
        "| s (mlx-lm / ours) |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.recipe} | {dtype} | {tokens.shape[1]} | {args.chunk} | {diff:.3g} | "
        f"{'hook' if caches[0].attended else 'decoded'} | {t1 - t0:.1f} / {t2 - t1:.1f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
