"""Find a plan's calibrated stages and bind them to their artifact (or say which is missing).

Part of compiling: `runtime.make` binds every plan it builds; fitting the
artifact (`veloxquant.calibration`) sits above the runtime and imports this.
"""

from typing import Callable, Dict, List, Tuple

import attrs

from .. import artifacts as artifact
from ..artifacts import CalibrationError
from ..data.corpus import load_text
from ..errors import VeloxError
from ..recipe import load_recipe
from .lower import compile_recipe
from .plan import Plan
from .shape import SMOLLM2_135M

Site = Tuple[int, int, str, object]  # (layer, tier, "k"/"v", "k.r0" (a residual stage) or "route", stage)


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
            if getattr(tier.route, "calibrated", False):  # a route fitted per layer (duo's gates, kvzap's scorer)
                out.append((layer.index, t, "route", tier.route))
            for side, codec in (("k", tier.keys), ("v", tier.values)):
                out += [(layer.index, t, f"{side}.{where}" if where else side, s) for where, s in _calibrated(codec)]
    return out


def settings(plan: Plan) -> Dict:
    """What the calibration runs on; every calibrated stage of a plan must agree."""
    found = {(s.corpus, s.tokens) for _, _, _, s in calibrated_stages(plan)}
    if len(found) > 1:
        raise VeloxError(
            f"recipe '{plan.recipe}': calibrated stages disagree on what they calibrate on "
            f"({sorted(found)}); give them the same corpus and tokens"
        )
    corpus, tokens = found.pop()
    return {"corpus": corpus, "tokens": tokens}


def _map_stores(plan: Plan, fn: Callable) -> Plan:
    layers = []
    for layer in plan.layers:
        tiers = []
        for t, tier in enumerate(layer.tiers):
            sides = {}
            if getattr(tier.route, "calibrated", False):
                sides["route"] = fn(layer.index, t, "route", tier.route)
            for side, codec in (("keys", tier.keys), ("values", tier.values)):
                if codec is not None and getattr(codec.store, "calibrated", False):
                    codec = attrs.evolve(codec, store=fn(layer.index, t, side[0], codec.store))
                if codec is not None and any(getattr(r.inner, "calibrated", False) for r in codec.residuals):
                    codec = attrs.evolve(
                        codec,
                        residuals=tuple(
                            attrs.evolve(r, inner=fn(layer.index, t, f"{side[0]}.r{j}", r.inner))
                            if getattr(r.inner, "calibrated", False)
                            else r
                            for j, r in enumerate(codec.residuals)
                        ),
                    )
                sides[side] = codec
            tiers.append(attrs.evolve(tier, **sides))
        layers.append(attrs.evolve(layer, tiers=tuple(tiers)))
    return attrs.evolve(plan, layers=tuple(layers))


def unbound(plan: Plan) -> Plan:
    """The plan as calibration sees it: no artifact, and a stage's `runtime_params` (used only when
    attending, e.g. a2ats's RoPE window) at their defaults, so changing them needs no new artifact."""
    return _map_stores(
        plan,
        lambda i, t, s, st: (
            st.for_calibration()
            if hasattr(st, "for_calibration")
            else attrs.evolve(st, artifact="", slot="", **_defaults(st))
        ),
    )


def _defaults(st) -> Dict:
    fields = attrs.fields_dict(type(st))
    return {name: fields[name].default for name in getattr(st, "runtime_params", ())}


def with_artifact(plan: Plan, digest: str) -> Plan:
    return _map_stores(plan, lambda i, t, s, st: attrs.evolve(st, artifact=digest, slot=f"{i}.{t}.{s}"))


def corpus_digest(corpus: str) -> str:
    return artifact.text_digest(load_text(corpus, progress=False))


def key_for(plan: Plan, model) -> str:
    cfg = settings(plan)
    # A stage's own fitter version (changed what it computes) makes its old artifacts stale
    # without touching other stages' keys (FIT_VERSION does that for every stage).
    versions = {s.stage_name: s.fit_version for _, _, _, s in calibrated_stages(plan) if getattr(s, "fit_version", 0)}
    if versions:
        cfg = {**cfg, "fit_versions": versions}
    return artifact.key_of(
        artifact.weights_identity(model), unbound(plan).fingerprint, corpus_digest(cfg["corpus"]), cfg
    )


def bind(plan: Plan, model) -> Plan:
    """The plan with its calibrated stages bound to their artifact; a clear error if there is none."""
    if not calibrated_stages(plan):
        return plan
    key = key_for(plan, model)
    meta = artifact.find(key)
    if meta is None:
        cfg = settings(plan)
        stale = list(artifact.others_for(plan.recipe, artifact.weights_identity(model)))
        why = (
            f"; the artifact(s) found for this recipe and model ({', '.join(m['key'] for m in stale)}) were made "
            f"from other settings or calibration text (stale)"
            if stale
            else ""
        )
        raise CalibrationError(
            f"recipe '{plan.recipe}' needs a calibration artifact for this model, recipe settings and corpus "
            f"'{cfg['corpus']}' ({cfg['tokens']} tokens): key {key} is not in {artifact.directory()}{why}. "
            f"Make it with: veloxquant calibrate {plan.recipe} --model MODEL (with the same --set values)"
        )
    return with_artifact(plan, meta["content"])


def needs_artifact(ref: str) -> bool:
    """Whether a recipe has calibrated stages (it runs only after `veloxquant calibrate`)."""
    return bool(calibrated_stages(compile_recipe(load_recipe(ref), SMOLLM2_135M)))
