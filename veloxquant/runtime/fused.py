"""A plain affine tier's attention by the fused CUDA kernel (kernels/cuda.py), or where none
is verified, by MLX's own quantized matmul (kernels/mlx_affine.py), which answers alike.

`kernel_answer` is what `Tier.answer` returns where a verified kernel takes
the call: the partial from the tier's codes, and where the layer's other tiers
are 16-bit and visible to every query, the final output with those tiers
folded into the kernel's reduce (`reduce_tail`: two launches for the layer).
The launch parameters are resolved once per (tier length, query shape) and
kept on the tier; a decode step only calls them.
"""

from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..kernels import dispatch
from ..kernels.tail import TAIL_MAX, tail_unsupported
from . import row_index


class KernelAnswer:
    """A tier's answer from the kernel: `()` -> partial (out f32, lse), `(tail)` -> final output.
    `hidden`: tokens hidden at the tier's front, or each batch row's visible span (`rows_answer`)."""

    __slots__ = ("run", "queries", "k_enc", "v_enc", "hidden")
    folds_tail = True  # TieredCache hands it the layer's 16-bit tiers when they are all it has besides

    def __init__(self, run, queries, k_enc, v_enc, hidden=0):
        self.run, self.queries, self.k_enc, self.v_enc, self.hidden = run, queries, k_enc, v_enc, hidden

    def __call__(self, tail=None):
        return self.run(self.queries, self.k_enc, self.v_enc, tail, self.hidden)


def kernel_answer(tier, queries: mx.array, scale: float, encoded=None, hidden: int = 0) -> Optional[KernelAnswer]:
    """The kernel's answer for this (unmasked, plain affine) tier, or None where no verified kernel applies.
    `encoded(side)`: the affine arrays (codes, scales, zeros) the kernel reads; the tier's own by default.
    `hidden`: tokens at the tier's front the queries do not see (Tier.answer)."""
    encoded = encoded or tier.encoded
    # Decided once per (tier length, query shape): every layer asks again each step.
    key = (tier.count, queries.shape, queries.dtype, scale, hidden > 0)
    if tier.launch_key != key:
        launch = _launcher(tier, queries, encoded("k"), encoded("v"), scale, hidden > 0)
        tier.launch_key, tier.launch = key, launch
    if tier.launch is None:  # decoded (the CPU): the arrays are not asked for
        return None
    return KernelAnswer(tier.launch, queries, encoded("k"), encoded("v"), hidden)


def rows_answer(tier, queries: mx.array, scale: float, counts: np.ndarray) -> Optional[KernelAnswer]:
    """A ragged batch's answer for this plain affine tier (runtime/batch_chain.py): row b sees the
    first counts[b] of the tier's columns. One launch for every row (each row's span an input: the
    kernel skips the chunks past it), or None where no kernel takes the call (decoded)."""
    key = ("rows", tier.ragged_width(), queries.shape, queries.dtype, scale)
    if tier.launch_key != key:
        k_enc, v_enc = tier.encoded("k"), tier.encoded("v")
        tier.launch_key, tier.launch = key, _launcher(tier, queries, k_enc, v_enc, scale, True, batch_rows=True)
    if tier.launch is None:
        return None
    spans = row_index.shared(
        ("spans", counts.tobytes()),
        lambda: mx.array(np.stack([np.zeros_like(counts), counts], axis=1).astype(np.int32)),
    )
    return KernelAnswer(tier.launch, queries, tier.encoded("k"), tier.encoded("v"), spans)


def _launcher(tier, queries, k_enc, v_enc, scale, hides: bool, batch_rows: bool = False):
    """The launch (`run`) for this call's shapes, or None (the tier is decoded)."""
    k_spec, v_spec = tier.plan.keys.store, tier.plan.values.store
    impl = dispatch.choice(queries, k_enc, v_enc, k_spec, v_spec, scale, batch_rows)[0]
    shapes = (tuple(queries.shape), queries.dtype, tuple(k_enc["codes"].shape), k_spec, v_spec, scale)
    if impl == "cuda":
        return dispatch.cuda_launcher(*shapes, hides=hides)
    return None if impl == "reference" else dispatch.mlx_launcher(impl, *shapes)  # MLX's own kernels


def tail(rest: List, queries: mx.array, dtype, layouts: dict):
    """The 16-bit tiers `rest` (every token visible to every query: the caller checked) as
    (k, v) views for the kernel's reduce, or None where it cannot fold them.

    `layouts`: the cache's verdicts per (query shape, dtype, tier count): the dense tiers'
    heads, head_dim and dtype are the model's, so a layout checked once holds for the
    cache's life (only the token count changes, checked here every call)."""
    held = 0
    for t in rest:  # one pass: a decode step asks this for every layer
        if not t.sixteen_bit:
            return None
        held += t.count
    if held > TAIL_MAX:
        return None
    views = [t.decoded(dtype) for t in rest]
    key = (queries.shape, dtype, len(rest))
    if key not in layouts:
        layouts[key] = tail_unsupported(tuple(key[0]), views)
    return None if layouts[key] else views
