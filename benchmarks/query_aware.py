"""A2ATS's query-aware VQ and windowed RoPE, judged by attention output error on real queries.

    python -m benchmarks.query_aware --layers 5,20

Per layer: the `qavq` stage is fitted on that layer alone (keys and real
queries of --cal-tokens tokens of Emma, as `veloxquant calibrate` would, so no
artifact is needed), for each beta; the keys of a held-out Austen prompt are
coded and its last --queries queries scored from the codes, with exact RoPE
(window past the prompt) and with the windowed approximation. Reported: the
keys' relative squared error, the RMS error of the scaled scores, and the
relative error of the attention output (values exact).
"""

import argparse
import sys

import attrs
import mlx.core as mx

from benchmarks.rabitq_estimators import capture_qkv
from veloxquant import artifacts as artifact
from veloxquant.calibration.collect import collect
from veloxquant.compiler import ModelShape
from veloxquant.data.corpus import austen_text, load_text
from veloxquant.models import load_model
from veloxquant.models.default import default_model_path
from veloxquant.stages.qavq import QueryAwareVQ
from veloxquant.stages.unrope import rotate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="query_aware", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="5,20")
    ap.add_argument("--betas", default="1.0,0.5,0.0")
    ap.add_argument("--windows", default="1000000,128", help="RoPE windows (>= the prompt: exact)")
    ap.add_argument("--cal-tokens", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=64)
    args = ap.parse_args(argv)
    import numpy as np

    layers = [int(x) for x in args.layers.split(",")]
    model, tok = load_model(default_model_path(), dtype=mx.float32)
    shape = ModelShape.from_model(model)
    cal = collect(model, tok.encode(load_text("austen:emma", progress=False))[: args.cal_tokens], set(layers), False)
    test, _ = capture_qkv(model, tok.encode(austen_text())[: args.tokens], layers)
    for i in layers:
        spec = shape.ropes[i]
        pre = np.array(rotate(mx.array(cal[i]["k"])[None], spec, 0, inverse=True)[0])
        q, k, v, scale = test[i]
        B, Hq, N, D = q.shape
        H, NQ = k.shape[1], args.queries
        qq = q[:, :, -NQ:].reshape(B, H, Hq // H * NQ, D) * scale
        qpos = mx.tile(mx.arange(N - NQ, N), Hq // H)
        mask = mx.arange(N)[None] <= qpos[:, None]
        exact = qq @ k.swapaxes(-1, -2)
        ref = mx.softmax(mx.where(mask, exact, -mx.inf), -1) @ v
        kpre = rotate(k, spec, 0, inverse=True)
        for beta in (float(b) for b in args.betas.split(",")):
            stage = attrs.evolve(QueryAwareVQ(beta=beta), _rope=spec)
            fitted = {name: mx.array(a) for name, a in stage.fit(pre, cal[i]["q"]).items()}
            artifact.hold_slot("bench", f"{i}.{beta}", fitted)  # the stage reads its arrays from here
            stage = attrs.evolve(stage, artifact="bench", slot=f"{i}.{beta}")
            enc = stage.encode(kpre)
            mse = float(mx.sum((stage.decode(enc, mx.float32) - kpre) ** 2) / mx.sum(kpre * kpre))
            for window in (int(w) for w in args.windows.split(",")):
                est = attrs.evolve(stage, window=window).scores_at(qq, enc, spec, 0, qpos)
                err = float(mx.sqrt(mx.sum(mx.where(mask, est - exact, 0) ** 2) / mx.sum(mask) / B / H))
                out = mx.softmax(mx.where(mask, est, -mx.inf), -1) @ v
                rel = float(mx.mean(mx.sqrt(mx.sum((out - ref) ** 2, -1) / mx.sum(ref * ref, -1))))
                print(
                    f"layer {i:2d}  beta {beta:.2f}  window {window:>7d}: key rel sq err {mse:.4f}  "
                    f"score err {err:.3f}  output rel err {rel:.4f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
