"""age_tiered's bands re-code from the previous band's codes: what that costs against coding from fp16.

    python -m benchmarks.recode --tokens 1024

A token leaving the 8-bit band is decoded and re-coded at 4 bits, later at 2
(the cache keeps no fp16 copy to start from). This codes each layer's real
keys and values of SmolLM2 both ways with the recipe's quantizers (KIVI's: keys
per channel, values per token, group 32) and prints the relative squared error
||X - X̂||² / ||X||² pooled over layers, and how much the chain adds.
"""

import argparse

import mlx.core as mx

from veloxquant.data import load_text
from veloxquant.models import load_model
from veloxquant.stages.store import Affine


def layer_kv(model, tokens):
    from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

    caches = mlx_prompt_cache(model)
    for s in range(0, tokens.shape[1], 512):
        model(tokens[:, s : s + 512], cache=caches)
        mx.eval([c.state for c in caches])
    L = tokens.shape[1]
    return [(c.keys[:, :, :L].astype(mx.float32), c.values[:, :, :L].astype(mx.float32)) for c in caches]


def code(x, chain, axis):
    for bits in chain:
        q = Affine(bits=bits, group=32, axis=axis)
        x = q.decode(q.encode(x), mx.float32)
    return x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.recode", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (default), gemma3, or an mlx-lm model folder")
    p.add_argument("--tokens", type=int, default=1024, help="Austen tokens (a multiple of 32)")
    args = p.parse_args(argv)
    model, tokenizer = load_model(None if args.model == "smollm2" else args.model)
    tokens = mx.array(tokenizer.encode(load_text("austen"))[: args.tokens])[None]
    kv = layer_kv(model, tokens)
    print(f"model {args.model}: {len(kv)} layers, {tokens.shape[1]} tokens; relative error ||X-X̂||²/||X||²")
    print("| tensor | band | from fp16 | from the previous band's codes | added by the chain |")
    print("|---|---|---|---|---|")
    for side, axis, i in (("keys", "channel", 0), ("values", "token", 1)):
        den = sum(float(mx.sum(t[i] ** 2)) for t in kv)
        for direct, chain in (((4,), (8, 4)), ((2,), (8, 4, 2))):
            a = sum(float(mx.sum((code(t[i], direct, axis) - t[i]) ** 2)) for t in kv) / den
            b = sum(float(mx.sum((code(t[i], chain, axis) - t[i]) ** 2)) for t in kv) / den
            label = " -> ".join(str(c) for c in chain)
            print(f"| {side} | {label} | {a:.5f} | {b:.5f} | {100 * (b / a - 1):+.2f}% |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
