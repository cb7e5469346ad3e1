"""How much of fp16's attention lands on the tokens an eviction recipe kept.

    veloxquant bench kept-mass --prompt-tokens 1024 --budget 256

The prompt goes through each recipe as mlx-lm's generate feeds it (all but
the last token in one prefill call, then the last token alone), so eviction
has run. Then the fp16 cache reads the next `--next` tokens of the text; their
real queries' attention over the prompt, per layer and query head, is the
yardstick: kept mass = the share of it on positions the recipe still holds
(for that query head's kv head). Averaged over queries and heads, then layers.
"""

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import numpy as np

from ..data.corpus import load_text
from ..models.default import gemma3_model_path, load_model
from ..runtime.eviction.scoring import attention_weights, position_mask
from ..runtime.make import make_prompt_cache
from .registry import bench

ROWS = [
    ("h2o", "h2o", ["score=mass"]),
    ("h2o proxy", "h2o", ["score=proxy"]),
    ("h2o recent=budget/2", "h2o", ["score=mass", "recent=HALF"]),
    ("tova", "tova", []),
    ("snapkv", "snapkv", []),
    ("pyramidkv", "pyramidkv", []),
    ("observed_attention (once)", "observed_attention", []),
    ("h2o once", "h2o", ["once=true"]),
    ("knorm", "knorm", []),
    ("keydiff (once)", "keydiff", []),
    ("expected_attention (once)", "expected_attention", []),
    ("qfilters", "qfilters", []),
    ("keyformer", "keyformer", []),
    ("morphkv", "morphkv", []),
    ("chunkkv", "chunkkv", []),
    ("curdkv", "curdkv", []),
    ("kvzip (once)", "kvzip", []),
    ("observed_snap (once)", "observed_snap", []),
    ("squeezeattention", "squeezeattention", []),
    ("adakv (once)", "adakv", []),
    ("nestedkv (once)", "nestedkv", []),
    ("cam", "cam", []),
    ("rocketkv (once)", "rocketkv", []),
]
# anchorkv has no row: it evicts nothing (every token stays, as an anchor or as coefficients on one).


class Recorder:
    """Wraps a layer cache; keeps the queries attention is asked for."""

    def __init__(self, cache):
        self.cache, self.queries, self.scale = cache, [], None

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def update_and_fetch(self, keys, values):
        return self.cache.update_and_fetch(keys, values)

    def attend(self, queries, scale, mask=None, sinks=None):
        self.queries.append(queries)
        self.scale = scale
        return self.cache.attend(queries, scale=scale, mask=mask, sinks=sinks)


def prompt_through(model, caches, prompt: mx.array) -> None:
    model(prompt[:, :-1], cache=caches)
    model(prompt[:, -1:], cache=caches)
    mx.eval([c.state for c in caches])


def fp16_weights(model, tokens: mx.array, n_prompt: int) -> List[np.ndarray]:
    """Per layer: attention of the continuation queries over the prompt [B, Hkv, rep, Lq, n_prompt]."""
    caches = make_prompt_cache(model, "fp16")
    model(tokens[:, :n_prompt], cache=caches)
    rec = [Recorder(c) for c in caches]
    model(tokens[:, n_prompt:], cache=rec)
    out = []
    for r in rec:
        (q,) = r.queries
        tier = r.cache.tiers[0]
        k, _ = tier.decoded(mx.float32)
        # A sliding-window layer (Gemma-3) has forgotten its oldest tokens: key i is position start + i,
        # and the queries see only the window's newest prompt tokens.
        held = np.arange(tier.start, tier.start + k.shape[2])
        kpos = mx.broadcast_to(mx.array(held, dtype=mx.int32), k.shape[:3])
        w = np.array(attention_weights(q, k, r.scale, position_mask(kpos, n_prompt, q.shape[2], r.cache.plan.window)))
        full = np.zeros((*w.shape[:-1], n_prompt), np.float32)
        full[..., held[held < n_prompt]] = w[..., held < n_prompt]
        out.append(full)
    return out


def kept_positions(caches) -> List[np.ndarray]:
    """Per layer [B, Hkv, W]; a ragged tier (heads with their own budgets) pads with positions >= the prompt."""
    return [np.array(c.tiers[-1].positions) for c in caches]


