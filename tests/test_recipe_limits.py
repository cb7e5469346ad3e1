"""What a recipe may ask for: past the limits a located error at load/compile time;
within them, sizes that are lazily safe -- a cache holds what it was fed, never
the window or budget the recipe names (docs/recipe-language.md, "Limits")."""

import mlx.core as mx
import pytest

import veloxquant as vq
from veloxquant.compiler import SMOLLM2_135M, compile_recipe
from veloxquant.errors import RecipeError
from veloxquant.recipe import load_recipe
from veloxquant.recipe.limits import MAX_YAML_NODES

from conftest import feed

TOKENS = mx.random.randint(0, 500, (1, 96), key=mx.random.key(3))

LARGEST = {  # the largest value each stage's range allows, where it could have sized memory
    "window": "recent(16777216) >> drop",
    "sinks": "sink(1048576) >> recent(8) >> drop",
    "budget": "evict(budget=16777216, sinks=1048576, recent=15000000)",
    "snap": "snap(budget=16777216, window=65536, pool=1024, sinks=1048576)",
    "group": "recent(8) >> affine(bits=2, group=65536, axis=channel)",
}


def _write(tmp_path, name, pipeline):
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"veloxquant: 1\nname: {name}\npipeline: {pipeline}\n")
    return str(path)


@pytest.mark.parametrize("name", LARGEST)
def test_largest_legal_sizes_hold_only_what_was_fed(name, llama_model, tmp_path):
    caches = vq.make_prompt_cache(llama_model, _write(tmp_path, name, LARGEST[name]))
    feed(llama_model, TOKENS, caches, 32)
    held = sum(c.nbytes for c in caches)
    # Everything a cache could keep of the 96 tokens fed -- keys, values and (for snap's observation
    # window) queries, float32 -- twice over. Sizing by the recipe's numbers instead (16M tokens, a
    # 65,536-token group or window) would be thousands of times this.
    args = llama_model.args
    per_token = (2 * args.num_key_value_heads + args.num_attention_heads) * args.head_dim * 4
    bound = 2 * TOKENS.shape[1] * per_token * args.num_hidden_layers
    assert 0 < held <= bound, (held, bound)


@pytest.mark.parametrize(
    "pipeline, value, message",
    [
        ("recent(16777217) >> drop", "16777217", "must be between 0 and 16777216"),
        ("recent(1000000000000) >> drop", "1000000000000", "must be between 0 and 16777216"),
        ("sink(1048577) >> drop", "1048577", "must be between 0 and 1048576"),
        ("evict(budget=16777217)", "16777217", "must be between 1 and 16777216"),
        ("recent(8) >> affine(bits=1000000000)", "1000000000", "must be between 1 and 8"),
        ("recent(8) >> affine(bits=2, group=65537, axis=channel)", "65537", "must be between 1 and 65536"),
    ],
)
def test_sizes_past_the_ranges_are_refused_at_the_value(pipeline, value, message, tmp_path):
    with pytest.raises(RecipeError, match=message) as info:
        compile_recipe(load_recipe(_write(tmp_path, "big", pipeline)), SMOLLM2_135M)
    where = info.value.location
    assert (where.line, where.column) == (3, len("pipeline: ") + pipeline.index(value) + 1)


def test_a_million_entry_schedule_is_refused_while_reading(tmp_path):
    path = tmp_path / "million.yaml"
    path.write_text(
        "veloxquant: 1\nname: m\nparams:\n  window: ["
        + ", ".join(["128"] * 1_000_000)
        + "]\npipeline: recent($window) >> drop\n"
    )
    with pytest.raises(RecipeError, match="larger than 1 MiB"):
        load_recipe(str(path))
    path.write_text(
        "veloxquant: 1\nname: m\nparams:\n  window: ["
        + ", ".join(["128"] * 20_000)
        + "]\npipeline: recent($window) >> drop\n"
    )
    with pytest.raises(RecipeError, match=f"more than {MAX_YAML_NODES} YAML values") as info:
        load_recipe(str(path))
    assert info.value.location.line == 4


def test_a_schedule_for_more_layers_than_the_model_is_refused_at_compile(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text(
        "veloxquant: 1\nname: m\nparams:\n  window: ["
        + ", ".join(["128"] * 5000)
        + "]\npipeline: recent($window) >> drop\n"
    )
    with pytest.raises(RecipeError, match="the list has 5000 values but the model has 30 layers") as info:
        compile_recipe(load_recipe(str(path)), SMOLLM2_135M)
    assert (info.value.location.line, info.value.location.column) == (4, 11)
