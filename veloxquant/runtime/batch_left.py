"""Left-padded prompts in the tier layouts' batches (chains, eviction rows), read as right-padded ones.

mlx-vlm's BatchGenerator (its batch_generate and its server) pads a batch's prompts on the left and asks
each cache its model's make_cache() made for `to_batch(left_padding)`; mlx-lm's BatchGenerator pads them on
the right while they are processed (prepare/finalize). A chain or eviction batch keeps every row from
column 0 and reads a right-padded block's first `real` columns as the row's tokens
(runtime/batch_chain.py, runtime/eviction/batch_heads.py). A left-padded block is that block with each
row rolled left by the padding it still holds: keys and values are rolled before the layout places them
and queries before it attends; the attention output is rolled back, so the model's columns stay its own.
Padding is never placed, kept, coded or scored, as in a right-padded prompt.

RoPE reads `cache.offset`: a row's offset is the positions it has seen less the padding still to come
(BatchKVCache's convention), so its first real token is at position 0. The padding still to come is a
host array per row (`cache.lead`); None once it is all fed.
"""

from typing import Optional

import mlx.core as mx
import numpy as np

from ..errors import VeloxError


def to_batch(cache, left_padding, merge, blank):
    """An empty batch cache of `cache`'s layer, its rows left-padded (mlx-vlm asks the caches its model's
    make_cache() made for this; BatchKVCache(left_padding) is its 16-bit one). Each row records its own
    image tokens (runtime/eviction/protected.py), none yet."""
    blanks = [blank(cache) for _ in left_padding]
    for b in blanks:
        b.protected = cache.protected
    batch = merge(blanks)
    batch.prepare(left_padding=list(left_padding))
    return batch


def _roll(x: mx.array, shift: np.ndarray, back: bool = False) -> mx.array:
    """Row b of x [B, H, n, D] rolled left by shift[b] columns along the tokens (right if `back`)."""
    n = x.shape[2]
    cols = np.arange(n)[None] + (-shift if back else shift)[:, None]
    idx = mx.array(cols % n, dtype=mx.int32)[:, None, :, None]
    return mx.take_along_axis(x, mx.broadcast_to(idx, (x.shape[0], x.shape[1], n, x.shape[3])), axis=2)


def _shifts(cache, n: int) -> Optional[np.ndarray]:
    """The padding columns that lead each row of an n-token block (None: no row has any left)."""
    return None if cache.lead is None else np.minimum(cache.lead, n)


def _reoffset(cache) -> None:
    lead = cache.lead
    if lead is not None and not lead.any():
        cache.lead = lead = None
    if lead is not None:
        cache.offset = cache.offset - mx.array(lead, dtype=mx.int32)


def padded(layout):
    """`layout` (runtime/batch.py's Layout of a tier batch) taking left-padded prompts too."""

    def prepare(cache, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None and max(left_padding) > 0:
            if not cache.empty() or cache.lead is not None:
                raise VeloxError("left padding can only be added to an empty batch cache")
            cache.lead = np.array(left_padding, dtype=np.int64)
            _reoffset(cache)
            left_padding = None
        layout.prepare(cache, left_padding, lengths, right_padding)

    def update_and_fetch(cache, keys, values):
        shift = cache.shift = _shifts(cache, keys.shape[2])  # every attention call of this block reads it
        if shift is None:
            return layout.update_and_fetch(cache, keys, values)
        cache.rows.pending = keys.shape[2] - shift  # this block's real columns, first once rolled
        out = layout.update_and_fetch(cache, _roll(keys, shift), _roll(values, shift))
        cache.rows.pending = None
        cache.lead = cache.lead - shift
        _reoffset(cache)
        return out

    def make_mask(cache, n, window_size=None):
        shift = _shifts(cache, n)
        if shift is None:
            return layout.make_mask(cache, n, window_size)
        cache.rows.pending = n - shift
        mask = layout.make_mask(cache, n, window_size)
        cache.rows.pending = None
        return mask if mask is None else _roll(mask, shift, back=True)  # queries in the model's own columns

    def attend(cache, queries, scale, mask):
        shift = cache.shift
        if shift is None:
            return layout.attend(cache, queries, scale, mask)
        return _roll(layout.attend(cache, _roll(queries, shift), scale, mask), shift, back=True)

    def filter(cache, keep):
        layout.filter(cache, keep)
        if cache.lead is not None:
            cache.lead = cache.lead[np.array(keep, dtype=np.int64)]
            _reoffset(cache)

    def extend(cache, other):
        if cache.lead is not None or other.lead is not None:
            raise VeloxError("a batch joins another once their prompts' left padding is fed")
        layout.extend(cache, other)

    return layout._replace(
        prepare=prepare,
        update_and_fetch=update_and_fetch,
        make_mask=make_mask,
        attend=attend,
        filter=filter,
        extend=extend,
    )
