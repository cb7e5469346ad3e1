"""Score error of key codecs on a real model's keys and queries, against the sketch theory.

    python -m benchmarks.key_score_error --model gemma3 --tokens 1024

For the last --queries queries of a corpus prompt, per layer: the key norm, the
norm of the keys' mean (the offset every token shares), the scaled query norm,
then for each key pipeline the RMS error of its scaled scores (from codes, as
attention computes them) and the relative error of the attention output
(values exact). A 1-bit sketch's score error grows with ||q|| ||k|| (QJL:
sqrt(pi/2m) ||q|| ||k||), so with the shared offset; `groupmean(64) | residual(...)`
codes what is left of each 64-token group's mean.

--recipes 'vecinfer;a2ats:beta=1.0;commvq:bits=1' measures built-in recipes' key
codecs instead (their coded, last tier; calibrated ones bound to their artifact,
so calibrate them first with the same --set values): keys encoded at their real
positions, and pre-RoPE stores (commvq, a2ats) scored with each query's position.
Codecs that cannot score their codes are measured decode-then-dot.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from benchmarks.rabitq_estimators import capture_qkv
from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.data.corpus import austen_text
from veloxquant.models import load_model
from veloxquant.models.default import default_model_path, gemma3_model_path
from veloxquant.recipe import load_recipe
from veloxquant.runtime.codec import Codec
from veloxquant.runtime.make import plan_for

PIPELINES = (
    "rotation | lloydmax(bits=3);rotation | groupmean(64) | residual(lloydmax(bits=3));"
    "qjl(factor=2.0);groupmean(64) | residual(qjl(factor=2.0));rotation | rabitq;"
    "rotation | groupmean(64) | residual(rabitq);rotation | lloydmax(bits=2) | residual(qjl(factor=1.0));"
    "rotation | groupmean(64) | residual(lloydmax(bits=2)) | residual(qjl(factor=1.0))"
)


def _capture(model, ids, layers, group):
    """(queries, keys, values, scale, window, first position) per layer; keys cut to whole groups."""
    data, caches = capture_qkv(model, ids, layers)
    out = {}
    for i, (q, k, v, scale) in data.items():
        cut = k.shape[2] % group
        out[i] = (q, k[:, :, cut:], v[:, :, cut:], scale, caches[i].plan.window, caches[i].tiers[0].start + cut)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="key_score_error", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="mlx-lm model folder or 'gemma3' (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--layers", help="comma-separated (default: six spread over the model)")
    ap.add_argument("--pipelines", default=PIPELINES, help="key pipelines separated by ';'")
    ap.add_argument(
        "--sinks",
        type=int,
        default=0,
        help="the first N positions scored exactly, as a recipe's fp16 sink tier holds them",
    )
    ap.add_argument("--recipes", help="built-in recipes (name[:k=v,k=v]) separated by ';', instead of --pipelines")
    args = ap.parse_args(argv)
    path = gemma3_model_path() if args.model == "gemma3" else (args.model or default_model_path())
    model, tok = load_model(path, dtype=mx.float32)
    shape = ModelShape.from_model(model)
    n = shape.n_layers
    layers = (
        [int(x) for x in args.layers.split(",")] if args.layers else sorted({0, 1, n // 4, n // 2, 3 * n // 4, n - 1})
    )
    data = _capture(model, tok.encode(austen_text())[: args.tokens], layers, 64)
    tmp = Path(tempfile.mkdtemp())
    N, NQ = args.tokens, args.queries
    for i in layers:
        q, k, v, scale, window, first = data[i]
        B, Hq, _, D = q.shape
        H, L = k.shape[1], k.shape[2]
        qq = q[:, :, -NQ:].reshape(B, H, Hq // H * NQ, D) * scale
        qpos, kpos = mx.arange(N - NQ, N), mx.arange(first, first + L)
        mask = kpos[None] <= qpos[:, None]
        if window:
            mask = mask & (kpos[None] > qpos[:, None] - window)
        mask = mx.tile(mask, (Hq // H, 1))
        exact = qq @ k.swapaxes(-1, -2)
        ref = mx.softmax(mx.where(mask, exact, -mx.inf), -1) @ v
        norm = lambda a: float(mx.mean(mx.sqrt(mx.sum(a * a, -1))))
        print(
            f"layer {i} (window {window}, {L} keys, head_dim {D}): |k| {norm(k):.1f}  "
            f"|mean k| {norm(mx.mean(k, axis=2, keepdims=True)):.1f}  |q|*scale {norm(qq):.2f}"
        )
        for p in (args.recipes or args.pipelines).split(";"):
            if args.recipes:
                est = _recipe_scores(model, p, i, qq, k, first, qpos, Hq // H)
            else:
                (tmp / "r.yaml").write_text(
                    f"veloxquant: 1\nname: r\npipeline: |\n  recent(64) >> keys: {p}\n    values: fp16\n"
                )
                codec = Codec(compile_recipe(load_recipe(str(tmp / "r.yaml")), shape).layers[i].tiers[-1].keys)
                enc = codec.encode(k)
                est = (
                    codec.scores(qq, enc)
                    if codec.scores_from_codes
                    else qq @ codec.decode(enc, mx.float32).swapaxes(-1, -2)
                )
            if args.sinks and first < args.sinks:  # a sink tier holds them in fp16: exact scores
                est = mx.where(kpos[None] < args.sinks, exact, est)
            err = float(mx.sqrt(mx.sum(mx.where(mask, est - exact, 0) ** 2) / mx.sum(mask) / B / H))
            out = mx.softmax(mx.where(mask, est, -mx.inf), -1) @ v
            rel = float(mx.mean(mx.sqrt(mx.sum((out - ref) ** 2, -1) / mx.sum(ref * ref, -1))))
            print(f"    {p:78s} score err {err:6.3f}  output rel err {rel:.4f}")
    return 0


def _recipe_scores(model, ref: str, layer: int, qq, k, first: int, qpos, rep: int):
    """Scaled scores of the queries qq against k as recipe `ref`'s coded tier holds them."""
    name, _, sets = ref.partition(":")
    codec = Codec(plan_for(model, name, [s for s in sets.split(",") if s]).layers[layer].tiers[-1].keys)
    enc = codec.encode(k, first)
    if codec.scores_from_codes and codec.positional:
        return codec.scores(qq, enc, first, mx.tile(qpos, rep))
    if codec.scores_from_codes:
        return codec.scores(qq, enc)
    return qq @ codec.decode(enc, mx.float32, first).swapaxes(-1, -2)


if __name__ == "__main__":
    sys.exit(main())
