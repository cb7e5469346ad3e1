"""`reconstruct`: KVzip (Kim et al., NeurIPS 2025, arXiv:2505.23416), query-agnostic eviction.

Once, at the end of the prompt, the model itself is asked to repeat the
context: a "Repeat the previous context exactly." instruction, then the
context's own tokens teacher-forced as the answer, in chunks of `chunk`
tokens. That pass runs after what every layer holds (the cache side drives
it: runtime/eviction/model_pass.py) and its own K/V are discarded. A context token's
score is the most attention any repeat query pays it (max over the queries
and over the query heads of its kv head's GQA group); each kv head keeps its
`budget` best, the first `sinks` positions always. Tokens after the decision
are appended and never evicted, so the scores serve every later query.

recent: the newest prompt tokens kept whatever their score. The paper
compresses the context before the question arrives; when the question is the
end of the same prompt (a passkey prompt, a chat turn), `recent` keeps it
whole instead of letting the repeat pass rank its words like context.

probe=latest replaces the repeat pass by the newest real query's weights, every
step: TOVA, bit for bit.
"""

import attrs

from .evict import HEAD_RULES, LAYER_RULES, _PerHeadRoute, _room_after_protected, _sinks_below_budget
from .registry import choices, in_range, stage


@stage("reconstruct", "route", needs=("attention",))
@attrs.frozen
class Reconstruct(_PerHeadRoute):
    """KVzip: once, at the end of the prompt, keeps per head the tokens a "repeat the context" model pass
    attends to most.

    probe: context (one repeat pass through the model, chunked by `chunk`
    context tokens; max attention each token receives) or latest (the newest
    real query's weights every step: TOVA).
    layers, strength, heads, alpha: budget allocation, as for `evict`
    (heads=score: kv heads compete on the repeat scores, as the paper's
    non-uniform head budgets do).
    """

    budget: int = attrs.field(default=256, validator=in_range(1, 1 << 24))
    sinks: int = attrs.field(default=4, validator=[in_range(0, 1 << 20), _sinks_below_budget])
    recent: int = attrs.field(default=0, validator=in_range(0, 1 << 24))
    probe: str = attrs.field(default="context", validator=choices("context", "latest"))
    chunk: int = attrs.field(default=2048, validator=in_range(16, 1 << 20))
    layers: str = attrs.field(default="fixed", validator=choices(*LAYER_RULES))
    strength: float = attrs.field(default=0.0, validator=in_range(0.0, 16.0))
    heads: str = attrs.field(default="equal", validator=choices(*HEAD_RULES))
    alpha: float = attrs.field(default=0.2, validator=in_range(0.0, 1.0))

    @property
    def once(self) -> bool:
        return self.probe == "context"  # the paper scores the context once; TOVA evicts every step

    @property
    def score(self) -> str:
        return "reconstruct" if self.probe == "context" else "current"

    @property
    def runtime_needs(self):
        return ("model_pass",) if self.probe == "context" else ()

    @property
    def floor(self) -> int:
        return self.sinks + self.recent + 1

    def __attrs_post_init__(self):
        _room_after_protected(self)

    def explain_pass(self) -> str:
        if self.probe != "context":
            return "probe=latest: scored by the newest real query's weights every step (TOVA)"
        return (
            f"once, at the end of the prompt, the cache side runs the model on 'Repeat the previous context "
            f"exactly.' + the context (chunks of {self.chunk} tokens) after what each layer holds "
            "(runtime/eviction/model_pass.py); score = max attention a context token receives from those repeat "
            "queries (over the queries and its GQA group); the pass's own K/V are discarded"
        )
