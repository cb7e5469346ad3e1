"""Binding of kernels/cuda/affine_attention.cu through `mx.fast.cuda_kernel`: the v1 kernel
(the `v1` row of the kernel table, table.py), the attend family's scope (`unsupported`, what
v1 takes), the launcher every attend kernel is reached by, and the reduce launches (attend_mma:
mma.py; attend_tc: tc_launch.py). An attend kernel writes one max/sum/accumulator partial per
block along the sequence and `reduce` merges them (attend_tc in its own launch where it can).
Contract and format: kernels/CONTRACT.md.
"""

import math
from functools import lru_cache
from typing import Dict, NamedTuple, Optional, Tuple

import mlx.core as mx

from ..paths import kernels_dir
from . import variants
from .geometry import MAX_ROWS, SM_COUNT, SMEM_MAX, blocks_per_sm, choose_chunk, float_bits, plan, smem_bytes  # noqa: F401 -- part of this module's interface (tests, bench)
from .partials import hides_tokens
from .reference import Spec, spec_fields
from .source import split_sections
from .source import strip as _strip
from .table import KERNELS, Binding, attend_route
from .tail import FLOATS as _QTYPES
from .tail import TAIL_MAX

SOURCE = "cuda/affine_attention.cu"


@lru_cache(maxsize=None)
def sections() -> Dict[str, str]:
    """The .cu file's sections: header, attend, reduce, ..."""
    return split_sections((kernels_dir() / SOURCE).read_text())


