"""An affine tier's attention through MLX's own quantized matmul (`mx.quantized_matmul`):
the `qmm` row of the kernel table, for backends where no fused kernel of ours is verified.

The codes are read where the tier holds them: [B, Hkv, L, D·bits/32] uint32, packed along
the channels in MLX's own bit order (code j at stream bits [j·b, (j+1)·b), as `mx.quantize`
writes it for 2..8 bits). A group along the channels (per-token values, per-token keys) is
MLX's group: its scale and zero are MLX's scale and bias, used as stored. A group along the
tokens (KIVI's per-channel keys, per-channel values) is no MLX group, so its codes go through
the matmul raw (scale 1, bias 0) and the scale and zero are applied around it, per token
group g batched on its own axis:

  keys, axis=channel:   score[t] = Σ_d (q[d] s[g,d]) c[t,d] + Σ_d q[d] z[g,d]
  values, axis=channel: out[d] = Σ_g s[g,d] (Σ_{t∈g} p[t] c[t,d]) + z[g,d] P[g]

so no layout is converted and no 16-bit copy of K or V is formed; the kv heads (and a GQA
group's query heads, as rows) are batch dimensions of the matmul. Answers the contract of
`reference.affine_partial_attention`: (out [B, Hq, Lq, D] f32, lse [B, Hq, Lq]); and, as the
CUDA kernels' reduce_tail does, the layer's attention with its 16-bit tiers folded in
(`attention_with_tail`: one softmax over both, fewer graph nodes than a partial per tier and a merge).
"""

from functools import lru_cache
from typing import Dict

import mlx.core as mx

from .partials import hide, hides_tokens
from .reference import Spec, spec_fields
from .table import Binding

BITS = (2, 3, 4, 5, 6, 8)  # mx.quantized_matmul's affine widths (bit order checked in tests/test_mlx_affine.py)
GROUPS = (32, 64, 128)  # its group sizes
MAX_ROWS = 64  # query rows per kv head (rep x queries): scores [rows, L] are formed
COMPILED_SHAPES = 64  # launches (compiled graphs) kept: the tier lengths of the recent steps


def raw_group(head_dim: int) -> int:
    """The MLX group that carries raw codes of a token-grouped side (0 where none tiles D)."""
    return next((g for g in (128, 64, 32) if head_dim % g == 0), 0)


