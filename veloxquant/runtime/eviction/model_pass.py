"""A model pass driven by the cache side: once the prompt is over, the caches run
the model on tokens of their own choosing, after everything each layer holds,
and leave the model and every layer cache as they were; only the scorers that
listened keep what they learnt. KVzip's "repeat the context" probe is the first
user (runtime/eviction/scorers/reconstruct.py); any scorer that declares the need
"model_pass" gets one.

What it takes:
- the model, reached through the coordinator (a weak reference: caches do not
  keep a model alive), attached by make_prompt_cache;
- the prompt's token ids: mlx-lm hands caches keys and values, never tokens,
  so the model class's __call__ is wrapped (reversibly, as the attention hook
  rebinds attention) to record the ids fed through caches that have a pass to
  run, aligned with positions (a trimmed and re-fed prompt records what it is
  now); they are dropped once the pass has run;
- the texts a scorer asks for, tokenized once when the caches are made (the
  tokenizer is passed to make_prompt_cache, or remembered by load_model).

During the pass every layer's cache is replaced by a PassView: the layer's held
K/V are read (never written), the pass's own K/V live only until that layer's
attention is answered, and attention is computed a block of queries at a time
(never [heads x queries x keys] for the whole pass). The logits are never
evaluated, so the LM head is never computed; each layer's output and scores
are evaluated as the layer ends, so one layer's transients exist at a time.
"""

import weakref
from typing import Callable, Dict, List, Optional

import attrs
import mlx.core as mx

from ...errors import VeloxError
from ...models.tokenizers import tokenizer_of
from . import per_head
from .call_watch import CallWatch
from .scoring import attend_blocked, block_size, position_mask

NEED = "model_pass"
_WATCH = CallWatch()  # the model classes whose calls are watched


def _encode(tokenizer, text: str) -> List[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))  # the instruction alone, no BOS
    except TypeError:
        return list(tokenizer.encode(text))


class ModelPass:
    """The coordinator's handle on the model, the prompt's token ids and the tokenized texts."""

    def __init__(self, model, texts: Dict[str, List[int]]):
        self.model = weakref.ref(model)  # deep copies share it (weakrefs copy as themselves)
        self.texts = texts
        self.fed: List[tuple] = []  # (first position, ids [B, n] or None when fed as embeddings)
        self.done = False
        self.ran: Dict[str, object] = {}  # what the pass fed (run --json reports it)

    def record(self, offset: int, inputs: Optional[mx.array]) -> None:
        if self.done:
            return
        self.fed = [(s, t) for s, t in self.fed if s < offset]  # a rewind (trim) forgets the newer ids
        if self.fed and self.fed[-1][1] is not None and self.fed[-1][0] + self.fed[-1][1].shape[1] > offset:
            s, t = self.fed[-1]
            self.fed[-1] = (s, t[:, : offset - s])
        self.fed.append((offset, None if inputs is None else inputs.reshape(-1, inputs.shape[-1])))

    def context(self, length: int) -> mx.array:
        """The ids of positions [0, length), or a clear error when some never came through __call__."""
        at, parts = 0, []
        for s, t in self.fed:
            if s != at or t is None:
                break
            parts.append(t[:, : length - at])
            at += parts[-1].shape[1]
            if at >= length:
                break
        if at < length:
            raise VeloxError(
                f"the model pass needs the prompt's token ids, but only the first {at} of its {length} "
                "positions came through the model as ids (fed as embeddings, or straight to the "
                "layers?): feed token ids with model(tokens, cache=caches)"
            )
        return mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    @property
    def nbytes(self) -> int:
        return 0 if self.done else sum(t.nbytes for _, t in self.fed if t is not None)


def needs_pass(tier) -> bool:
    return NEED in tier.needs and tier.listening