def unsupported(q: mx.array, k_enc, v_enc, k_spec: Spec, v_spec: Spec) -> str:
    """Why the kernel cannot take this call ('' when it can)."""
    kb, kg, kax = spec_fields(k_spec)
    vb, vg, vax = spec_fields(v_spec)
    if q.ndim != 4 or k_enc["codes"].ndim != 4:
        return "q and codes must be 4-D"
    B, Hq, Lq, D = q.shape
    _, Hkv, L, _ = k_enc["codes"].shape
    if q.dtype not in _QTYPES:
        return f"query dtype {q.dtype}"
    if D not in (64, 128, 256):
        return f"head_dim {D} (kernel: 64, 128, 256)"
    if kb not in (2, 4, 8) or vb not in (2, 4, 8):
        return f"bits {kb}/{vb} (kernel: 2, 4, 8)"
    if Hkv == 0 or Hq % Hkv or L == 0:
        return "heads do not divide or the tier is empty"
    if Lq > 8:
        return f"{Lq} queries (kernel: decode, up to 8)"
    for bits, group, axis, enc in ((kb, kg, kax, k_enc), (vb, vg, vax, v_enc)):
        if group not in (16, 32, 64, 128, 256):
            return f"group {group} (kernel: powers of two 16..256)"
        if axis == "token" and (group > D or D % group):
            return f"token group {group} does not divide head_dim {D}"
        if axis == "channel" and (L % group or group > 256):
            return f"channel group {group} does not divide the tier length {L}"
        if enc["codes"].dtype != mx.uint32 or enc["scales"].dtype != mx.float16 or enc["zeros"].dtype != mx.float16:
            return "storage dtypes (kernel: uint32 codes, float16 scales/zeros)"
        if enc["codes"].shape[:3] != (B, Hkv, L) or enc["codes"].shape[3] != D * bits // 32:
            return "codes shape"
    rows = (Hq // Hkv) * Lq
    if not choose_chunk(D, 1 if rows == 1 else 2 if rows == 2 else MAX_ROWS, (kb, kg, kax), (vb, vg, vax)):
        return "no chunk size fits shared memory"
    return ""


def attend_header(threads: int) -> str:
    """The attend kernel's header: launch bounds first (see the .cu file)."""
    return f"#define VQ_LAUNCH_BOUNDS {threads}, {blocks_per_sm(threads)}\n" + sections()["header"]


@lru_cache(maxsize=None)
def _attend_kernel(smem: int, threads: int):
    return variants.kernel(
        name=f"vq_affine_attend_{smem}_{threads}_{blocks_per_sm(threads)}",
        input_names=["q", "kc", "ks", "kz", "vc", "vs", "vz", "lo"],
        output_names=["pm", "pl", "pacc"],
        source=_strip(sections()["attend"]),
        header=_strip(attend_header(threads)),
        shared_memory=smem,
    )


_HIDDEN: Dict[int, mx.array] = {}
SPAN_END = 2**31 - 1  # a span's end past any tier: the row sees the tier to its last token


def hidden_count(n: int) -> mx.array:
    """The attend kernel's `lo` input for every row alike: the first n tokens hidden, the rest seen
    ([1, 2] span). One array per count, made once (a decode step then passes it without a node)."""
    if n not in _HIDDEN:
        _HIDDEN[n] = mx.array([[n, SPAN_END]], dtype=mx.int32)
    return _HIDDEN[n]


def visible_span(hidden) -> mx.array:
    """`lo` for a call's `hidden`: a count hidden at every row's front, or already a [B, 2] int32
    array of each batch row's visible tokens [first, end) (a ragged batch: runtime/batch_chain.py)."""
    return hidden if isinstance(hidden, mx.array) else hidden_count(hidden)


@lru_cache(maxsize=None)
def _reduce_kernel():
    s = sections()
    return variants.kernel(
        name="vq_affine_reduce",
        input_names=["pm", "pl", "pacc"],
        output_names=["out", "lse"],
        source=_strip(s["reduce"]),
        header=_strip(s["header"]),
    )


@lru_cache(maxsize=None)
def _reduce_tail_kernel():
    """The reduce that also attends over dense 16-bit tiers (views read in place, any strides)."""
    s = sections()
    return variants.kernel(
        name="vq_affine_reduce_tail",
        input_names=["pm", "pl", "pacc", "q", "xk0", "xv0", "xk1", "xv1"],
        output_names=["out", "lse"],
        source=_strip(s["reduce_tail"]),
        header=_strip(s["header"]),
        ensure_row_contiguous=False,
    )


class Launch(NamedTuple):
    """Everything one call needs, prepared once per (shapes, specs, scale)."""

    attend: object
    a_kw: dict
    scale: float
    hides: bool = False  # the attend kernel takes `lo` (tokens hidden at the tier's front): v1


@lru_cache(maxsize=256)
def _tail_kw(qshape: tuple, qdtype, tdtype, nx: int, hkv: int, scale: float) -> dict:
    B, Hq, Lq, D = qshape
    template = [
        ("T", qdtype),
        ("TX", tdtype),
        ("D", D),
        ("NX", nx),
        ("REP", Hq // hkv),
        ("LQ", Lq),
        ("QSCALE", float_bits(scale * math.log2(math.e))),
        ("XMAX", TAIL_MAX),
    ]
    return dict(
        template=template,
        grid=(128 * (D // 32), B * Hq * Lq, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[qshape, (B * Hq * Lq,)],
        output_dtypes=[qdtype, mx.float32],
    )


@lru_cache(maxsize=256)
def _reduce_kw(qshape: tuple) -> dict:
    """The reduce launch after either attend kernel: (out, lse) in float32 for every row."""
    B, Hq, Lq, D = qshape
    return dict(
        template=[("D", D)],
        grid=(128 * (D // 32), B * Hq * Lq, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(B, Hq, Lq, D), (B, Hq, Lq)],
        output_dtypes=[mx.float32, mx.float32],
    )


@lru_cache(maxsize=1024)
def _launch(qshape: tuple, qdtype, cshape: tuple, kspec: tuple, vspec: tuple, scale: float, chunk: int) -> Launch:
    B, Hq, Lq, D = qshape
    _, Hkv, L, _ = cshape
    p = plan(B, Hq, Lq, D, Hkv, L, qdtype, kspec, vspec, scale, chunk)
    nrows = B * Hq * Lq
    f32 = mx.float32
    a_kw = dict(
        template=list(p.template),
        grid=(p.ns * D, B * Hkv, p.nrb),
        threadgroup=(D, 1, 1),
        output_shapes=[(nrows, p.nc), (nrows, p.nc), (nrows, p.nc, D)],
        output_dtypes=[f32, f32, f32],
    )
    return Launch(_attend_kernel(p.smem, D), a_kw, scale, True)


def launcher(
    qshape: tuple,
    qdtype,
    cshape: tuple,
    k_spec: Spec,
    v_spec: Spec,
    scale: float,
    impl: Optional[str] = None,
    chunk: int = 0,
    hides: bool = False,
):
    """`run(q, k_enc, v_enc) -> (out, lse)` for calls of these shapes, with the kernel
    choice (`table.attend_route`) and launch parameters resolved now: per call only the
    launches remain (a cache keeps one per tier between decode steps). `hides`: calls may
    hide tokens at the tier's front (`run(..., hidden=n)`, a sliding window): only v1 takes that."""
    B, Hq, Lq, D = qshape
    ksp, vsp = spec_fields(k_spec), spec_fields(v_spec)
    which = attend_route((B, Hq, Lq, D, cshape[1], cshape[2]), ksp, vsp, impl, chunk, hides)
    return KERNELS[which].launch(qshape, qdtype, cshape, ksp, vsp, float(scale), chunk)


def runner(la: Launch, qshape: tuple, qdtype):
    """The `run` of an attend launch whose partials the reduce (or reduce_tail) merges."""

    def run(q: mx.array, k_enc: Dict[str, mx.array], v_enc: Dict[str, mx.array], tail=None, hidden=0):
        """(out f32, lse) of this tier, its first `hidden` tokens left out (or, an int32 [B, 2]
        array, each batch row's visible span: `visible_span`); with `tail` (dense (k, v) tiers,
        every token visible, `tail_unsupported` empty) the final attention over all of them, in
        q's dtype."""
        inputs = [q, k_enc["codes"], k_enc["scales"], k_enc["zeros"], v_enc["codes"], v_enc["scales"], v_enc["zeros"]]
        if la.hides:
            inputs.append(visible_span(hidden))
        elif hides_tokens(hidden):
            raise ValueError("this launch plan cannot hide tokens: build it with hides=True")
        pm, pl, pacc = la.attend(inputs=inputs, **la.a_kw)
        return merge(pm, pl, pacc, q, qshape, qdtype, la.scale, tail)

    return run


def _launch_v1(qshape: tuple, qdtype, cshape: tuple, kspec: tuple, vspec: tuple, scale: float, chunk: int = 0):
    return runner(_launch(qshape, qdtype, cshape, kspec, vspec, scale, chunk), qshape, qdtype)


def merge(pm, pl, pacc, q, qshape: tuple, qdtype, scale: float, tail=None):
    """The reduce launch over an attend launch's partials: (out f32, lse), or with
    `tail` (reduce_tail) the final output in q's dtype."""
    if not tail:
        return tuple(_reduce_kernel()(inputs=[pm, pl, pacc], **_reduce_kw(qshape)))
    (k0, v0), (k1, v1) = tail[0], tail[-1]
    kw = _tail_kw(qshape, qdtype, k0.dtype, len(tail), k0.shape[1], scale)
    return _reduce_tail_kernel()(inputs=[pm, pl, pacc, q, k0, v0, k1, v1], **kw)[0]


def affine_partial_attention(
    q: mx.array,
    k_enc: Dict[str, mx.array],
    v_enc: Dict[str, mx.array],
    k_spec: Spec,
    v_spec: Spec,
    scale: float,
    chunk: Optional[int] = None,
    impl: Optional[str] = None,
    hidden=0,
) -> Tuple[mx.array, mx.array]:
    """The fused kernel, contract of reference.affine_partial_attention (the caller checked
    `unsupported(...) == ''`): one or two launches and no other op (`launcher`)."""
    return launcher(
        tuple(q.shape),
        q.dtype,
        tuple(k_enc["codes"].shape),
        k_spec,
        v_spec,
        scale,
        impl,
        chunk or 0,
        hides=hides_tokens(hidden),
    )(q, k_enc, v_enc, hidden=hidden)


BINDINGS = {"v1": Binding(lambda *call: "", _launch_v1)}  # v1 takes every call the family does (`unsupported`)
