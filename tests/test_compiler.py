"""Compiler checks that no built-in stage exercises yet, with stages registered by the test."""

import attrs
import pytest

from veloxquant.compiler import SMOLLM2_135M, compile_recipe
from veloxquant.errors import RecipeError
from veloxquant.recipe import load_recipe
from veloxquant.stages.registry import REGISTRY, stage


@pytest.fixture
def test_stages():
    @stage("test_scored_window", "route", needs=("attention",))
    @attrs.frozen
    class ScoredWindow:
        """A route that would rank tokens by the attention they receive."""

        n: int = 8
        bounded = True
        spills = True

    @stage("test_coder", "entropy")
    @attrs.frozen
    class Coder:
        """An entropy coder of integer codes."""

    yield
    for name in ("test_scored_window", "test_coder"):
        REGISTRY.pop(name, None)


def _recipe(tmp_path, pipeline):
    path = tmp_path / "r.yaml"
    path.write_text(f"veloxquant: 1\nname: r\npipeline: {pipeline}\n")
    return load_recipe(str(path))


def test_attention_scored_stage_needs_the_hook(test_stages, tmp_path):
    recipe = _recipe(tmp_path, "test_scored_window(16) >> drop")
    plan = compile_recipe(recipe, SMOLLM2_135M, hook=True)
    assert "attention" in plan.layers[0].needs
    with pytest.raises(RecipeError, match="needs the attention hook") as info:
        compile_recipe(recipe, SMOLLM2_135M, hook=False)
    assert info.value.location.line == 3


def test_entropy_coding_needs_integer_codes(test_stages, tmp_path):
    with pytest.raises(RecipeError, match="yields codes") as info:
        compile_recipe(_recipe(tmp_path, "fp16 | test_coder"), SMOLLM2_135M)
    assert (info.value.location.line, info.value.location.column) == (3, 18)


def test_plan_fingerprint_ignores_the_model_label():
    from veloxquant.compiler import ModelShape

    other = ModelShape.uniform("another label", 30, 3, 64)
    kivi = load_recipe("kivi")
    assert compile_recipe(kivi, SMOLLM2_135M).fingerprint == compile_recipe(kivi, other).fingerprint
    bigger = ModelShape.uniform("SmolLM2-135M-Instruct", 30, 3, 128)
    assert compile_recipe(kivi, SMOLLM2_135M).fingerprint != compile_recipe(kivi, bigger).fingerprint