def attach(model, caches, tokenizer=None) -> None:
    """Give the model's coordinator a pass, if a tier asks for one (make_prompt_cache calls this)."""
    coordinator = getattr(caches[0], "coordinator", None) if caches else None
    tiers = [t for c in caches for t in c.tiers if needs_pass(t)]
    if coordinator is None or not tiers:
        return
    tokenizer = tokenizer or tokenizer_of(model)
    texts = sorted({text for t in tiers for text in t.scorer.texts})
    if texts and tokenizer is None:
        raise VeloxError(
            f"recipe '{caches[0].plan_root.recipe}' runs a model pass whose prompt must be tokenized: "
            "pass the tokenizer (veloxquant.make_prompt_cache(model, recipe, tokenizer=tokenizer)), or "
            "load the model with veloxquant.models.load_model"
        )
    coordinator.model_pass = ModelPass(model, {text: _encode(tokenizer, text) for text in texts})
    tiers[0].scorer.pass_bytes = coordinator.model_pass  # the recorded ids count once, in the first layer
    install(model)


def run(coordinator, ending: bool = True) -> None:
    """Run the pass the listening scorers ask for, if any tier will evict (the coordinator calls this
    once, at the end of the prompt, before budgets are decided). `ending`: the prompt is over whatever
    happens here, so stop recording ids (False: a bench scoring early, before it forks the caches)."""
    caches = coordinator.caches
    driver = getattr(coordinator, "model_pass", None)
    if driver is not None and driver.done:
        return  # once per prompt
    for c in caches:
        c._settle()
    pending = [(c, t) for c in caches for t in c.tiers if needs_pass(t)]
    if not pending or not any(t.over() for _, t in pending):
        if driver is not None and ending:
            driver.done, driver.fed = True, []  # the prompt fits the budgets: nothing to score, ever
        return
    if driver is None or driver.model() is None:
        raise VeloxError(
            "these caches need a model pass at the end of the prompt, but no model is attached: "
            "make them with veloxquant.make_prompt_cache(model, recipe)"
        )
    model, scorer = driver.model(), pending[0][1].scorer
    context = driver.context(caches[0].offset)
    fed = []
    for tokens, note in scorer.passes(context, driver.texts):
        views = [PassView(c, [t for d, t in pending if d is c], note) for c in caches]
        model(tokens, cache=views)  # logits never evaluated: only what the scores depend on is computed
        mx.eval([t.scores for _, t in pending])
        fed.append(tokens.shape[1])
    driver.done, driver.fed = True, []
    driver.ran = {"scorer": scorer.name, "context_tokens": context.shape[1], "chunks": len(fed), "tokens_fed": sum(fed)}


@attrs.define
class Look:
    """What one layer of the pass showed a listening tier."""

    queries: mx.array  # [B, Hq, n, D] the pass's queries at positions first_q..
    keys: mx.array  # [B, Hkv, held + n, D] float32: the layer's held keys, then the pass's own
    positions: mx.array  # [B, Hkv, held + n]
    first_q: int
    scale: float
    mask_for: Callable  # (s, n) -> [B, Hkv, n, held + n]: causal and windowed, as the model attends
    where: slice  # this tier's keys among them
    held: int  # keys before the pass's own
    run: bool  # the tier alone is held, every head the same contiguous positions, no window: columns are positions


