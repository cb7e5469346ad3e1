"""`rocket`: RocketKV (Behnam et al., ICML 2025, arXiv:2502.14051), two stages.

Stage 1 is SnapKV (this route's budget, window, pool, sinks): once, at the end
of the prompt, each head keeps its `budget` tokens. Stage 2 deletes nothing:
each decode step the real query picks, per kv head, the `tokens` survivors
that get exact attention (Hybrid Sparse Attention): its top `channels`
channels read the per-page max/min key summaries (pages of `page` held
tokens) to rank pages, then those channels of the keys in the best pages rank
tokens. The page summaries are real arrays, counted in the bytes.
tokens=0 turns stage 2 off: SnapKV exactly.
"""

import attrs

from .evict import Snap
from .registry import in_range, stage


@stage("rocket", "route", needs=("attention",))
@attrs.frozen
class Rocket(Snap):
    """SnapKV once, then each decode step exact attention over the `tokens` survivors the query's top channels pick."""

    tokens: int = attrs.field(default=64, validator=in_range(0, 1 << 24))
    page: int = attrs.field(default=16, validator=in_range(1, 1 << 12))
    channels: int = attrs.field(default=16, validator=in_range(1, 1 << 12))

    tier_kind = "sparse_decode"

    def explain_decode(self) -> str:
        if not self.tokens:
            return "stage 2 off: attends to every survivor (SnapKV)"
        return (
            f"each decode step attends exactly to {self.tokens} survivors per kv head, picked by the query's top "
            f"{self.channels} channels over pages of {self.page} (max/min key summaries: 2 keys per page held)"
        )

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        if self.tokens and self.tokens < self.page:
            raise ValueError(f"tokens={self.tokens} must be at least one page ({self.page}), or 0 (stage 2 off)")
