"""The compiled form of a recipe: one LayerPlan per layer, and its fingerprint."""

import hashlib
import json
import math
from typing import Any, Dict, FrozenSet, Optional, Tuple

import attrs

from .shape import ModelShape


def stage_dict(stage) -> Dict[str, Any]:
    """{"stage": name, **params}; stages nested as params (residual(inner)) likewise."""
    values = attrs.asdict(stage, recurse=False)
    return {
        "stage": stage.stage_name,
        **{k: stage_dict(v) if hasattr(v, "stage_name") else v for k, v in values.items()},
    }


@attrs.frozen
class CodecPlan:
    """transform* store residual* entropy* for one tensor (K or V) of one tier.

    Entropy stages (delta, rans) code the store's integer codes losslessly when
    the cache is saved; the live cache, its bytes and bits/elem do not change."""

    transforms: Tuple[Any, ...]
    store: Any
    impl: str = "mlx-ops"
    residuals: Tuple[Any, ...] = ()
    entropy: Tuple[Any, ...] = ()

    @property
    def stages(self) -> Tuple[Any, ...]:
        # to_dict, text and the fingerprint all go through this flat list.
        return self.transforms + (self.store,) + self.residuals + self.entropy

    @property
    def token_multiple(self) -> int:
        return math.lcm(self.store.token_multiple, *(r.inner.token_multiple for r in self.residuals))

    def bits_per_element(self, head_dim: int) -> float:
        return self.store.bits_per_element(head_dim) + sum(r.inner.bits_per_element(head_dim) for r in self.residuals)

    def text(self) -> str:
        return " | ".join(_stage_text(s) for s in self.stages)

    def to_dict(self) -> list:
        return [stage_dict(s) for s in self.stages]


@attrs.frozen
class TierPlan:
    route: Optional[Any]  # None: holds every token that reaches it
    keys: Optional[CodecPlan]  # None for drop
    values: Optional[CodecPlan]
    chunk: int = 1  # tokens leave this tier in multiples of chunk

    @property
    def name(self) -> str:
        return self.route.stage_name if self.route is not None else "rest"

    @property
    def drops(self) -> bool:
        return self.keys is None

    @property
    def plain_affine(self) -> bool:
        """K and V are plain affine codes (xquant's are, in their anchor layer; reuse layers read
        the anchor's): the fused decode kernels read this tier (runtime/kinds/tier.py, reuse_tier.py)."""
        return not self.drops and all(
            not c.transforms and not c.residuals and c.store.stage_name in ("affine", "xquant")
            for c in (self.keys, self.values)
        )

    def to_dict(self) -> Dict[str, Any]:
        return {
            "route": stage_dict(self.route) if self.route is not None else None,
            "keys": self.keys.to_dict() if self.keys else None,
            "values": self.values.to_dict() if self.values else None,
            "chunk": self.chunk,
        }


@attrs.frozen
class Share:
    """A cross-layer group (XQuant): the anchor, layers[0], holds the codes the others reuse."""

    group: int
    layers: Tuple[int, ...]

    @property
    def anchor(self) -> int:
        return self.layers[0]


@attrs.frozen
class LayerPlan:
    index: int
    n_kv_heads: int
    head_dim: int
    window: Optional[int]
    tiers: Tuple[TierPlan, ...]
    needs: FrozenSet[str] = frozenset()
    share: Optional[Share] = None  # set by compiler/groups.py for layers that share codes

    @property
    def kind(self) -> str:
        return "sliding" if self.window else "full"

    @property
    def role(self) -> Optional[str]:
        """'anchor' or 'reuse' in a cross-layer group, else None."""
        return None if self.share is None else "anchor" if self.share.anchor == self.index else "reuse"

    def to_dict(self) -> Dict[str, Any]:
        d = {
            "layer": self.index,
            "kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "window": self.window,
            "tiers": [t.to_dict() for t in self.tiers],
        }
        if self.share is not None:  # only then: other recipes keep their fingerprints
            d["share"] = {"group": self.share.group, "layers": list(self.share.layers), "role": self.role}
        return d


@attrs.frozen
class Plan:
    recipe: str
    shape: ModelShape
    layers: Tuple[LayerPlan, ...]
    params: Dict[str, Any] = attrs.field(factory=dict, eq=False)

    def to_dict(self) -> Dict[str, Any]:
        model = attrs.asdict(self.shape)
        del model["ropes"]  # unrope stages carry their layer's settings; other plans keep their fingerprints
        # the usual layout (compiler/layout.py) is not written: fingerprints kept
        for usual in ("slots", "readers", "shard"):
            if not model[usual]:
                del model[usual]
        return {"model": model, "layers": [l.to_dict() for l in self.layers]}

    @property
    def fingerprint(self) -> str:
        """Hash of what the caches do (not of names, model labels or formatting)."""
        what = self.to_dict()
        del what["model"]["name"]  # the layers carry the shape that matters
        if "shard" in what["model"]:  # every rank of a sharded model runs the same plan: the world size counts
            what["model"]["shard"] = what["model"]["shard"][1:]
        blob = json.dumps(what, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _stage_text(stage) -> str:
    # _-prefixed fields are bound by the compiler
    values = {k: v for k, v in attrs.asdict(stage, recurse=False).items() if not k.startswith("_")}
    if not values:
        return stage.stage_name
    shown = (f"{k}={_stage_text(v) if hasattr(v, 'stage_name') else _fmt(v)}" for k, v in values.items())
    return f"{stage.stage_name}({', '.join(shown)})"


def _fmt(v) -> str:
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return str(int(v))
    return str(v).lower() if isinstance(v, bool) else str(v)
