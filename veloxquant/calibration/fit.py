"""Fit a plan's calibrated stages on the model's own keys, values and queries; write the artifact."""

import sys
import time
from typing import Dict, Tuple

import attrs
import mlx.core as mx
import numpy as np
from tqdm import tqdm

from .. import artifacts as artifact
from ..compiler.binding import Site, calibrated_stages, corpus_digest, key_for, settings, unbound
from ..compiler.plan import Plan
from ..data.corpus import load_text
from ..errors import VeloxError
from ..runtime.codec import Codec
from .collect import collect
from .kvzip_targets import collect_targets


def calibrate(plan: Plan, model, tokenizer, progress: bool = True, model_name: str = "") -> Dict:
    """Fit every calibrated stage on the model's keys/values over the calibration text; write the artifact."""
    start = time.perf_counter()
    cfg = settings(plan)
    text = load_text(cfg["corpus"], progress=progress)
    ids = tokenizer.encode(text)[: cfg["tokens"]]
    if len(ids) < cfg["tokens"]:
        raise VeloxError(f"corpus '{cfg['corpus']}' has {len(ids)} tokens, fewer than the {cfg['tokens']} asked for")
    sites = calibrated_stages(plan)
    scored = {i for i, _, side, stage in sites if _fits_scores(side, stage)}
    sampled = {i for i, _, side, stage in sites if not _fits_scores(side, stage)}
    samples = collect(model, ids, sampled, progress) if sampled else {}
    targets = collect_targets(model, tokenizer, ids, scored, progress) if scored else {}
    arrays: Dict[str, np.ndarray] = {}
    fitted: Dict[Site, Dict[str, np.ndarray]] = {}
    for site in tqdm(sites, desc="calibrate: fit", unit="stage", file=sys.stderr, disable=not progress):
        i, t, side, stage = site
        if _fits_scores(side, stage):
            fitted[site] = stage.fit_scores(targets[i]["h"], targets[i]["s"])
            continue
        if side == "route":  # duo's gates: the layer's attention output through its own o_proj
            fitted[site] = stage.fit_gates(samples[i], _held_before(plan, site), *_attention_of(model, plan, i))
            continue
        x, q = _in_stage_domain(plan, site, samples[i])
        if getattr(stage, "fits_layer", False):  # measures attention outputs: needs the layer's raw q, k, v too
            fitted[site] = stage.fit(x, q, samples[i], side[0], plan.layers[i].window)
        else:  # keys are fitted with the real queries too: what matters is the error q.(k - k^)
            fit = getattr(stage, "calibration_fit", stage.fit)  # a store that also fits per prompt
            fitted[site] = fit(x, q if side[0] == "k" else None)
    for cls in {type(s) for _, _, _, s in sites if hasattr(s, "allocate")}:
        # decisions across layers (RateQuant's bits): the stage class sees every site's fit at once
        fitted.update(cls.allocate({site: a for site, a in fitted.items() if type(site[3]) is cls}))
    for (i, t, side, _), found in fitted.items():
        for name, arr in found.items():
            arrays[f"{i}.{t}.{side}.{name}"] = arr
    key = key_for(plan, model)
    meta = {
        "recipe": plan.recipe,
        "model": model_name,
        "weights": artifact.weights_identity(model),
        "plan": unbound(plan).fingerprint,
        "corpus": cfg["corpus"],
        "tokens": cfg["tokens"],
        "corpus_digest": corpus_digest(cfg["corpus"]),
        "stages": len(sites),
        "seconds": round(time.perf_counter() - start, 2),
    }
    path = artifact.save(key, arrays, meta)
    return {**artifact.find(key), "path": str(path)}


def _fits_scores(side: str, stage) -> bool:
    """kvzap's route: fitted from hidden states to our kvzip's scores. Every other site (duo's gates
    too) is fitted on the layer's own q, k, v."""
    return side == "route" and hasattr(stage, "fit_scores")


def _held_before(plan: Plan, site: Site) -> Tuple[int, int]:
    """(sinks, window): what the tiers before a route site hold of every head (sink(n), recent(n))."""
    i, t, _, _ = site
    routes = [tier.route for tier in plan.layers[i].tiers[:t]]
    sinks = sum(r.n for r in routes if r is not None and r.stage_name == "sink")
    window = sum(r.n for r in routes if r is not None and r.stage_name == "recent")
    return sinks, window


def _attention_of(model, plan: Plan, i: int):
    """(scale, o_proj [hidden, Hq * D] float32 or None, sliding window) of recipe layer i's attention."""
    attn = getattr(model.layers[plan.shape.model_layers(i)[0]], "self_attn", None)
    scale = float(getattr(attn, "scale", plan.layers[i].head_dim ** -0.5))
    proj = getattr(attn, "o_proj", None)
    weight = getattr(proj, "weight", None)
    if weight is not None and getattr(proj, "scales", None) is not None:  # a quantized projection
        weight = mx.dequantize(weight, proj.scales, getattr(proj, "biases", None), proj.group_size, proj.bits)
    o_proj = None if weight is None else np.array(weight.astype(mx.float32))
    return scale, o_proj, plan.layers[i].window


def _in_stage_domain(plan: Plan, site: Site, layer: Dict[str, np.ndarray]):
    """The samples as the calibrated stage sees them: through the codec's transforms (unrope by
    position, rotations; queries through the orthogonal ones) and, for a residual stage, minus
    what the stages before it reconstruct. Samples are positions 0.. in order (collect.py)."""
    i, t, side, _ = site
    tier = plan.layers[i].tiers[t]
    codec = tier.keys if side[0] == "k" else tier.values
    x, q = mx.array(layer[side[0]])[None], mx.array(layer["q"])[None]
    for tr in codec.transforms:
        x = tr.forward(x, 0) if getattr(tr, "positional", False) else tr.forward(x)
        if hasattr(tr, "query"):
            q = tr.query(q)
    if "." in side:  # residual j: what the store and residuals before it leave
        j = int(side.split(".r")[1])
        before = Codec(attrs.evolve(codec, transforms=(), residuals=codec.residuals[:j], entropy=()))
        x = x.astype(mx.float32) - before.decode(before.encode_ops(x), mx.float32)
    return np.array(x[0].astype(mx.float32)), np.array(q[0].astype(mx.float32))
