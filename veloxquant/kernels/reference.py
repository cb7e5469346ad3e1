"""MLX-ops reference of the fused affine decode-attention contract.

`affine_partial_attention(q, k_enc, v_enc, k_spec, v_spec, scale) -> (out, lse)`
answers what `partial_attention(q, decode(K), decode(V), scale)` answers, but
computes from the codes in the same factored form the CUDA kernel uses, so the
two share one algebra and the reference runs anywhere MLX runs (CPU included):

  keys, axis=channel (group g of tokens, scale s[g,d], zero z[g,d]):
      score[t] = sum_d (q[d] s[g,d]) c[t,d] + sum_d q[d] z[g,d]
  keys, axis=token (group j of channels, scale s[t,j], zero z[t,j]):
      score[t] = sum_j s[t,j] (sum_{d in j} q[d] c[t,d]) + sum_j z[t,j] Q[j]
  values, axis=token:   out[d] = sum_t (p[t] s[t,j]) c[t,d] + sum_t p[t] z[t,j]
  values, axis=channel: out[d] = sum_g s[g,d] (sum_{t in g} p[t] c[t,d]) + z[g,d] P[g]

No dequantized K or V is formed; codes are unpacked to float32 (this is the
reference, not the fast path). Softmax and accumulation are float32.
"""

from typing import Dict, Mapping, Tuple, Union

import mlx.core as mx

from .bitpack import unpack
from .partials import hide, merge_partials, partial_attention

Spec = Union[Mapping, object]


def spec_fields(spec: Spec) -> Tuple[int, int, str]:
    """(bits, group, axis) from a dict like {"bits": 2, "group": 32, "axis": "token"}, an Affine,
    or such a tuple already."""
    if isinstance(spec, tuple):
        return int(spec[0]), int(spec[1]), str(spec[2])
    if isinstance(spec, Mapping):
        return int(spec.get("bits", 4)), int(spec.get("group", 32)), str(spec.get("axis", "token"))
    return int(spec.bits), int(spec.group), str(spec.axis)


def _codes(enc: Dict[str, mx.array], bits: int) -> mx.array:
    codes = enc["codes"]
    n = codes.shape[-1] * 32 // bits
    return unpack(codes, bits, n).astype(mx.float32)  # [B, H, L, D]


def _scores(q: mx.array, k_enc: Dict[str, mx.array], bits: int, group: int, axis: str) -> mx.array:
    """q [B, H, R, D] float32 (already scaled) -> scores [B, H, R, L]."""
    c = _codes(k_enc, bits)
    B, H, L, D = c.shape
    s = k_enc["scales"].astype(mx.float32)
    z = k_enc["zeros"].astype(mx.float32)
    if axis == "channel":
        ng = L // group
        cg = c.reshape(B, H, ng, group, D)
        qs = q[:, :, None] * s[:, :, :, None, :]  # [B, H, ng, R, D]
        scores = cg @ qs.swapaxes(-1, -2)  # [B, H, ng, group, R]
        bias = (q[:, :, None] * z[:, :, :, None, :]).sum(-1)  # [B, H, ng, R]
        scores = scores + bias[:, :, :, None, :]
        return scores.reshape(B, H, L, -1).swapaxes(-1, -2)
    nj = D // group
    cj = c.reshape(B, H, L, nj, group).transpose(0, 1, 3, 2, 4)  # [B, H, nj, L, group]
    qj = q.reshape(*q.shape[:3], nj, group).transpose(0, 1, 3, 4, 2)  # [B, H, nj, group, R]
    dots = cj @ qj  # [B, H, nj, L, R]
    qsum = q.reshape(*q.shape[:3], nj, group).sum(-1)  # [B, H, R, nj]
    scores = (dots * s.transpose(0, 1, 3, 2)[..., None]).sum(2)  # [B, H, L, R]
    return (scores + z @ qsum.swapaxes(-1, -2)).swapaxes(-1, -2)