def held_per_head(kept: List[np.ndarray], n_prompt: int) -> float:
    return float(np.mean([(pos < n_prompt).sum(-1).mean() for pos in kept]))


def kept_mass(weights: List[np.ndarray], kept: List[np.ndarray], n_prompt: int) -> List[float]:
    per_layer = []
    for w, pos in zip(weights, kept):
        onehot = np.zeros((*pos.shape[:2], n_prompt), np.float32)
        held = pos < n_prompt
        b, h, _ = np.nonzero(held)
        onehot[b, h, pos[held]] = 1.0
        w = np.asarray(w)  # [B, Hkv, rep, Lq, n_prompt]
        share = (w * onehot[:, :, None, None, :]).sum(-1) / np.maximum(w.sum(-1), 1e-30)
        per_layer.append(float(share.mean()))
    return per_layer


def jaccard(a: List[np.ndarray], b: List[np.ndarray]) -> float:
    scores = [
        len(set(x[0, h]) & set(y[0, h])) / len(set(x[0, h]) | set(y[0, h]))
        for x, y in zip(a, b)
        for h in range(x.shape[1])
    ]
    return float(np.mean(scores))


@bench("kept-mass", "how much of fp16's attention lands on the tokens an eviction recipe kept")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="veloxquant bench kept-mass", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--next", type=int, default=32, help="continuation tokens whose queries are the yardstick")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--corpus", default="austen")
    ap.add_argument("--model", default=None, help="model path (default SmolLM2; 'gemma3' = Gemma-3-270M)")
    ap.add_argument("--only", default=None, help="comma-separated row labels to run (default: all)")
    ap.add_argument("--json", default=None, help="also write the rows (and the command) to this JSON file")
    args = ap.parse_args(argv)
    rows: List[Dict] = []
    if args.model == "gemma3":
        args.model = str(gemma3_model_path())
    model, tokenizer = load_model(args.model) if args.model else load_model()
    ids = tokenizer.encode(load_text(args.corpus))[: args.prompt_tokens + args.next]
    tokens = mx.array(ids)[None]
    n = args.prompt_tokens
    weights = fp16_weights(model, tokens, n)
    kept: Dict[str, List[np.ndarray]] = {}
    model_name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    print(
        f"{model_name}: prompt {n} tokens ({args.corpus}), budget {args.budget} per kv head; yardstick: fp16 "
        f"attention of the next {args.next} tokens' queries over the prompt\n"
    )
    print("| recipe | held per head (layer mean) | fp16 attention mass kept, mean over layers | worst layer |")
    print("| --- | --- | --- | --- |")
    only = set(args.only.split(",")) if args.only else None
    for label, name, sets in ROWS:
        if only and label not in only:
            continue
        sets = [x.replace("HALF", str(args.budget // 2)) for x in sets]
        sets = sets + (
            [f"budget=pyramid(from={args.budget * 7 // 4}, to={args.budget // 4})"]
            if name == "pyramidkv"
            else [f"budget={args.budget}"]
        )
        caches = make_prompt_cache(model, name, sets)
        prompt_through(model, caches, tokens[:, :n])
        for c in caches:
            c.finish_prompt()
            c.meta_state  # reading it settles the cache: the last spill of the prompt lands where it is kept
        kept[label] = kept_positions(caches)  # the whole prompt went in: every position is < n
        per_layer = kept_mass(weights, kept[label], n)
        held = held_per_head(kept[label], n)
        worst = int(np.argmin(per_layer))
        print(f"| {label} | {held:.0f} | {np.mean(per_layer):.4f} | {per_layer[worst]:.4f} (layer {worst}) |")
        rows.append(
            {
                "recipe": label,
                "held per head": round(held),
                "mass kept": round(float(np.mean(per_layer)), 4),
                "worst layer": worst,
                "mass kept there": round(float(per_layer[worst]), 4),
            }
        )
    overlap = None
    if "h2o" in kept and "h2o proxy" in kept:
        overlap = jaccard(kept["h2o"], kept["h2o proxy"])
        print(f"\nkept-set overlap (Jaccard, mean over layers and kv heads), h2o real vs proxy: {overlap:.3f}")
    if args.json:
        command = "veloxquant bench kept-mass " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": command,
                    "model": model_name,
                    "prompt_tokens": n,
                    "budget": args.budget,
                    "rows": rows,
                    "h2o_real_vs_proxy_jaccard": overlap,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
