"""attend_tc's launches through `mx.fast.cuda_kernel` (geometry: tc.py).

What a call costs the host was measured per feature of an empty kernel on the H200
(`python -m benchmarks.launch_cost`, docs/kernels.md):
template arguments, outputs, inputs read with strides and the kernel's text length all
add microseconds per call, because MLX rebuilds and hashes the text on every call. So a
kernel here is built once per plan with its constants written into the text (no template
arguments), takes only the inputs its variant reads, and the one-launch variant writes two
outputs: its partials live in a work buffer shared by every folded launch (after the
counters), which is sound because those launches are ordered (`_Order`).
"""

import threading
import zlib
from functools import lru_cache
from typing import Optional

import mlx.core as mx

from . import tc, variants
from .cuda import merge
from .partials import hides_tokens
from .source import strip
from .table import Binding

_CTYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}
CODES = ["q", "kc", "ks", "kz", "vc", "vs", "vz"]
TAIL = ["xk0", "xv0", "xk1", "xv1"]


def constants(template: tuple) -> str:
    """The plan's compile-time constants as the kernel text's first lines."""
    return "".join(
        f"using {n} = {_CTYPES[v]};\n" if not isinstance(v, int) else f"constexpr int {n} = {v};\n" for n, v in template
    )


@lru_cache(maxsize=256)
def kernel(template: tuple, smem: int, bps: int, fold: bool, nx: int):
    """The kernel of one plan and variant: `fold` (merge in the launch; outputs out, lse) or
    partials (pm, pl, pacc); `nx` dense tail tiers."""
    body = constants(template + (("NX", nx),)) + strip(tc.sections()["attend_tc"])
    names = CODES + (["work", "after"] if fold else []) + TAIL[: 2 * nx]
    tag = f"{zlib.crc32(f'{fold}{body}'.encode()):08x}"  # stable across processes: MLX caches builds by name
    return variants.kernel(
        name=f"vq_tc_{tag}",
        input_names=names,
        output_names=["out", "lse"] if fold else ["pm", "pl", "pacc"],
        source=body,
        header=strip(tc.header(bps, fold, nx)),
        shared_memory=smem,
        ensure_row_contiguous=False,
    )  # views are read in place (strides); the kernel checks its rows


class _Order:
    """The folded launches' work buffer (counters, zero between launches, then partials) and
    the last folded launch's lse. Each launch takes that lse as an input it never reads: MLX
    then runs them one after another (its CUDA graphs order nodes by the buffers they share),
    so no two count on the same counters or write the same partials at once."""

    lock = threading.Lock()
    work = None
    last = None


def held_bytes() -> int:
    """Bytes the work buffer holds for the process (0 before the first folded launch)."""
    return 0 if _Order.work is None else _Order.work.nbytes


def _work(nfloats: int):
    """(work buffer of at least COUNTERS + nfloats words, the input ordering this launch)."""
    if _Order.work is None or _Order.work.size < tc.COUNTERS + nfloats:
        old = 0 if _Order.work is None else _Order.work.size
        _Order.work = mx.zeros((max(tc.COUNTERS + nfloats, 2 * old),), dtype=mx.int32)
        mx.eval(_Order.work)
        if _Order.last is None:
            _Order.last = mx.zeros((1,), dtype=mx.float32)
            mx.eval(_Order.last)
    return _Order.work, _Order.last


def partials_kw(qshape: tuple, hkv: int, ns: int, threads: int) -> dict:
    """Keyword arguments of an attend launch writing one partial per block along the
    sequence (pm, pl [rows, ns], pacc [rows, ns, D]): grid (ns blocks, B*Hkv); no template
    arguments (the constants are written into the kernel's text)."""
    B, Hq, Lq, D = qshape
    nrows, f32 = B * Hq * Lq, mx.float32
    return dict(
        grid=(ns * threads, B * hkv, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(nrows, ns), (nrows, ns), (nrows, ns, D)],
        output_dtypes=[f32, f32, f32],
    )


def launch_kw(qshape: tuple, hkv: int, np_: int, fold: bool, out_dtype=mx.float32) -> dict:
    """attend_mma's partials launch (`partials_kw`) over `np_` blocks per kv head; folded,
    its outputs are the answer instead: out [B, Hq, Lq, D] (`out_dtype`) and lse."""
    kw = partials_kw(qshape, hkv, np_, tc.NW * 32)
    if fold:
        kw.update(output_shapes=[qshape, qshape[:3]], output_dtypes=[out_dtype, mx.float32])
    return kw


