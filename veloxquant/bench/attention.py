"""`veloxquant bench attention`: one decode query against a long tier.

Times, per (head shape, sequence length, bits):
  sdpa       mx.fast.scaled_dot_product_attention on float16 K/V
  mlx-lm     mlx_lm.models.base.quantized_scaled_dot_product_attention on
             mx.quantize'd K/V (same bits and group)
  reference  veloxquant's MLX-ops reference over affine codes (KIVI layout:
             keys per-channel, values per-token)
  decode     the same codes decoded to float16, then SDPA (a tier no kernel takes: CPU, Metal)
  qmm        the same codes through MLX's own quantized matmul (kernels/mlx_affine.py, Metal's route)
  fused      veloxquant's CUDA kernel over the same codes (CUDA backend only;
             the default attend kernel, table.attend_route / VELOXQUANT_CUDA_IMPL)
  fused-v1, fused-mma, fused-tc   one attend kernel explicitly (A/B rows;
             not in the default list; tc = attend_tc, issue 18)
  fused-tc1, fused-tc2   attend_tc with its merge in the launch / in a reduce launch
and prints a markdown table: microseconds per call, effective GB/s over the
bytes each method must read (its K/V storage), the fused kernel's speedups,
and each method's peak transient memory.

Timing (timing.py): warmup calls, then `iters` calls each queued with mx.async_eval (so
host-side graph building overlaps the device) and one final synchronize.
Consecutive calls cycle through `--copies` independent copies of K/V (default
4) so that they read from HBM, not from the previous call's L2 lines.
"""

import argparse
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from veloxquant.kernels import cuda, mlx_affine, reference, tc, tc_launch
from veloxquant.kernels.dispatch import backend
from veloxquant.kernels.reference import spec_fields
from veloxquant.kernels.tc_launch import held_bytes
from veloxquant.stages.store import Affine

from .registry import bench
from .timing import array_bytes, cycled, median_run, memory_limit, peak_mib, timeit

HBM_GBPS = 4800.0  # H200 HBM3e peak, for the % column

SEQ = {"1k": 1024, "4k": 4096, "16k": 16384, "32k": 32768, "128k": 131072}
SHAPES = ["32/8/128", "9/3/64", "4/1/256"]


def build_methods(q, k, v, bits: int, group: int, scale: float, chunk: Optional[int]):
    """name -> (callable, bytes read) for one configuration."""
    kspec = {"bits": bits, "group": group, "axis": "channel"}
    vspec = {"bits": bits, "group": group, "axis": "token"}
    ke, ve = Affine(**kspec).encode(k), Affine(**vspec).encode(v)
    mx.eval(ke, ve)
    coded = array_bytes(*ke.values(), *ve.values())
    methods: Dict[str, Tuple[Callable, int]] = {
        "sdpa": (lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), array_bytes(k, v)),
    }
    try:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention as qsdpa

        qk = tuple(mx.quantize(k, group_size=group, bits=bits))
        qv = tuple(mx.quantize(v, group_size=group, bits=bits))
        mx.eval(qk, qv)
        methods["mlx-lm"] = (
            lambda: qsdpa(q, qk, qv, scale=scale, mask=None, group_size=group, bits=bits),
            array_bytes(*qk, *qv),
        )
    except Exception as e:  # noqa: BLE001 -- reported in the table
        methods["mlx-lm"] = (None, f"fails: {type(e).__name__}")
    methods["reference"] = (lambda: reference.affine_partial_attention(q, ke, ve, kspec, vspec, scale), coded)
    ks, vs = Affine(**kspec), Affine(**vspec)
    methods["decode"] = (
        lambda: mx.fast.scaled_dot_product_attention(q, ks.decode(ke, q.dtype), vs.decode(ve, q.dtype), scale=scale),
        coded,
    )
    run = mlx_affine.launch(tuple(q.shape), q.dtype, tuple(ke["codes"].shape), spec_fields(ks), spec_fields(vs), scale)
    methods["qmm"] = (lambda: run(q, ke, ve), coded)
    if backend() == "cuda":
        # "fused": the default attend kernel (table.attend_route, VELOXQUANT_CUDA_IMPL);
        # "fused-v1" / "fused-mma": one kernel explicitly, for A/B rows.
        methods["fused"] = (lambda: cuda.affine_partial_attention(q, ke, ve, kspec, vspec, scale, chunk=chunk), coded)
        methods["fused-v1"] = (
            lambda: cuda.affine_partial_attention(q, ke, ve, kspec, vspec, scale, chunk=chunk, impl="v1"),
            coded,
        )
        methods["fused-mma"] = (
            lambda: cuda.affine_partial_attention(q, ke, ve, kspec, vspec, scale, impl="mma"),
            coded,
        )
        methods["fused-tc"] = (lambda: cuda.affine_partial_attention(q, ke, ve, kspec, vspec, scale, impl="tc"), coded)
        shape = (tuple(q.shape), q.dtype, tuple(ke["codes"].shape), spec_fields(kspec), spec_fields(vspec), scale)
        for name, fold in (("fused-tc1", True), ("fused-tc2", False)):
            methods[name] = (
                (lambda run=tc_launch.launcher(*shape, fold=fold): run(q, ke, ve), coded)
                if not tc.supported(q.shape[1], q.shape[2], q.shape[3], *shape[2][1:3], *shape[3:5])
                else (None, "n/a (tc scope)")
            )
    else:
        for name in ("fused", "fused-v1", "fused-mma", "fused-tc", "fused-tc1", "fused-tc2"):
            methods[name] = (None, "n/a (no CUDA)")
    return methods


