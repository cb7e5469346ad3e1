"""Find a plan's calibrated stages, bind them to their artifact, or fit and write it."""
import time
from typing import Callable, Dict, List, Tuple

import attrs
import numpy as np

from ..compiler.plan import Plan
from ..errors import VeloxError
from . import artifact
from .artifact import CalibrationError

Site = Tuple[int, int, str, object]  # (layer, tier, "k"/"v" or "k.r0" (a residual stage), stage)


def _calibrated(codec) -> List[Tuple[str, object]]:
    """("", store) and ("rJ", residual J's stage) of a codec's calibrated stages."""
    if codec is None:
        return []
    found = [("", codec.store)] + [(f"r{j}", r.inner) for j, r in enumerate(codec.residuals)]
    return [(where, s) for where, s in found if getattr(s, "calibrated", False)]


def calibrated_stages(plan: Plan) -> List[Site]:
    out = []
    for layer in plan.layers:
        for t, tier in enumerate(layer.tiers):
            for side, codec in (("k", tier.keys), ("v", tier.values)):
                out += [(layer.index, t, f"{side}.{where}" if where else side, s) for where, s in _calibrated(codec)]
    return out


def settings(plan: Plan) -> Dict:
    """What the calibration runs on; every calibrated stage of a plan must agree."""
    found = {(s.corpus, s.tokens) for _, _, _, s in calibrated_stages(plan)}
    if len(found) > 1:
        raise VeloxError(f"recipe '{plan.recipe}': calibrated stages disagree on what they calibrate on "
                         f"({sorted(found)}); give them the same corpus and tokens")
    corpus, tokens = found.pop()
    return {"corpus": corpus, "tokens": tokens}


def _map_stores(plan: Plan, fn: Callable) -> Plan:
    layers = []
    for layer in plan.layers:
        tiers = []
        for t, tier in enumerate(layer.tiers):
            sides = {}
            for side, codec in (("keys", tier.keys), ("values", tier.values)):
                if codec is not None and getattr(codec.store, "calibrated", False):
                    codec = attrs.evolve(codec, store=fn(layer.index, t, side[0], codec.store))
                if codec is not None and any(getattr(r.inner, "calibrated", False) for r in codec.residuals):
                    codec = attrs.evolve(codec, residuals=tuple(
                        attrs.evolve(r, inner=fn(layer.index, t, f"{side[0]}.r{j}", r.inner))
                        if getattr(r.inner, "calibrated", False) else r for j, r in enumerate(codec.residuals)))
                sides[side] = codec
            tiers.append(attrs.evolve(tier, **sides))
        layers.append(attrs.evolve(layer, tiers=tuple(tiers)))
    return attrs.evolve(plan, layers=tuple(layers))


def unbound(plan: Plan) -> Plan:
    """The plan as calibration sees it: no artifact, and a stage's `runtime_params` (used only when
    attending, e.g. a2ats's RoPE window) at their defaults, so changing them needs no new artifact."""
    return _map_stores(plan, lambda i, t, s, st: st.for_calibration() if hasattr(st, "for_calibration")
                       else attrs.evolve(st, artifact="", slot="", **_defaults(st)))


def _defaults(st) -> Dict:
    fields = attrs.fields_dict(type(st))
    return {name: fields[name].default for name in getattr(st, "runtime_params", ())}


def with_artifact(plan: Plan, digest: str) -> Plan:
    return _map_stores(plan, lambda i, t, s, st: attrs.evolve(st, artifact=digest, slot=f"{i}.{t}.{s}"))


def _corpus_digest(corpus: str) -> str:
    from ..data.corpus import load_text
    return artifact.text_digest(load_text(corpus, progress=False))


def key_for(plan: Plan, model) -> str:
    cfg = settings(plan)
    # A stage's own fitter version (changed what it computes) makes its old artifacts stale
    # without touching other stages' keys (FIT_VERSION does that for every stage).
    versions = {s.stage_name: s.fit_version for _, _, _, s in calibrated_stages(plan) if getattr(s, "fit_version", 0)}
    if versions:
        cfg = {**cfg, "fit_versions": versions}
    return artifact.key_of(artifact.weights_identity(model), unbound(plan).fingerprint,
                           _corpus_digest(cfg["corpus"]), cfg)


def bind(plan: Plan, model) -> Plan:
    """The plan with its calibrated stages bound to their artifact; a clear error if there is none."""
    if not calibrated_stages(plan):
        return plan
    key = key_for(plan, model)
    meta = artifact.find(key)
    if meta is None:
        cfg = settings(plan)
        stale = list(artifact.others_for(plan.recipe, artifact.weights_identity(model)))
        why = (f"; the artifact(s) found for this recipe and model ({', '.join(m['key'] for m in stale)}) were made "
               f"from other settings or calibration text (stale)" if stale else "")
        raise CalibrationError(
            f"recipe '{plan.recipe}' needs a calibration artifact for this model, recipe settings and corpus "
            f"'{cfg['corpus']}' ({cfg['tokens']} tokens): key {key} is not in {artifact.directory()}{why}. "
            f"Make it with: veloxquant calibrate {plan.recipe} --model MODEL (with the same --set values)")
    return with_artifact(plan, meta["content"])


def calibrate(plan: Plan, model, tokenizer, progress: bool = True, model_name: str = "") -> Dict:
    """Fit every calibrated stage on the model's keys/values over the calibration text; write the artifact."""
    from ..data.corpus import load_text
    from .collect import collect
    start = time.perf_counter()
    cfg = settings(plan)
    text = load_text(cfg["corpus"], progress=progress)
    ids = tokenizer.encode(text)[: cfg["tokens"]]
    if len(ids) < cfg["tokens"]:
        raise VeloxError(f"corpus '{cfg['corpus']}' has {len(ids)} tokens, fewer than the {cfg['tokens']} asked for")
    sites = calibrated_stages(plan)
    samples = collect(model, ids, {i for i, _, _, _ in sites}, progress)
    arrays: Dict[str, np.ndarray] = {}
    from tqdm import tqdm
    import sys
    fitted: Dict[Site, Dict[str, np.ndarray]] = {}
    for site in tqdm(sites, desc="calibrate: fit", unit="stage", file=sys.stderr, disable=not progress):
        i, t, side, stage = site
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
    meta = {"recipe": plan.recipe, "model": model_name, "weights": artifact.weights_identity(model),
            "plan": unbound(plan).fingerprint, "corpus": cfg["corpus"], "tokens": cfg["tokens"],
            "corpus_digest": _corpus_digest(cfg["corpus"]), "stages": len(sites),
            "seconds": round(time.perf_counter() - start, 2)}
    path = artifact.save(key, arrays, meta)
    return {**artifact.find(key), "path": str(path)}


def _in_stage_domain(plan: Plan, site: Site, layer: Dict[str, np.ndarray]):
    """The samples as the calibrated stage sees them: through the codec's transforms (unrope by
    position, rotations; queries through the orthogonal ones) and, for a residual stage, minus
    what the stages before it reconstruct. Samples are positions 0.. in order (collect.py)."""
    import mlx.core as mx
    from ..runtime.codec import Codec
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


def needs_artifact(ref: str) -> bool:
    """Whether a recipe has calibrated stages (it runs only after `veloxquant calibrate`)."""
    from ..compiler import SMOLLM2_135M, compile_recipe
    from ..recipe import load_recipe
    return bool(calibrated_stages(compile_recipe(load_recipe(ref), SMOLLM2_135M)))
