"""How much key quantization error falls when keys are coded before RoPE (KVQuant's claim).

    python -m benchmarks.prerope --model smollm2 --tokens 2048 --bits 2,3,4

The model prefills Austen tokens into mlx-lm's own cache; each layer's keys
are then coded by a quantizer with and without `unrope` in front (the same
codec otherwise, decoded and re-roped), and the relative squared error
||K - K̂||² / ||K||², pooled over layers, is printed per quantizer and width.
RoPE is a rotation, so the error is the same measured before or after it.
"""

import argparse

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

from veloxquant.compiler import CodecPlan, ModelShape
from veloxquant.data import load_text
from veloxquant.models import load_model
from veloxquant.runtime.codec import Codec
from veloxquant.stages.nuq import Nuq
from veloxquant.stages.store import Affine
from veloxquant.stages.unrope import Unrope

QUANTIZERS = {
    "affine per channel, group 32 tokens (KIVI keys)": lambda b: Affine(bits=b, group=32, axis="channel"),
    "affine per channel, group 128 tokens": lambda b: Affine(bits=b, group=128, axis="channel"),
    "affine per token, group 32 channels": lambda b: Affine(bits=b, group=32, axis="token"),
    "nuq per channel (Lloyd-Max, fitted on the block)": lambda b: Nuq(bits=b),
}


def layer_keys(model, tokens):
    """{layer: keys [1, H, L, D]} of the layers whose cache holds every position in order
    (Gemma 3's sliding-window layers keep a ring buffer of 512: left out)."""
    from mlx_lm.models.cache import RotatingKVCache

    caches = mlx_prompt_cache(model)
    for s in range(0, tokens.shape[1], 512):
        model(tokens[:, s : s + 512], cache=caches)
        mx.eval([c.state for c in caches])
    L = tokens.shape[1]
    return {i: c.keys[:, :, :L].astype(mx.float32) for i, c in enumerate(caches) if not isinstance(c, RotatingKVCache)}


def errors(keys, ropes, store):
    """(post-RoPE, pre-RoPE) relative squared error over all layers."""
    num = {"post": 0.0, "pre": 0.0}
    den = 0.0
    for i, k in keys.items():
        rope = ropes[i]
        for name, transforms in (("post", ()), ("pre", (Unrope(_rope=rope),))):
            codec = Codec(CodecPlan(transforms, store))
            got = codec.decode(codec.encode(k, 0), mx.float32, 0)
            num[name] += float(mx.sum((got - k) ** 2))
        den += float(mx.sum(k * k))
    return num["post"] / den, num["pre"] / den


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.prerope", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (default), gemma3, or an mlx-lm model folder")
    p.add_argument("--tokens", type=int, default=2048, help="Austen tokens prefilled (a multiple of 128)")
    p.add_argument("--bits", default="2,3,4")
    args = p.parse_args(argv)
    model, tokenizer = load_model(None if args.model == "smollm2" else args.model)
    tokens = mx.array(tokenizer.encode(load_text("austen"))[: args.tokens])[None]
    shape = ModelShape.from_model(model)
    if any(isinstance(r, str) for r in shape.ropes):
        why = next(r for r in shape.ropes if isinstance(r, str))
        raise SystemExit(f"unrope cannot invert this model's RoPE: {why}")
    keys = layer_keys(model, tokens)
    print(
        f"model {args.model}: {len(keys)} of {len(shape.ropes)} layers (full attention), {tokens.shape[1]} tokens; "
        "relative key error ||K-K̂||²/||K||²"
    )
    print("| quantizer | bits | post-RoPE | pre-RoPE (unrope) | change |")
    print("|---|---|---|---|---|")
    for label, make in QUANTIZERS.items():
        for b in (int(x) for x in args.bits.split(",")):
            post, pre = errors(keys, shape.ropes, make(b))
            print(f"| {label} | {b} | {post:.5f} | {pre:.5f} | {100 * (pre / post - 1):+.1f}% |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
