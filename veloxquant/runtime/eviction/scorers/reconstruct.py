"""KVzip (Kim et al., NeurIPS 2025, arXiv:2505.23416): a token matters as much as
the model needs it to reconstruct the context.

Once, at the end of the prompt, the cache side runs the model (runtime/
model_pass.py) on a repeat prompt per chunk of `chunk` context tokens, as the
paper's code does (and kvpress's KVzipPress, for a model without a chat
template): the first chunk after "\\n\\nRepeat the previous context exactly.",
later ones after "\\n\\nRepeat the part of the previous context exactly, starting
with" plus the previous chunk's last 8 tokens; then "\\n" and the chunk itself,
teacher-forced. No chat template: the cache cannot know where a chat turn
would open around a raw context, and the eval's contexts are raw text.

Score of a context token = the largest softmax weight any repeat query gives it
(max over the queries and over the query heads of its kv head's GQA group),
where, as in the paper, that softmax runs over the sinks, the chunk being
repeated and the repeat's own tokens (the layer's output still attends to
everything, as the model does). Each chunk scores its own tokens.
"""

import mlx.core as mx

from ..scoring import attention_weights, block_size, position_mask
from .base import Scorer, scorer

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
SUFFIX = "\n"
OVERLAP = 8  # tokens of the previous chunk that say where a later chunk starts (the paper's prev_postfix_size)
SCORE_BYTES = 16 * 2**20  # one block's float32 weights at most


@scorer("reconstruct")
class Reconstruct(Scorer):
    texts = (FIRST, LATER, SUFFIX)
    pass_bytes = None  # the model pass's recorded prompt ids, counted in the first layer (model_pass.attach)

    def passes(self, context: mx.array, ids):
        """(tokens [B, n], (start, end) of the context chunk they repeat), one per chunk."""
        B, L = context.shape
        step = self.route.chunk
        as_ids = lambda text: mx.broadcast_to(mx.array(ids[text], mx.int32)[None], (B, len(ids[text])))
        for s in range(0, L, step):
            head = (
                as_ids(FIRST)
                if s == 0
                else mx.concatenate([as_ids(LATER), context[:, max(0, s - OVERLAP) : s].astype(mx.int32)], axis=1)
            )
            chunk = context[:, s : s + step].astype(mx.int32)
            yield mx.concatenate([head, as_ids(SUFFIX), chunk], axis=1), (s, s + chunk.shape[1])

    def listen(self, tier, look, span) -> None:
        start, end = span
        sinks = self.route.sinks
        if look.run:  # columns are positions: score only the sinks, the chunk and the repeat (fewer keys)
            p0, n = tier.first, look.keys.shape[2] - look.held
            ns = max(0, min(sinks, start) - p0)
            a, b = start - p0, min(end, tier.first + tier.count) - p0
            cols = mx.concatenate([mx.arange(ns), mx.arange(a, b), mx.arange(look.held, look.held + n)])
            keys, kpos = mx.take(look.keys, cols, axis=2), mx.take(look.positions, cols, axis=2)
            best = _max_weights(
                look.queries, keys, look.scale, lambda s, m: position_mask(kpos, look.first_q + s, m, None)
            )
            old = tier.scores
            tier.set_scores(mx.concatenate([old[..., :a], best[..., ns : ns + b - a], old[..., b:]], axis=-1))
            return
        kpos = look.positions
        # The score's softmax: sinks, the chunk being repeated, and the repeat's own tokens.
        index = mx.arange(kpos.shape[-1])
        counted = ((kpos < sinks) | ((kpos >= start) & (kpos < end)) | (index >= look.held))[:, :, None, :]
        best = _max_weights(look.queries, look.keys, look.scale, lambda s, m: look.mask_for(s, m) & counted)
        pos = tier.positions
        tier.set_scores(mx.where((pos >= start) & (pos < end), best[..., look.where], tier.scores))

    @property
    def nbytes(self) -> int:
        return 0 if self.pass_bytes is None else self.pass_bytes.nbytes


def _max_weights(queries: mx.array, keys: mx.array, scale: float, mask_for) -> mx.array:
    """[B, Hkv, keys]: the largest weight each key gets from any query and any query head of its group,
    a block of queries at a time (ordered, so one block's weights exist at once)."""
    Lq = queries.shape[2]
    block = block_size(queries.shape[1], keys.shape[2], Lq, SCORE_BYTES)
    best = None
    for s in range(0, Lq, block):
        q = queries[:, :, s : s + block]
        if best is not None:
            q = mx.depends(q, [best])
        w = mx.max(attention_weights(q, keys, scale, mask_for(s, q.shape[2])), axis=(2, 3))
        best = w if best is None else mx.maximum(best, w)
    return best
