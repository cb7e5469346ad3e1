"""The scorer protocol and registry (the package doc says what a scorer is)."""

from typing import Callable, Dict, Optional, Tuple

import attrs
import mlx.core as mx

from ....stages.scorers import SPECS

SCORERS: Dict[str, type] = {}


def scorer(name: str):
    def register(cls):
        if name in SCORERS:
            raise ValueError(f"scorer '{name}' registered twice")
        if name not in SPECS:
            raise ValueError(f"scorer '{name}' is not declared in stages/scorers.py")
        cls.name = name
        cls.spec = SPECS[name]
        cls.needs = SPECS[name].needs
        SCORERS[name] = cls
        return cls

    return register


@attrs.define
class Seen:
    """What one attention step showed a tier (its own token slice where per token)."""

    first_q: int  # position of the first query
    received: Optional[mx.array] = None  # [B, H, L] attention from all this step's queries
    rows: Optional[mx.array] = None  # [B, H, R, L] from the newest R queries, each summed over its group
    queries: Optional[mx.array] = None  # [B, Hq, Lq, D]
    new_keys: Optional[mx.array] = None  # [B, Hkv, n, D]
    weigh: Optional[Callable] = None  # weigh(queries, first_q) -> received [B, H, L] over this tier


class Scorer:
    """The protocol, with the defaults most scorers keep."""

    name = "?"
    needs: frozenset = frozenset()
    rows = 1  # with "weights": how many newest query rows it wants per token
    token_state: Dict[str, Tuple[int, ...]] = {}  # extra per-token arrays: name -> trailing shape

    spec = None  # its declaration (stages/scorers.py), set by @scorer

    def __init__(self, route):
        self.route = route
        if self.spec is not None:
            self.token_state = self.spec.token_state(route)

    def initial(self, keys: mx.array) -> mx.array:
        """Score of tokens as they arrive [B, H, n]."""
        return mx.zeros(keys.shape[:3], mx.float32)

    def observe(self, tier, seen: Seen) -> None:
        pass

    def priority(self, tier, offset: int, weigh: Optional[Callable]) -> mx.array:
        """[B, H, L]: the tier keeps the highest. `weigh` as in Seen (None while decoding)."""
        return tier.scores

    def keep_window(self, seen: "Seen", window: int) -> mx.array:
        """The newest `window` queries seen so far, as their own compact array. A slice would keep the
        whole block it came from alive, and a lazy concatenation every earlier block (prefill's peak
        grew by every chunk's queries in every layer); scorers keeping one list it in state() so
        generate's per-chunk eval of the cache's state computes it."""
        new = seen.queries[:, :, -window:]
        old = getattr(self, "queries", None)
        if old is not None and new.shape[2] < window:
            new = mx.concatenate([old[:, :, -(window - new.shape[2]) :], new], axis=2)
        kept = mx.contiguous(new)
        # Computed as soon as the device reaches it, not when the prefill step ends: until then the
        # lazy copy holds the whole block of queries it was cut from, in every layer at once.
        mx.async_eval(kept)
        return kept

    def state(self) -> Dict[str, mx.array]:
        """Per-head arrays a saved cache must carry to keep ranking the same way (not per token)."""
        return {}

    def load(self, arrays: Dict[str, mx.array]) -> None:
        pass

    def release(self) -> None:
        """The decision is made (once routes): drop what was only kept to make it."""

    def rewind(self, n: int) -> None:
        """The cache was trimmed by n positions: forget what the newest n queries told us.
        Scorers that keep a window of queries (`window`, `expected`) drop its newest n rows."""
        queries = getattr(self, "queries", None)
        if queries is not None:
            keep = queries.shape[2] - n
            self.queries = queries[:, :, :keep] if keep > 0 else None
            if hasattr(self, "end"):
                self.end -= n

    @property
    def nbytes(self) -> int:
        return 0

    # --- batch rows (runtime/eviction/batch_heads.py). A scorer whose state lives in the tier's per-token
    # arrays (mass, current, mean, knorm, keydiff) needs nothing more; one keeping per-row arrays of its
    # own (window) overrides these.
    def observe_rows(self, tier, seen: Seen, listening, real) -> None:
        """observe, for the rows `listening` [B] only (`real` [B]: each row's real columns of the block;
        both host arrays)."""
        before = tier.scores
        self.observe(tier, seen)
        if not listening.all():
            tier.set_scores(mx.where(mx.array(listening)[:, None, None], tier.scores, before))

    def stack(self, parts: list, rows: list) -> None:
        """This scorer's state becomes that of `parts` (scorers of `rows` rows each), one after the other."""

    def keep_rows(self, rows) -> None:
        """Only the given rows' state stays (`rows`: host indices)."""

    def take_row(self, batch: "Scorer", i: int) -> None:
        """This one-sequence scorer takes row i of a batch's state."""

    def release_rows(self, rows) -> None:
        """The rows [B] (host bools) have decided: their state is let go."""


class QueryWindowScorer(Scorer):
    """A scorer that keeps the newest real queries (`self.queries`, see keep_window) until it
    decides: they are its saved state and its bytes, and are dropped once it has decided."""

    queries: Optional[mx.array] = None

    def state(self):
        return {} if self.queries is None else {"queries": self.queries}  # evaluated with the cache's state

    def load(self, arrays):
        self.queries = arrays.get("queries")

    def release(self):
        self.queries = None

    @property
    def nbytes(self):
        return 0 if self.queries is None else self.queries.nbytes


def observers(tier, offset: int) -> mx.array:
    """How many queries have seen each held token (causal: every position from its own on)."""
    return (offset - tier.positions).astype(mx.float32)
