"""The leaderboard's protocols and rows: which settings of which recipes it measures.

Every built-in at its defaults, plus byte-matched settings where defaults
differ widely: eviction recipes at 1/4 and 1/8 of the protocol's context
(their `budget`, or streaming_llm's window), and recipes with a `bits`
parameter at 4 and 2 bits (about 4× and 6× smaller than fp16 once past their
fp16 window) where the default is another width and the recipe takes that
width (nsnquant's codes are 1 or 2 bits: no 4-bit row).
"""

from typing import Dict, List, Tuple

from ..compiler import SMOLLM2_135M, ModelShape, compile_recipe
from ..errors import VeloxError
from ..eval.config import EvalConfig
from ..recipe import builtin_names, load_recipe

# "cpu": a row in a minute or two on a share of 2 busy CPU cores with SmolLM2-135M (float32);
# "standard": eval's defaults (4 windows of 1536 + 256, passkey at 1k and 2k), for a GPU;
# "gpu": the 4k protocol of the GPU result tables (4 windows of 3840 + 256, passkey at 4k and 8k).
PROTOCOLS: Dict[str, EvalConfig] = {
    "cpu": EvalConfig(
        windows=1,
        prefix=640,
        score_tokens=128,
        prefill_chunk=256,
        score_chunk=32,
        fidelity_windows=0,
        passkey_lengths=(512,),
        passkey_depths=(0.5,),
        passkey_trials=1,
    ),
    "standard": EvalConfig(fidelity_windows=0),
    "gpu": EvalConfig(prefix=3840, fidelity_windows=0, passkey_lengths=(4096, 8192)),
}

FRACTIONS = (4, 8)  # eviction budgets: context / 4 and context / 8
WIDTHS = (4, 2)


def context(cfg: EvalConfig) -> int:
    """Tokens a perplexity window's cache has seen when its bytes are read."""
    return cfg.prefix + cfg.score_tokens


def family(name: str) -> str:
    """baseline, eviction (a budget or window of fp16 tokens), hybrid (a budget of coded tokens:
    eviction composed with a codec, kept out of the eviction-only rankings) or compression."""
    recipe = load_recipe(name)
    if name == "fp16":
        return "baseline"
    if "budget" not in recipe.params and name != "streaming_llm":
        return "compression"
    tiers = [t for layer in compile_recipe(recipe, SMOLLM2_135M).layers for t in layer.tiers]
    coded = any(
        hasattr(t.route, "budget") and side is not None and side.store.bits_per_element(64) < 16
        for t in tiers
        for side in (t.keys, t.values)
    )
    return "hybrid" if coded else "eviction"


def _accepts(name: str, sets: List[str], shape: ModelShape) -> bool:
    """Whether the recipe compiles with `sets` (a stage may refuse a width: nsn's bits are 1 or 2)."""
    try:
        compile_recipe(load_recipe(name), shape, sets)
    except VeloxError:
        return False
    return True


def settings(name: str, ctx: int, shape: ModelShape = SMOLLM2_135M) -> List[Tuple[str, str]]:
    """(spec, setting label) rows for one built-in: defaults first, then byte-matched ones."""
    params = load_recipe(name).params
    rows = [(name, "defaults")]
    if "budget" in params:
        rows += [(f"{name}[budget={ctx // f}]", f"budget 1/{f}") for f in FRACTIONS]
    elif name == "streaming_llm":
        sinks = params["sinks"].default
        rows += [(f"{name}[window={ctx // f - sinks}]", f"budget 1/{f}") for f in FRACTIONS]
    if "bits" in params and params["bits"].type == "int":
        rows += [
            (f"{name}[bits={b}]", f"{b}-bit")
            for b in WIDTHS
            if b != params["bits"].default and _accepts(name, [f"bits={b}"], shape)
        ]
    return rows


def rows(ctx: int, only: List[str] = (), shape: ModelShape = SMOLLM2_135M) -> List[Tuple[str, str, str]]:
    """(spec, family, setting) for every built-in but fp16, or for the names in `only`, on `shape`."""
    names = [n for n in builtin_names() if n != "fp16" and (not only or n in only)]
    every = [(spec, family(n), label) for n in names for spec, label in settings(n, ctx, shape)]
    # Defaults first: a run cut short still covers every recipe once.
    return sorted(every, key=lambda r: r[2] != "defaults")
