"""Where vecinfer's perplexity goes: its keys or values, its calibration, its sinks, or its bit width.

    python -m benchmarks.vecinfer_loss --json results/vecinfer-loss-smollm2-cpu.json

On the leaderboard's `cpu` window (the corpus's first --prefix + --score + 1 tokens, prefilled in
chunks of 256, scored in chunks of 32: the row `veloxquant leaderboard --protocol cpu` measures),
the perplexity of fp16, of the built-in vecinfer (its calibration artifact, as the leaderboard
runs it) and of variants whose `pvq` codebooks are fitted here on the same calibration text
(4096 tokens of Emma, as `veloxquant calibrate vecinfer` does; `refit` reproduces the artifact):
only the values coded, only the keys coded, no smoothing (lambda = 1), fp16 sinks, 2 bits per
key element (4-dim pieces), and codebooks fitted on the window's own keys (an in-sample bound:
no codebook fitted elsewhere does better at that width). Then, on the window's prefix, per
--layers: the keys' relative error under the artifact's codes, and the attention mass the
window's last queries put on position 0 (the attention sink) with fp16 and with coded keys.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import veloxquant
from veloxquant import artifacts as artifact
from veloxquant.calibration.collect import collect
from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.compiler.binding import calibrated_stages, with_artifact
from veloxquant.data.corpus import load_text
from veloxquant.eval.cost import fp16_bytes
from veloxquant.eval.ppl import window_nll
from veloxquant.models import load_model
from veloxquant.recipe import load_recipe
from veloxquant.runtime import hook
from veloxquant.runtime.make import plan_for, prompt_caches
from veloxquant.stages.productvq import ProductVQ, kmeans
from veloxquant.stages.transform import Hadamard

VALUES = "rotation | lloydmax(bits=4)"
# name: (pipeline, piece, smoothing, fitted on) ; None = no calibrated stage
VARIANTS = {
    "values only": (f"keys: fp16\n  values: {VALUES}", None, None, None),
    "keys only": ("keys: pvq(piece=8)\n  values: fp16", 8, True, "calibration"),
    "refit": (f"keys: pvq(piece=8)\n  values: {VALUES}", 8, True, "calibration"),
    "no smoothing": (f"keys: pvq(piece=8)\n  values: {VALUES}", 8, False, "calibration"),
    "fp16 sinks(4)": (f"sink(4) >> keys: pvq(piece=8)\n     values: {VALUES}", 8, True, "calibration"),
    "2 bits (piece=4)": (f"keys: pvq(piece=4)\n  values: {VALUES}", 4, True, "calibration"),
    "in-sample": (f"keys: pvq(piece=8)\n  values: {VALUES}", 8, True, "window"),
}


def fit(samples: np.ndarray, piece: int, smooth: bool) -> dict:
    """pvq's arrays for one layer's keys [H, N, D]; without smoothing, lambda = 1 (Hadamard only)."""
    if smooth:
        found = ProductVQ(piece=piece).fit(samples)
    else:
        H, _, D = samples.shape
        y = np.array(Hadamard().forward(mx.array(samples)))
        books = [kmeans(y[h].reshape(-1, piece).astype(np.float64), 256, seed=h) for h in range(H)]
        found = {"smooth": np.ones((H, D), np.float32), "codebook": np.stack(books).astype(np.float32)}
    return {name: mx.array(a) for name, a in found.items()}


def bound_plan(model, name: str, pipeline: str, folder: Path, arrays_for) -> object:
    """The variant's plan, its pvq stages reading arrays held in this process (no artifact file)."""
    path = folder / f"variant{len(list(folder.iterdir()))}.yaml"
    path.write_text(f"veloxquant: 1\nname: variant\npipeline: |\n  {pipeline}\n")
    plan = compile_recipe(load_recipe(str(path)), ModelShape.from_model(model))
    digest = f"bench-{name}"
    plan = with_artifact(plan, digest)
    for i, t, side, _ in calibrated_stages(plan):
        artifact.hold_slot(digest, f"{i}.{t}.{side}", arrays_for(i))
    return plan


def ppl_of(model, plan, window, prefix) -> tuple:
    def fresh():
        caches = prompt_caches(model, plan)
        hook.install(model, hidden_states=False)
        return caches

    got = window_nll(model, fresh, window, prefix, 256, 32)
    veloxquant.uninstall(model)
    return float(np.exp(got["nll"] / got["tokens"])), got["cache_bytes"] / fp16_bytes(plan.shape, got["context"])