def scope(B: int, Hq: int, Lq: int, D: int, Hkv: int, L: int, kspec: tuple, vspec: tuple) -> str:
    """Why this route cannot take a call ('' when it can); specs are (bits, group, axis)."""
    if Hkv == 0 or Hq % Hkv or L == 0:
        return "qmm: heads do not divide or the tier is empty"
    if (Hq // Hkv) * Lq > MAX_ROWS:
        return f"qmm: at most {MAX_ROWS} query rows per kv head (decode)"
    for bits, group, axis in (kspec, vspec):
        if bits not in BITS:
            return f"qmm: bits {bits} (MLX: {', '.join(map(str, BITS))})"
        if axis == "token" and (group not in GROUPS or D % group):
            return f"qmm: channel group {group} (MLX: 32, 64, 128 dividing head_dim {D})"
        if axis == "channel" and (not raw_group(D) or L % group):
            return f"qmm: head_dim {D} / tier length {L} for token groups of {group}"
    return ""


def storage_unsupported(k_enc: Dict[str, mx.array], v_enc: Dict[str, mx.array]) -> str:
    for enc in (k_enc, v_enc):
        if enc["codes"].dtype != mx.uint32 or enc["codes"].ndim != 4:
            return "qmm: 4-D uint32 codes"
    return ""


def _raw_matmul(x: mx.array, codes: mx.array, bits: int, transpose: bool) -> mx.array:
    """x @ codes (or codesᵀ) of the unscaled integer codes, batched over codes' leading axes."""
    D = codes.shape[-1] * 32 // bits
    g = raw_group(D)
    shape = (*codes.shape[:-1], D // g)  # one MLX group per g channels: scale 1, bias 0
    ones, zeros = mx.broadcast_to(mx.array(1.0), shape), mx.broadcast_to(mx.array(0.0), shape)
    return mx.quantized_matmul(x, codes, ones, zeros, transpose=transpose, group_size=g, bits=bits)


def scores(q: mx.array, k_enc: Dict[str, mx.array], bits: int, group: int, axis: str) -> mx.array:
    """q [B, H, R, D] float32 (scaled) -> q·K [B, H, R, L] from the key codes."""
    codes, s, z = k_enc["codes"], k_enc["scales"], k_enc["zeros"]
    if axis == "token":
        return mx.quantized_matmul(q, codes, s, z, transpose=True, group_size=group, bits=bits)
    B, H, L, W = codes.shape
    R, ng = q.shape[2], L // group
    qs = q[:, :, None] * s[:, :, :, None, :]  # [B, H, ng, R, D]
    dots = _raw_matmul(qs, codes.reshape(B, H, ng, group, W), bits, transpose=True)  # [B, H, ng, R, group]
    bias = z.astype(mx.float32) @ q.swapaxes(-1, -2)  # [B, H, ng, R]
    return (dots + bias[..., None]).transpose(0, 1, 3, 2, 4).reshape(B, H, R, L)


def weighted_values(p: mx.array, v_enc: Dict[str, mx.array], bits: int, group: int, axis: str) -> mx.array:
    """p [B, H, R, L] float32 weights -> Σ_t p[t] v[t] as [B, H, R, D] from the value codes."""
    codes, s, z = v_enc["codes"], v_enc["scales"], v_enc["zeros"]
    if axis == "token":
        return mx.quantized_matmul(p, codes, s, z, transpose=False, group_size=group, bits=bits)
    B, H, L, W = codes.shape
    R, ng = p.shape[2], L // group
    pg = p.reshape(B, H, R, ng, group).transpose(0, 1, 3, 2, 4)  # [B, H, ng, R, group]
    part = _raw_matmul(pg, codes.reshape(B, H, ng, group, W), bits, transpose=False)  # [B, H, ng, R, D]
    scaled = (part * s[:, :, :, None, :]).sum(2)
    return scaled + pg.sum(-1).swapaxes(-1, -2) @ z.astype(mx.float32)


def partial_attention(
    q: mx.array,
    k_enc: Dict[str, mx.array],
    v_enc: Dict[str, mx.array],
    k_spec: Spec,
    v_spec: Spec,
    scale: float,
    hidden=0,
):
    """(out [B, Hq, Lq, D] f32, lse [B, Hq, Lq]) of q over one affine-coded tier, its first
    `hidden` tokens left out (or each batch row's visible span): reference.affine_partial_attention's
    contract."""
    kb, kg, kax = spec_fields(k_spec)
    vb, vg, vax = spec_fields(v_spec)
    B, Hq, Lq, D = q.shape
    qf = _rows(q, k_enc["codes"].shape[1], scale)
    s = hide(scores(qf, k_enc, kb, kg, kax), hidden)
    peak = mx.max(s, axis=-1, keepdims=True)
    spans = isinstance(hidden, mx.array)
    if spans:  # a batch row holding nothing here: weights 0, lse -inf
        peak = mx.where(mx.isinf(peak), 0.0, peak)
    weights = mx.exp(s - peak)
    total = mx.sum(weights, axis=-1, keepdims=True)
    out = weighted_values(weights, v_enc, vb, vg, vax) / (mx.maximum(total, 1e-30) if spans else total)
    lse = mx.log(total) + peak
    return out.reshape(B, Hq, Lq, D), lse.reshape(B, Hq, Lq)


def _rows(q: mx.array, Hkv: int, scale: float) -> mx.array:
    """q [B, Hq, Lq, D] -> float32 rows of each kv head [B, Hkv, rep·Lq, D], scaled: (rep head i,
    query j) -> row i·Lq + j, as in q's memory order."""
    B, Hq, Lq, D = q.shape
    return q.astype(mx.float32).reshape(B, Hkv, Hq // Hkv * Lq, D) * scale


def attention_with_tail(q, k_enc, v_enc, k_spec: Spec, v_spec: Spec, scale: float, tail, hidden: int = 0, coded=None):
    """softmax over the coded tier (but its first `hidden` tokens) and the dense (k, v) tiers of
    `tail` together, in q's dtype: one softmax over both score blocks, no partials to merge.
    `coded`: (scores, weighted values) of the coded tier, as `scores` / `weighted_values` answer."""
    kb, kg, kax = spec_fields(k_spec)
    vb, vg, vax = spec_fields(v_spec)
    coded = coded or (lambda x: scores(x, k_enc, kb, kg, kax), lambda p: weighted_values(p, v_enc, vb, vg, vax))
    B, Hq, Lq, D = q.shape
    L = k_enc["codes"].shape[2]
    kt, vt = tail[0] if len(tail) == 1 else (mx.concatenate([kv[i] for kv in tail], axis=2) for i in (0, 1))
    qf = _rows(q, kt.shape[1], scale)
    s = hide(coded[0](qf), hidden)
    s = mx.concatenate([s, qf @ kt.astype(mx.float32).swapaxes(-1, -2)], axis=-1)
    weights = mx.exp(s - mx.max(s, axis=-1, keepdims=True))
    out = coded[1](weights[..., :L]) + weights[..., L:] @ vt.astype(mx.float32)
    return (out / mx.sum(weights, axis=-1, keepdims=True)).reshape(B, Hq, Lq, D).astype(q.dtype)


@lru_cache(maxsize=COMPILED_SHAPES)
def launch(qshape: tuple, qdtype, cshape: tuple, kspec: tuple, vspec: tuple, scale: float, chunk: int = 0):
    """`run(q, k_enc, v_enc, tail=None, hidden=0)` for calls of these shapes (the attend family's
    binding): the tier's partial (out, lse), or with `tail` (the layer's 16-bit tiers, every token
    visible) the layer's attention over all of them in q's dtype.

    The partial, and the coded tier's scores and weighted values, are compiled for these shapes
    (elementwise chains fused) and shared by every layer that asks with them: a tier's length
    changes only when a group arrives, so each is traced once per group; the least recent are let go."""
    fixed = (kspec, vspec, scale)
    enc = lambda c, s, z: dict(codes=c, scales=s, zeros=z)  # noqa: E731
    whole = mx.compile(lambda q, kc, ks, kz, vc, vs, vz: partial_attention(q, enc(kc, ks, kz), enc(vc, vs, vz), *fixed))
    coded_scores = mx.compile(lambda x, c, s, z: scores(x, enc(c, s, z), *kspec))
    coded_values = mx.compile(lambda p, c, s, z: weighted_values(p, enc(c, s, z), *vspec))

    def run(q, k_enc, v_enc, tail=None, hidden=0):
        k, v = ([e[n] for n in ("codes", "scales", "zeros")] for e in (k_enc, v_enc))
        if tail:
            coded = (lambda x: coded_scores(x, *k), lambda p: coded_values(p, *v))
            return attention_with_tail(q, k_enc, v_enc, *fixed, tail, hidden, coded)
        if hides_tokens(hidden):  # counts change every step: not a shape to compile for
            return partial_attention(q, k_enc, v_enc, *fixed, hidden)
        return whole(q, *k, *v)

    return run


BINDINGS = {"qmm": Binding(lambda *call: scope(*call), launch)}
