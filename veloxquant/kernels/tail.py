"""Which 16-bit tiers a kernel answer folds into its merge: the CUDA kernels' reduce_tail and
MLX's own kernels (mlx_affine.attention_with_tail) both take the layer's dense tiers (at most
two, every token visible) with the coded tier, so the runtime asks this one scope for either
(runtime/fused.py) without loading a kernel's binding.
"""

import mlx.core as mx

TAIL_MAX = 512  # dense tokens reduce_tail scores in shared memory (its XMAX)
FLOATS = (mx.float16, mx.bfloat16, mx.float32)  # the float dtypes the fused kernels read and write


def tail_unsupported(qshape: tuple, tail) -> str:
    """Why reduce_tail cannot fold these dense tiers into the reduce ('' when it can)."""
    if not 1 <= len(tail) <= 2:
        return "reduce_tail: one or two dense tiers"
    B, Hq, Lq, D = qshape
    if sum(k.shape[2] for k, _ in tail) > TAIL_MAX:
        return f"reduce_tail: more than {TAIL_MAX} dense tokens"
    for k, v in tail:
        if k.dtype not in FLOATS or v.dtype != k.dtype or k.dtype != tail[0][0].dtype:
            return "reduce_tail: dense tiers of one float dtype"
        if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or Hq % k.shape[1]:
            return "reduce_tail: dense tier shapes"
    return ""