def sink_report(model, plan, window, prefix, layers) -> list:
    """Per layer: key relative error under the plan's codes, and position 0's attention mass."""
    seen = collect(model, window[:prefix], set(layers), progress=False)
    veloxquant.uninstall(model)
    out = []
    for i in layers:
        k, q = mx.array(seen[i]["k"])[None], mx.array(seen[i]["q"])[None]  # q: every 4th position
        store = plan.layers[i].tiers[0].keys.store
        coded = store.decode(store.encode(k), mx.float32)
        err = float(mx.linalg.norm(coded - k) / mx.linalg.norm(k))
        H, Hq, D = k.shape[1], q.shape[1], k.shape[-1]
        qpos = mx.arange(q.shape[2]) * artifact.QUERY_STRIDE
        last = q[:, :, -16:]  # the last 16 recorded queries (positions prefix - 64 ..)
        visible = mx.arange(k.shape[2])[None] <= qpos[-16:, None]
        group = last.reshape(1, H, Hq // H * 16, D)
        mask = mx.tile(visible, (Hq // H, 1))

        def mass(keys):
            s = mx.where(mask, group @ keys.swapaxes(-1, -2) * D**-0.5, -mx.inf)
            return float(mx.mean(mx.softmax(s, axis=-1)[..., 0]))

        sink_err = float(
            mx.mean(mx.linalg.norm(coded[..., 0, :] - k[..., 0, :], axis=-1) / mx.linalg.norm(k[..., 0, :], axis=-1))
        )
        out.append(
            {
                "layer": i,
                "key_rel_err": err,
                "sink_key_rel_err": sink_err,
                "sink_mass_fp16": mass(k),
                "sink_mass_coded": mass(coded),
            }
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="vecinfer_loss", description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=640)
    ap.add_argument("--score", type=int, default=128)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    ap.add_argument("--layers", default="2,5,20", help="layers of the key-error and sink report ('' for none)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    model, tok = load_model()
    window = tok.encode(load_text("austen", progress=False))[: args.prefix + args.score + 1]
    rows = []

    def row(name, ppl, held, seconds=0.0):
        rows.append({"row": name, "ppl": ppl, "delta_ppl_pct": 100 * (ppl / rows[0]["ppl"] - 1) if rows else 0.0})
        rows[-1].update(held_ratio=held, fit_s=round(seconds, 1))
        print(f"{name:18s} PPL {ppl:8.2f}  ΔPPL {rows[-1]['delta_ppl_pct']:+8.2f}%  held {held:.3f}", flush=True)

    row("fp16", *ppl_of(model, plan_for(model, "fp16"), window, args.prefix))
    builtin = plan_for(model, "vecinfer")  # bound to its artifact: `veloxquant calibrate vecinfer` first
    row("vecinfer", *ppl_of(model, builtin, window, args.prefix))
    wanted = [v for v in args.variants.split(",") if v]
    texts = {
        "calibration": tok.encode(load_text("austen:emma", progress=False))[:4096],
        "window": window[: args.prefix],
    }
    samples, fits = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in wanted:
            pipeline, piece, smooth, source = VARIANTS[name]
            start = time.perf_counter()
            if source is not None and source not in samples:  # every layer's keys over that text, once
                samples[source] = collect(model, texts[source], set(range(len(builtin.layers))), progress=False)
                veloxquant.uninstall(model)

            def arrays_for(i, how=(source, piece, smooth)):
                if (how, i) not in fits:  # variants that differ only in their pipeline share the fit
                    fits[(how, i)] = fit(samples[how[0]][i]["k"], how[1], how[2])
                return fits[(how, i)]

            plan = bound_plan(model, name, pipeline, Path(tmp), arrays_for)
            row(name, *ppl_of(model, plan, window, args.prefix), time.perf_counter() - start)
    layers = [int(x) for x in args.layers.split(",") if x]
    report = sink_report(model, builtin, window, args.prefix, layers) if layers else []
    for r in report:
        print(
            f"layer {r['layer']:2d}: keys rel err {r['key_rel_err']:.3f} (position 0: {r['sink_key_rel_err']:.2f}); "
            f"attention mass on position 0: fp16 {r['sink_mass_fp16']:.3f}, coded keys {r['sink_mass_coded']:.3f}"
        )
    if args.json:
        command = "python -m benchmarks.vecinfer_loss " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.json).write_text(json.dumps({"command": command.strip(), "rows": rows, "layers": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