def _weighted_values(p: mx.array, v_enc: Dict[str, mx.array], bits: int, group: int, axis: str) -> mx.array:
    """p [B, H, R, L] float32 weights -> sum_t p[t] v[t] as [B, H, R, D]."""
    c = _codes(v_enc, bits)
    B, H, L, D = c.shape
    s = v_enc["scales"].astype(mx.float32)
    z = v_enc["zeros"].astype(mx.float32)
    R = p.shape[2]
    if axis == "token":
        nj = D // group
        cj = c.reshape(B, H, L, nj, group).transpose(0, 1, 3, 2, 4)  # [B, H, nj, L, group]
        ps = p[:, :, None] * s.transpose(0, 1, 3, 2)[:, :, :, None, :]  # [B, H, nj, R, L]
        out = ps @ cj  # [B, H, nj, R, group]
        out = out.transpose(0, 1, 3, 2, 4).reshape(B, H, R, D)
        zterm = p @ z  # [B, H, R, nj]
        return out + mx.repeat(zterm, group, axis=-1)
    ng = L // group
    cg = c.reshape(B, H, ng, group, D)
    pg = p.reshape(B, H, R, ng, group).transpose(0, 1, 3, 2, 4)  # [B, H, ng, R, group]
    part = pg @ cg  # [B, H, ng, R, D]
    out = (part * s[:, :, :, None, :]).sum(2)
    psum = pg.sum(-1)  # [B, H, ng, R]
    return out + (psum[..., None] * z[:, :, :, None, :]).sum(2)


def affine_partial_attention(
    q: mx.array,
    k_enc: Dict[str, mx.array],
    v_enc: Dict[str, mx.array],
    k_spec: Spec,
    v_spec: Spec,
    scale: float,
    hidden=0,
) -> Tuple[mx.array, mx.array]:
    """softmax(scale q K^T) V over one affine-coded tier, every token visible but the
    first `hidden` (a sliding window's expired tokens still held in their key group).
    `hidden` may instead be an int32 [B, 2] array: batch row b sees tokens [hidden[b, 0],
    hidden[b, 1]) (a ragged batch's rows hold different counts); a row seeing none gets out 0
    and lse -inf.

    q [B, Hq, Lq, D]; K/V stored as Affine encodings of [B, Hkv, L, D] with
    Hq = Hkv * rep (query head h reads kv head h // rep). Returns out
    [B, Hq, Lq, D] float32 (normalized) and lse [B, Hq, Lq] float32 (natural log).
    """
    kb, kg, kax = spec_fields(k_spec)
    vb, vg, vax = spec_fields(v_spec)
    B, Hq, Lq, D = q.shape
    Hkv = k_enc["codes"].shape[1]
    rep = Hq // Hkv
    # Rows of one kv head: (rep head i, query j) -> i * Lq + j, as in q's memory order.
    qf = q.astype(mx.float32).reshape(B, Hkv, rep * Lq, D) * scale
    scores = _scores(qf, k_enc, kb, kg, kax)  # [B, Hkv, R, L]
    scores = hide(scores, hidden)
    peak = mx.max(scores, axis=-1, keepdims=True)
    peak = mx.where(mx.isinf(peak), 0.0, peak)  # a row that sees nothing: weights 0
    weights = mx.exp(scores - peak)
    total = mx.sum(weights, axis=-1, keepdims=True)
    out = _weighted_values(weights, v_enc, vb, vg, vax) / mx.maximum(total, 1e-30)
    lse = (mx.log(total) + peak).squeeze(-1)
    return out.reshape(B, Hq, Lq, D), lse.reshape(B, Hq, Lq)


def attention_with_tail(
    q: mx.array,
    k_enc: Dict[str, mx.array],
    v_enc: Dict[str, mx.array],
    k_spec: Spec,
    v_spec: Spec,
    scale: float,
    tail,
    hidden: int = 0,
) -> mx.array:
    """What the CUDA launch answers with a tail: attention over the coded tier (but its
    first `hidden` tokens) and the dense (k, v) tiers of `tail` together, in q's dtype."""
    k = mx.concatenate([k for k, _ in tail], axis=2)
    v = mx.concatenate([v for _, v in tail], axis=2)
    parts = [
        affine_partial_attention(q, k_enc, v_enc, k_spec, v_spec, scale, hidden),
        partial_attention(q, k, v, scale),
    ]
    return merge_partials(parts).astype(q.dtype)
