"""Plan <-> JSON: a saved cache carries its plan and is rebuilt from it."""

import json
from typing import Any, Dict

import attrs

from ..errors import VeloxError
from ..stages import REGISTRY, needs_of
from .plan import CodecPlan, LayerPlan, Plan, Share, TierPlan
from .shape import ModelShape


def _stage(d: Dict[str, Any]):
    d = {k: _stage(v) if isinstance(v, dict) and "stage" in v else v for k, v in d.items()}
    name = d.pop("stage")
    if name not in REGISTRY:
        raise VeloxError(f"unknown stage '{name}' in a saved plan")
    # attrs takes a field by its init alias: a private field (_artifact) by its public name
    # (artifact) unless the stage gave it another alias (unrope's _rope keeps its underscore)
    cls = REGISTRY[name].cls
    alias = {a.name: a.alias for a in attrs.fields(cls)}
    return cls(**{alias.get(k, k): v for k, v in d.items()})


def _codec(stages) -> CodecPlan:
    built = [_stage(s) for s in stages]
    family = [REGISTRY[s.stage_name].family for s in built]
    store = family.index("store")
    coded = family.index("entropy") if "entropy" in family else len(built)
    return CodecPlan(
        tuple(built[:store]), built[store], residuals=tuple(built[store + 1 : coded]), entropy=tuple(built[coded:])
    )


def plan_from_dict(d: Dict[str, Any], recipe: str = "saved") -> Plan:
    m = d["model"]
    shape = ModelShape(
        m["name"],
        tuple(m["n_kv_heads"]),
        tuple(m["head_dim"]),
        tuple(m["windows"]),
        slots=tuple(m.get("slots", ())),
        readers=tuple(tuple(r) for r in m.get("readers", ())),
        shard=tuple(m.get("shard", ())),
    )
    layers = []
    for ld in d["layers"]:
        tiers = []
        for td in ld["tiers"]:
            route = _stage(td["route"]) if td["route"] else None
            keys = _codec(td["keys"]) if td["keys"] else None
            values = _codec(td["values"]) if td["values"] else None
            tiers.append(TierPlan(route, keys, values, td["chunk"]))
        needs = frozenset().union(
            *(needs_of(s) for t in tiers for s in ([t.route] if t.route else []) + ([t.keys.store] if t.keys else []))
        )
        share = Share(ld["share"]["group"], tuple(ld["share"]["layers"])) if ld.get("share") else None
        layers.append(LayerPlan(ld["layer"], ld["kv_heads"], ld["head_dim"], ld["window"], tuple(tiers), needs, share))
    return Plan(recipe, shape, tuple(layers))


def plan_from_json(text: str, recipe: str = "saved") -> Plan:
    return plan_from_dict(json.loads(text), recipe)
