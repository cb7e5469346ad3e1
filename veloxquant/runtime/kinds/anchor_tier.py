"""The anchor tier kind (AnchorKV): K and/or V as anchors + (index, coefficient) + residuals where they matter.

Everything but the end of the prompt is the latent tier's shape (place, drop,
hold, one partial from the sides' scores and combine), so it is inherited. What
is its own: the prompt's last WINDOW query positions are kept (scaled, as they
attend), and at the end of the prompt they rank the tokens with real attention
-- in blocks of queries, never [heads x prompt x prompt]:

  mass_t            = sum_q a_qt                         (anchor choice: heavy hitters)
  value residual    : |d out| ~ sum_q a_qt |r_t|          = mass_t |r_t|
  key residual      : |d out| ~ sum_q a_qt |q·r_t| |v_t - o_q|

(d out/d s_t = a_t (v_t - o) is the softmax's first-order response to an error
q·r_t in token t's score.) Without queries (no attention hook, or a prompt too
short for this tier to be attended before it ended) every token weighs the same.
"""

import mlx.core as mx

from ...compiler.plan import TierPlan
from ...kernels.partials import Partial, partial_from_scores
from .anchor_side import AnchorSide
from .latent_side import PlainSide
from .latent_tier import LatentTier
from .protocol import kind

WINDOW = 32  # query positions (each with its GQA group) that rank the prompt's tokens
BLOCK = 8  # query rows per block of attention when ranking
QUERY_BLOCK = 256  # query positions per block of a prefill chunk


@kind("anchor")
class AnchorTier(LatentTier):
    def __init__(self, plan: TierPlan, n_kv_heads: int, head_dim: int):
        self.plan, self.route, self.n_kv_heads = plan, plan.route, n_kv_heads
        self.launch_key, self.launch = None, None
        self.sides = {
            side: (AnchorSide if getattr(codec.store, "tier_kind", None) == "anchor" else PlainSide)(
                codec, n_kv_heads, head_dim
            )
            for side, codec in (("k", plan.keys), ("v", plan.values))
        }
        self.start = self.count = 0

    @property
    def token_group(self) -> int:
        return 1

    def partial(self, queries: mx.array, scale: float, mask=None) -> Partial:
        B, Hq, Lq, D = queries.shape
        q = (queries.astype(mx.float32) * scale).reshape(B, self.n_kv_heads, (Hq // self.n_kv_heads) * Lq, D)
        if isinstance(self.sides["k"], AnchorSide):
            self.sides["k"].observe(q, Lq, WINDOW)
        if Lq <= QUERY_BLOCK:
            return partial_from_scores(self.sides["k"].scores(q), mask, Lq, self.sides["v"].combine)
        # A prefill chunk: QUERY_BLOCK query positions at a time, never [heads x chunk x tokens] at once.
        q = q.reshape(B, self.n_kv_heads, Hq // self.n_kv_heads, Lq, D)
        parts = []
        for s in range(0, Lq, QUERY_BLOCK):
            qb = q[:, :, :, s : s + QUERY_BLOCK]
            n = qb.shape[3]
            rows = mask if mask is None or mask.ndim < 2 or mask.shape[-2] != Lq else mask[..., s : s + n, :]
            parts.append(
                partial_from_scores(
                    self.sides["k"].scores(qb.reshape(B, self.n_kv_heads, -1, D)), rows, n, self.sides["v"].combine
                )
            )
        return mx.concatenate([o for o, _ in parts], axis=2), mx.concatenate([l for _, l in parts], axis=2)

    def _window(self):
        k = self.sides["k"]
        w = getattr(k, "window", None)
        return None if w is None else w.reshape(w.shape[0], w.shape[1], -1, w.shape[-1])  # [B, H, rep*W, D]

    def finish_prompt(self) -> None:
        sides = [s for s in self.sides.values() if isinstance(s, AnchorSide)]
        if not self.count or all(s.fitted for s in sides):
            return
        keys, values = (s.decoded(mx.float32) for s in (self.sides["k"], self.sides["v"]))
        q = self._window()
        B, H, L, _ = keys.shape
        if q is None:
            mass = mx.ones((B, H, L), mx.float32)
            rank = {"k": lambda r: mx.sum(r * r, axis=-1), "v": lambda r: mx.sum(r * r, axis=-1)}
        else:
            mass = mx.zeros((B, H, L), mx.float32)
            blocks = []
            for s in range(0, q.shape[2], BLOCK):
                a = mx.softmax(q[:, :, s : s + BLOCK] @ keys.swapaxes(-1, -2), axis=-1)  # [B, H, b, L]
                mass = mass + mx.sum(a, axis=2)
                blocks.append((q[:, :, s : s + BLOCK], a, a @ values))
            v_sq = mx.sum(values * values, axis=-1)[:, :, None]  # [B, H, 1, L]

            def key_error(r: mx.array) -> mx.array:
                total = mx.zeros((B, H, L), mx.float32)
                for qb, a, o in blocks:
                    # |v_t - o_q| for every (q, t) of the block, from one product: [B, H, b, L]
                    apart = mx.sqrt(
                        mx.maximum(
                            v_sq - 2 * (o @ values.swapaxes(-1, -2)) + mx.sum(o * o, axis=-1, keepdims=True), 0.0
                        )
                    )
                    total = total + mx.sum(a * mx.abs(qb @ r.swapaxes(-1, -2)) * apart, axis=2)
                return total

            rank = {"k": key_error, "v": lambda r: mass * mx.linalg.norm(r, axis=-1)}
        for name, s in self.sides.items():
            if isinstance(s, AnchorSide) and not s.fitted:
                s.finish_prompt(mass, rank[name])
