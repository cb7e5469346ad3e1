"""The tier-kind protocol (runtime/kinds/protocol.py): every kind a built-in builds answers it,
kinds register themselves, and the cache reads declared capabilities."""

import pytest

from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.recipe import load_recipe
from veloxquant.runtime import kinds
from veloxquant.runtime.eviction.head_tier import HeadTier
from veloxquant.runtime.kinds import HEAD_KINDS, KINDS, KindBase, TierKind
from veloxquant.runtime.kinds.anchor_tier import AnchorTier
from veloxquant.runtime.kinds.head_subset import HeadSubsetTier
from veloxquant.runtime.kinds.latent_tier import LatentTier
from veloxquant.runtime.kinds.merged_tier import MergedTier
from veloxquant.runtime.kinds.query_aware_tier import QueryAwareTier
from veloxquant.runtime.kinds.reuse_tier import ReuseTier
from veloxquant.runtime.kinds.sparse_tier import SparseDecodeTier
from veloxquant.runtime.kinds.tier import Tier
from veloxquant.runtime.make import caches_for


def test_kind_modules_register_themselves():
    assert KINDS == {
        "latent": LatentTier,
        "merged": MergedTier,
        "anchor": AnchorTier,
        "query_aware": QueryAwareTier,
        "heads": HeadSubsetTier,
    }
    assert HEAD_KINDS == {"sparse_decode": SparseDecodeTier}


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="registered twice"):
        kinds.kind("latent")(type("Other", (KindBase,), {}))
    assert KINDS["latent"] is LatentTier


# recipe -> the kinds its caches hold (a built-in each, one per family)
BUILT = {
    "kivi": {Tier},
    "fp16": {Tier},
    "palu": {LatentTier},
    "minicache": {MergedTier, Tier},
    "anchorkv": {AnchorTier, Tier},
    "a2ats": {QueryAwareTier},
    "rocketkv": {SparseDecodeTier},
    "snapkv": {HeadTier},
    "xquant": {ReuseTier, Tier},
    "duo_attention": {HeadSubsetTier, Tier},
}


@pytest.mark.parametrize("recipe", sorted(BUILT))
def test_every_built_tier_answers_the_protocol(llama_model, recipe):
    caches = caches_for(compile_recipe(load_recipe(recipe), ModelShape.from_model(llama_model)))
    tiers = [t for c in caches for t in c.tiers]
    assert BUILT[recipe] <= {type(t) for t in tiers}
    for t in tiers:
        assert isinstance(t, TierKind) and isinstance(t, KindBase), type(t).__name__
    for c in caches:  # capabilities are declared: the cache's views of its tiers follow them
        assert c.per_head == any(t.per_head for t in c.tiers)
        assert c._prompt_tiers == [t for t in c.tiers if t.ends_prompt]
