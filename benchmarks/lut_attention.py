"""Decode attention per call from Lloyd-Max codes (turboquant_rvq's tier): LUT kernel vs MLX ops vs fp16 SDPA.

    python -m benchmarks.lut_attention --shapes 32/8/128,9/3/64,4/1/256 --seq 32k --rounds 5

Rows: `sdpa` = fp16 SDPA over the same keys/values decoded to float16 (what an
fp16 cache reads); `ops` = runtime.code_attention's MLX-ops path (the
reference: look-up tables built as arrays); `lut` = kernels/lut.py (two
launches). One query, B = 1; calls per evaluation and K/V copies cycled as
`bench attention` (so consecutive calls do not hit L2); medians of `--rounds`
interleaved rounds. Bytes read: what each path's inputs hold.
"""

import argparse
from typing import Dict, List, Optional

import mlx.core as mx

from veloxquant.bench.attention import HBM_GBPS, SEQ
from veloxquant.bench.timing import array_bytes, cycled, median_run, timeit
from veloxquant.compiler import compile_recipe
from veloxquant.compiler.shape import ModelShape
from veloxquant.kernels import lut
from veloxquant.recipe import load_recipe
from veloxquant.runtime.code_attention import codes_partial_attention
from veloxquant.runtime.kinds.tier import Tier


def build(Hq: int, Hkv: int, D: int, S: int, sets, copy: int):
    shape = ModelShape.uniform("bench", 1, Hkv, D)
    tier = Tier(compile_recipe(load_recipe("turboquant_rvq"), shape, sets).layers[0].tiers[-1])
    key = mx.random.key(S + D + copy)
    q = mx.random.normal((1, Hq, 1, D), key=key).astype(mx.float16)
    for start in range(0, S, 8192):  # encode in blocks: the encode's float32 temporaries stay small
        n = min(8192, S - start)
        seed = 3 * (S + D + copy) + start
        tier.append(
            mx.random.normal((1, Hkv, n, D), key=mx.random.key(seed + 1)).astype(mx.float16),
            mx.random.normal((1, Hkv, n, D), key=mx.random.key(seed + 2)).astype(mx.float16),
            start,
        )
        mx.eval([a for side in ("k", "v") for a in tier.encoded(side).values()])
    ke, ve, kc, vc = tier.encoded("k"), tier.encoded("v"), tier.codecs["k"], tier.codecs["v"]
    k16, v16 = tier.decoded(mx.float16)
    mx.eval(ke, ve, k16, v16)
    scale = D**-0.5
    if lut.unsupported(q, ke, ve, kc, vc):
        raise SystemExit(f"the LUT kernel does not take this call: {lut.unsupported(q, ke, ve, kc, vc)}")
    return {
        "sdpa": (lambda: mx.fast.scaled_dot_product_attention(q, k16, v16, scale=scale), array_bytes(k16, v16)),
        "ops": (lambda: codes_partial_attention(q, ke, ve, kc, vc, scale), array_bytes(*ke.values(), *ve.values())),
        "lut": (lambda: lut.partial_attention(q, ke, ve, kc, vc, scale), array_bytes(*ke.values(), *ve.values())),
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lut_attention", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="32/8/128,9/3/64,4/1/256", help="Hq/Hkv/D,...")
    p.add_argument("--seq", default="32k", help="sequence lengths (4k,32k,128k or token counts)")
    p.add_argument("--bits", default="2", help="bits of each of turboquant_rvq's two stages, e.g. 1,2")
    p.add_argument("--methods", default="sdpa,ops,lut")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--per-eval", type=int, default=32)
    p.add_argument("--copies", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    wanted = a.methods.split(",")
    print(
        f"device: {mx.default_device()}  mlx {mx.__version__}; turboquant_rvq codes, B=1, one query; "
        f"{a.per_eval} calls per evaluation, {a.copies} copies cycled, median of {a.rounds} interleaved rounds\n"
    )
    print(
        "| Hq/Hkv/D | S | bits | " + " | ".join(f"{n} µs · GB/s" for n in wanted) + " | lut vs sdpa | lut vs ops "
        "| lut % HBM |"
    )
    print("|" + "---|" * (len(wanted) + 6))
    for shape in a.shapes.split(","):
        Hq, Hkv, D = (int(x) for x in shape.split("/"))
        for s in a.seq.split(","):
            S = SEQ.get(s) or int(s)
            for bits in a.bits.split(","):
                methods = cycled([build(Hq, Hkv, D, S, [f"bits={bits}"], i) for i in range(a.copies)])
                runs: Dict[str, List[Dict]] = {}
                for _ in range(a.rounds):
                    for name in wanted:
                        fn, nbytes = methods[name]
                        us = timeit(fn, a.warmup, a.iters, min(a.per_eval, 4) if name == "ops" else a.per_eval)
                        runs.setdefault(name, []).append({"us": us, "gbps": nbytes / us / 1e3})
                res = {n: median_run(r) for n, r in runs.items()}
                ratio = lambda o: f"{res[o]['us'] / res['lut']['us']:.1f}×" if "lut" in res and o in res else "-"
                hbm = f"{100 * res['lut']['gbps'] / HBM_GBPS:.0f}%" if "lut" in res else "-"
                print(
                    f"| {shape} | {S // 1024}k | {bits}+{bits} | "
                    + " | ".join(f"{res[n]['us']:.1f} · {res[n]['gbps']:.0f}" for n in wanted)
                    + f" | {ratio('sdpa')} | {ratio('ops')} | {hbm} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