def partials(qshape: tuple, qdtype, cshape: tuple, kspec: tuple, vspec: tuple, scale: float):
    """`attend(codes) -> (pm, pl, pacc)`: the launch without the merge (codes = the 7 inputs)."""
    B, Hq, Lq, D = qshape
    p = tc.plan(B, Hq, Lq, D, cshape[1], cshape[2], qdtype, kspec, vspec, scale)
    attend = kernel(p.template, p.smem, p.bps, False, 0)
    kw = launch_kw(qshape, cshape[1], p.ns, False)
    return lambda codes: attend(inputs=codes, **kw)


def launcher(
    qshape: tuple, qdtype, cshape: tuple, kspec: tuple, vspec: tuple, scale: float, fold: Optional[bool] = None
):
    """`run(q, k_enc, v_enc, tail=None, hidden=0)` for attend_tc calls of these shapes, as
    cuda.launcher's: (out f32, lse), or with `tail` the final output in q's dtype. `fold`:
    one launch (True) or two (False); by default `tc.folds`."""
    B, Hq, Lq, D = qshape
    Hkv = cshape[1]
    p = tc.plan(B, Hq, Lq, D, Hkv, cshape[2], qdtype, kspec, vspec, scale)
    unfolded = partials(qshape, qdtype, cshape, kspec, vspec, scale)
    if fold is None:
        fold = tc.folds(B, Hkv, (Hq // Hkv) * Lq, D, p.ns)
    plans = {}  # (tail tiers, tail blocks, tail dtype) -> (kernel, keywords, partial floats)

    def folded(key):
        nx, ntail, _ = key
        np_ = p.ns + ntail
        return (
            kernel(p.template, p.smem, p.bps, True, nx),
            launch_kw(qshape, Hkv, np_, True, qdtype if nx else mx.float32),
            B * Hq * Lq * np_ * (D + 2) + 8,
        )  # pm, pl, pacc; two runs padded to 16 bytes

    def run(q, k_enc, v_enc, tail=None, hidden=0):
        if hides_tokens(hidden):
            raise ValueError("attend_tc cannot hide tokens (v1 does)")
        codes = [q, k_enc["codes"], k_enc["scales"], k_enc["zeros"], v_enc["codes"], v_enc["scales"], v_enc["zeros"]]
        w = sum(k.shape[2] for k, _ in tail) if tail else 0
        if fold and w <= tc.TAIL_BLOCKS_MAX * tc.TAIL_TOKENS and (not tail or tail[0][0].shape[1] == Hkv):
            key = (len(tail), -(-w // tc.TAIL_TOKENS), tail[0][0].dtype) if tail else (0, 0, None)
            got = plans.get(key)
            if got is None:
                got = plans[key] = folded(key)
            attend, kw, nfloats = got
            xs = [a for kv in tail for a in kv] if tail else []
            with _Order.lock:
                work, after = _work(nfloats)
                out, lse = attend(inputs=codes + [work, after] + xs, **kw)
                _Order.last = lse
            return out if tail else (out, lse)
        pm, pl, pacc = unfolded(codes)
        return merge(pm, pl, pacc, q, qshape, qdtype, scale, tail)

    return run


def _scope(B: int, Hq: int, Lq: int, D: int, Hkv: int, L: int, kspec: tuple, vspec: tuple) -> str:
    return tc.supported(Hq, Lq, D, Hkv, L, kspec, vspec)


def _prefer(B: int, Hq: int, Lq: int, D: int, Hkv: int, L: int, kspec: tuple, vspec: tuple) -> str:
    """At D = 256 attend_tc is the default only in one launch: in two it measured slower
    than v1 (Gemma-3's shapes, docs/kernels.md)."""
    if D <= 128 or tc.folds_call(B, Hq, Lq, D, Hkv, L, kspec, vspec):
        return ""
    return "tc kernel: D > 128 in two launches"


BINDINGS = {
    "tc": Binding(
        _scope,
        lambda qshape, qdtype, cshape, kspec, vspec, scale, chunk=0: launcher(
            qshape, qdtype, cshape, kspec, vspec, scale
        ),
        _prefer,
    )
}