def run_one(name, fn, nbytes, a) -> Dict:
    if fn is None:
        return {"err": nbytes}
    try:
        per_eval = min(a.per_eval, 4) if name == "reference" else a.per_eval  # its float32 temporaries are large
        us = timeit(fn, a.warmup, a.iters, per_eval)
        r = {"us": us, "gbps": nbytes / us / 1e3, "mib": peak_mib(fn), "bytes": nbytes}
        if name in ("sdpa", "fused"):  # latency of a lone call (one evaluation each)
            r["us_single"] = timeit(fn, a.warmup, a.iters * 4, 1)
        return r
    except Exception as e:  # noqa: BLE001 -- e.g. an op the backend lacks
        return {"err": f"fails: {type(e).__name__}: {str(e).splitlines()[0][:60]}"}


def cell(r: Dict) -> str:
    return r["err"] if "err" in r else f"{r['us']:.1f} µs · {r['gbps']:.0f} GB/s"


@bench("attention", "one decode query against a long coded tier: fused kernel vs MLX ops vs fp16 SDPA (time, bytes)")
def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="veloxquant bench attention", description=__doc__.splitlines()[0])
    p.add_argument("--seq", default=",".join(SEQ), help="sequence lengths (1k,4k,16k,32k,128k)")
    p.add_argument("--max-seq", default=None, help="drop lengths above this one (e.g. 32k)")
    p.add_argument("--bits", default="2,4,8")
    p.add_argument("--shapes", default=",".join(SHAPES), help="Hq/Hkv/D,...")
    p.add_argument("--group", type=int, default=32)
    p.add_argument(
        "--methods",
        default="sdpa,mlx-lm,reference,fused",
        help="of sdpa, mlx-lm, reference, decode, qmm, fused, fused-v1, fused-mma, fused-tc, "
        "fused-tc1 / fused-tc2 (attend_tc in one launch / two)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="evaluations timed")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every method this many times, interleaved; report the median round",
    )
    p.add_argument("--per-eval", type=int, default=32, help="calls per evaluation (layers in a decode step)")
    p.add_argument("--chunk", type=int, default=None, help="fused kernel: tokens per block (default: auto)")
    p.add_argument(
        "--copies",
        type=int,
        default=4,
        help="independent K/V copies cycled through (>1 keeps the working set out of L2)",
    )
    p.add_argument("--json", default=None, help="also write the rows as JSON lines here")
    a = p.parse_args(argv)

    seqs = [SEQ.get(s, None) or int(s) for s in a.seq.split(",")]
    if a.max_seq:
        cap = SEQ.get(a.max_seq) or int(a.max_seq)
        seqs = [s for s in seqs if s <= cap]
    wanted = a.methods.split(",")
    limit = memory_limit()
    print(
        f"device: {mx.default_device()}  mlx {mx.__version__}  B=1, one query, "
        f"keys per-channel / values per-token affine, group {a.group}; "
        f"{a.per_eval} calls per evaluation (reference: up to 4); 'lone' = one call per evaluation; "
        f"{a.copies} K/V copies cycled; median of {a.rounds} interleaved rounds"
    )
    print()
    print(
        "| Hq/Hkv/D | S | bits | " + " | ".join(wanted) + " | fused vs sdpa | fused vs mlx-lm "
        "| fused % HBM | lone sdpa / fused µs | peak MiB " + "/".join(wanted) + " |"
    )
    print("|" + "---|" * (len(wanted) + 8))
    rows = []
    for shape in a.shapes.split(","):
        Hq, Hkv, D = (int(x) for x in shape.split("/"))
        for S in seqs:
            need = 6 * Hkv * S * D * 4  # fp16 K/V + the reference's float32 unpacked codes, roughly
            if limit and need > 0.5 * limit:
                print(f"| {shape} | {S} | - | skipped: needs ~{need / 2**30:.0f} GiB |")
                continue
            key = mx.random.key(S + D)
            kq, kk, kv = mx.random.split(key, 3)
            q = mx.random.normal((1, Hq, 1, D), key=kq).astype(mx.float16)
            k = mx.random.normal((1, Hkv, S, D), key=kk).astype(mx.float16)
            v = mx.random.normal((1, Hkv, S, D), key=kv).astype(mx.float16)
            kvs = [(k, v)] + [
                ((k * (1 + 1e-3 * i)).astype(mx.float16), (v * (1 - 1e-3 * i)).astype(mx.float16))
                for i in range(1, max(1, a.copies))
            ]
            mx.eval(kvs)
            sdpa_result = None
            for bits in (int(b) for b in a.bits.split(",")):
                methods = cycled([build_methods(q, kc, vc, bits, a.group, D**-0.5, a.chunk) for kc, vc in kvs])
                runs: Dict[str, List[Dict]] = {}
                for _ in range(a.rounds):  # methods interleaved round by round
                    for name in wanted:
                        if name == "sdpa" and sdpa_result is not None and a.rounds == 1:
                            runs[name] = [sdpa_result]  # independent of bits: measured once
                            continue
                        fn, nbytes = methods[name]
                        runs.setdefault(name, []).append(run_one(name, fn, nbytes, a))
                res = {name: median_run(rs) for name, rs in runs.items()}
                sdpa_result = res.get("sdpa", sdpa_result)
                f = res.get("fused", {})
                sp = lambda other: (
                    f"{res[other]['us'] / f['us']:.1f}×" if "us" in f and other in res and "us" in res[other] else "-"
                )
                hbm = f"{100 * f['gbps'] / HBM_GBPS:.0f}%" if "us" in f else "-"
                mib = "/".join(f"{res[n]['mib']:.1f}" if "mib" in res[n] else "-" for n in wanted)
                lone = "/".join(
                    f"{res[n]['us_single']:.0f}" if "us_single" in res.get(n, {}) else "-" for n in ("sdpa", "fused")
                )
                print(
                    f"| {shape} | {S // 1024}k | {bits} | "
                    + " | ".join(cell(res[n]) for n in wanted)
                    + f" | {sp('sdpa')} | {sp('mlx-lm')} | {hbm} | {lone} | {mib} |",
                    flush=True,
                )
                rows.append({"shape": shape, "S": S, "bits": bits, **{n: res[n] for n in wanted}})
            del q, k, v, kvs
    if held_bytes():  # allocated once, before the timed calls: the peak column does not see it
        print(f"\nattend_tc's one-launch work buffer, held across calls: {held_bytes() / 2**20:.2f} MiB")
    if a.json:
        import json

        with open(a.json, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
