"""RaBitQ's bias-corrected estimator against raw Hamming scores, on a real model's keys and queries.

    python -m benchmarks.rabitq_estimators --tokens 1024 --layers 0,10,20,29

For the last --queries queries of a corpus prompt, per layer: the exact scores
q.k, and three 1-bit estimates from the signs of the rotated key x = R k:
  corrected  ||k|| <q, xbar> / <xbar, u>   (RaBitQ; what the `rabitq` stage stores)
  plain      ||k|| <q, xbar>               (no correction: shrunk by <xbar, u> ~ 0.8)
  hamming    ||q|| ||k|| (D - 2 popcount(sign q xor sign k)) / D   (binarized query)
Printed: least-squares slope of estimate on exact (1 = unbiased), correlation,
and the cosine of the attention output to the exact one (softmax with the
model's scale, values exact), averaged over kv heads.
"""

import argparse
import sys

import mlx.core as mx

from veloxquant.data.corpus import austen_text
from veloxquant.models import load_model
from veloxquant.models.default import default_model_path
from veloxquant.runtime.make import make_prompt_cache
from veloxquant.stages.rotation import Rotation


def capture_qkv(model, ids, layers):
    """Prefill `ids` through fp16 caches whose `layers` record the real queries they attend with:
    ({layer: (queries, keys, values) float32, scale}, caches). Shared by the key-error benches."""
    caches = make_prompt_cache(model, "fp16")
    seen = {}
    for i in layers:
        orig = caches[i].attend

        def attend(queries, scale, mask=None, sinks=None, observe=True, _i=i, _orig=orig):
            seen.setdefault(_i, []).append((queries, scale))
            return _orig(queries, scale, mask, sinks, observe)

        caches[i].attend = attend
    x = mx.array(ids)[None]
    for s in range(0, x.shape[1], 256):
        model(x[:, s : s + 256], cache=caches)
    out = {}
    for i in layers:
        q = mx.concatenate([a for a, _ in seen[i]], axis=2)
        k, v = caches[i].tiers[0].decoded(mx.float32)
        out[i] = (q.astype(mx.float32), k, v, seen[i][0][1])
    return out, caches


def _cos(a, b):
    return float(mx.mean(mx.sum(a * b, -1) / mx.sqrt(mx.sum(a * a, -1) * mx.sum(b * b, -1))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rabitq_estimators", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="mlx-lm model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--layers", default="0,10,20,29")
    args = ap.parse_args(argv)
    model, tok = load_model(args.model or default_model_path(), dtype=mx.float32)
    layers = [int(x) for x in args.layers.split(",")]
    data, _ = capture_qkv(model, tok.encode(austen_text())[: args.tokens], layers)
    rot = Rotation()
    print(f"{'layer':>5} {'estimator':>10} {'slope':>7} {'corr':>6} {'attn out cos':>12}")
    for i in layers:
        q, k, v, scale = data[i]
        B, Hq, L, D = q.shape
        H = k.shape[1]
        q = q[:, :, -args.queries :].reshape(B, H, Hq // H * args.queries, D)
        L = k.shape[2]
        qpos = mx.arange(L - args.queries, L)
        mask = mx.tile(mx.arange(L)[None] <= qpos[:, None], (Hq // H, 1))  # causal, per query row
        qr, xr = rot.forward(q), rot.forward(k)
        exact = q @ k.swapaxes(-1, -2)
        norm = mx.sqrt(mx.sum(k * k, -1))[..., None]  # [B, H, L, 1]
        signs = mx.where(xr > 0, 1.0, -1.0)
        plain = (qr @ signs.swapaxes(-1, -2)) * norm.swapaxes(-1, -2) / D**0.5  # ||k|| <q, xbar>
        ip = mx.sum(mx.abs(xr), -1, keepdims=True) / (D**0.5 * norm)  # <xbar, u>, [B, H, L, 1]
        corrected = plain / ip.swapaxes(-1, -2)
        qsign = mx.where(qr > 0, 1.0, -1.0)
        qnorm = mx.sqrt(mx.sum(q * q, -1))[..., None]
        hamming = qnorm * norm.swapaxes(-1, -2) * (qsign @ signs.swapaxes(-1, -2)) / D
        ref = mx.softmax(mx.where(mask, exact * scale, -mx.inf), axis=-1) @ v
        for name, est in (("corrected", corrected), ("plain", plain), ("hamming", hamming)):
            e, t = est.reshape(-1), exact.reshape(-1)
            slope = float(mx.sum(e * t) / mx.sum(t * t))
            em, tm = e - mx.mean(e), t - mx.mean(t)
            corr = float(mx.sum(em * tm) / mx.sqrt(mx.sum(em * em) * mx.sum(tm * tm)))
            out = mx.softmax(mx.where(mask, est * scale, -mx.inf), axis=-1) @ v
            print(f"{i:>5} {name:>10} {slope:>7.3f} {corr:>6.3f} {_cos(out, ref):>12.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
