"""How a kernel bench times one call (`bench attention`, and the research instruments under
benchmarks/): microseconds per call with graph building overlapped, the transient memory of
one call, independent input copies cycled so calls read HBM rather than L2, and the median of
interleaved rounds.
"""

import time
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx


def array_bytes(*arrays) -> int:
    return sum(a.nbytes for a in arrays)


def timeit(fn: Callable, warmup: int, iters: int, per_eval: int) -> float:
    """Microseconds per call. Each evaluation holds `per_eval` independent calls
    (a decode step evaluates every layer's attention in one graph), queued
    with mx.async_eval so host-side graph building overlaps the device."""
    for _ in range(warmup):
        mx.eval([fn() for _ in range(per_eval)])
    mx.synchronize()
    start = time.perf_counter()
    held = []
    for _ in range(iters):
        outs = [fn() for _ in range(per_eval)]
        mx.async_eval(outs)
        held.append(outs)
    mx.eval(held[-1])
    mx.synchronize()
    return (time.perf_counter() - start) / (iters * per_eval) * 1e6


def peak_mib(fn: Callable) -> float:
    """Transient memory of one call: peak above what was held before it."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    mx.synchronize()
    return max(0, mx.get_peak_memory() - base) / 2**20


def memory_limit() -> Optional[int]:
    try:
        info = mx.device_info()
        return int(info.get("memory_size") or info.get("total_memory") or 0) or None
    except Exception:
        return None


def cycled(sets: List[Dict[str, Tuple[Callable, object]]]) -> Dict[str, Tuple[Callable, object]]:
    """One method table over several independent copies of the inputs: each
    call takes the next copy, so consecutive calls do not find their K/V in
    the 50 MB L2 cache (a decode step reads every layer's cache once)."""
    out = {}
    for name, (fn, nbytes) in sets[0].items():
        fns = [st[name][0] for st in sets]
        if fn is None or len(fns) == 1:
            out[name] = (fn, nbytes)
            continue
        state = {"i": 0}

        def call(fns=fns, state=state):
            state["i"] = (state["i"] + 1) % len(fns)
            return fns[state["i"]]()

        out[name] = (call, nbytes)
    return out


def median_run(runs: List[Dict]) -> Dict:
    """The run with the median µs per call (its lone-call figure too), or the first failure."""
    bad = [r for r in runs if "err" in r]
    if bad:
        return bad[0]
    r = dict(sorted(runs, key=lambda r: r["us"])[len(runs) // 2])
    lone = sorted(x["us_single"] for x in runs if "us_single" in x)
    if lone:
        r["us_single"] = lone[len(lone) // 2]
    return r