class PassView:
    """One layer's cache as the pass sees it: everything held, read only, then the pass's own tokens."""

    def __init__(self, cache, tiers: List, note):
        self.cache, self.tiers, self.note = cache, tiers, note
        self.offset = cache.offset
        self.pending = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.pending = (keys, values, self.offset)
        self.offset += keys.shape[2]
        return keys, values  # unused: the hook routes attention to attend()

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return None  # unused: attend() masks by position

    def attend(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        keys, values, first = self.pending
        self.pending = None  # the pass's own K/V live no longer than this layer's attention
        cache = self.cache
        B, H, n, _ = keys.shape
        held = cache.held()
        # Every head holds one run of positions ending where the pass begins, and no window: SDPA's
        # "causal" over [held, own] is exact (fused where the backend has it), a block of queries at a time.
        causal = per_head._causal(cache, held, first) if held else cache.plan.window is None
        parts = [(keys, values, mx.broadcast_to(mx.arange(first, first + n, dtype=mx.int32), (B, H, n)))]
        slices, windows = [], []
        if held:
            k, v, kpos, slices = per_head._gather(cache, held, queries.dtype if causal else mx.float32)
            parts.insert(0, (k, v, kpos))
            windows = [cache._window(t) for t in held]
        dtype = queries.dtype if causal else mx.float32
        k, v, kpos = (mx.concatenate([p[i].astype(dtype) if i < 2 else p[i] for p in parts], axis=2) for i in range(3))
        total = k.shape[2] - n
        spans, windows = [*slices, slice(total, total + n)], [*windows, cache.plan.window]

        def mask_for(s: int, m: int) -> mx.array:
            return mx.concatenate(
                [position_mask(kpos[..., sl], first + s, m, w) for sl, w in zip(spans, windows)], axis=-1
            )

        block = block_size(queries.shape[1], k.shape[2], per_head.SCORE_BLOCK, per_head.SCORE_BYTES)
        if causal:
            out = _causal_blocks(queries, k, v, scale, block)
        else:
            out, _, _ = attend_blocked(queries, k, v, scale, mask_for, block, weigh=False)
        k32 = k.astype(mx.float32)
        for t in self.tiers:
            look = Look(
                queries, k32, kpos, first, scale, mask_for, slices[held.index(t)], total, causal and len(held) == 1
            )
            t.scorer.listen(t, look, self.note)
        out = out.astype(queries.dtype)
        # Layer by layer: evaluated as one graph, every layer's gathered K/V (which do not depend on the
        # pass's hidden states) were computed up front and held together (+220 MiB at 1,536 tokens, SmolLM2).
        mx.eval(out, [t.scores for t in self.tiers])
        return out


def _causal_blocks(queries: mx.array, keys: mx.array, values: mx.array, scale: float, block: int) -> mx.array:
    """SDPA with "causal" (bottom-right aligned), `block` queries at a time: block [s, s + b) sees the keys
    up to its own last position, so only one block's scores exist where the backend materialises them."""
    Lq, held = queries.shape[2], keys.shape[2] - queries.shape[2]
    outs = []
    for s in range(0, Lq, block):
        q = queries[:, :, s : s + block]
        if outs:
            q = mx.depends(q, [outs[-1]])
        end = held + s + q.shape[2]
        outs.append(
            mx.fast.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], scale=scale, mask="causal")
        )
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


# --- recording the prompt's token ids ------------------------------------------


def _observe(arg, args, kwargs) -> None:
    """Record the ids fed through caches with a pending pass."""
    cache = arg("cache")
    if isinstance(cache, (list, tuple)) and cache:
        inputs = None if kwargs.get("input_embeddings") is not None else args[0] if args else kwargs.get("inputs")
        for driver, offset in _drivers(cache[0]):
            driver.record(offset, inputs)


def install(model) -> None:
    """Wrap the model class's __call__ so ids fed through caches with a pending pass are recorded."""
    _WATCH.install(model, _observe)


def _drivers(cache) -> List[tuple]:
    """(pass, offset) of a model's first layer cache, and of the caches a wrapper feeds (`wrapped`: the
    eval's fidelity tee feeds one cache per row)."""
    out, stack = [], [cache]
    while stack:
        c = stack.pop()
        driver = getattr(getattr(c, "coordinator", None), "model_pass", None)
        if driver is not None:
            out.append((driver, c.offset))
        stack.extend(getattr(c, "wrapped", ()))
    return out


def uninstall(model=None) -> None:
    """Restore the model class's own __call__ (of `model`, or every class wrapped)."""
    _WATCH.uninstall(model)
