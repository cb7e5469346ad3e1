"""The recipe front end on valid input: built-ins, extends, --set, per-layer overrides,
schedules, layer selectors, fmt, fingerprints, and the examples in docs/recipe-language.md.

Nothing here loads a model: recipes compile against a ModelShape.
"""

import re
import shutil
from pathlib import Path

import pytest

from veloxquant import cli
from veloxquant.compiler import SMOLLM2_135M, ModelShape, apply_sets, compile_recipe
from veloxquant.compiler.explain import render
from veloxquant.errors import RecipeError
from veloxquant.recipe import builtin_names, load_recipe
from veloxquant.recipe.fmt import format_file, format_text
from veloxquant.recipe.params import Schedule
from veloxquant.recipe.parse import parse_pipeline
from veloxquant.recipe.source import Source

ROOT = Path(__file__).resolve().parent.parent
GOOD = Path(__file__).parent / "recipes_good"
GOOD_FILES = sorted(GOOD.glob("*.yaml"))
BUILTINS = builtin_names()
BUILTIN_FILES = [ROOT / "recipes" / f"{n}.yaml" for n in BUILTINS]
DOC = ROOT / "docs" / "recipe-language.md"


def plan_of(ref, shape=SMOLLM2_135M, sets=()):
    return compile_recipe(load_recipe(str(ref)), shape, sets)


def tiers(layer):
    """A layer's tiers as short text: ['recent(128)', 'K: affine(...) V: affine(...)']."""
    out = []
    for t in layer.tiers:
        route = "" if t.route is None else f"{t.route.stage_name}({getattr(t.route, 'n', '')})".replace("()", "")
        if t.drops:
            out.append(route)
            continue
        codec = t.keys.text() if t.keys == t.values else f"K: {t.keys.text()} V: {t.values.text()}"
        out.append(f"{route} {codec}".strip())
    return out


def store(layer, tier=-1, side="keys"):
    return getattr(layer.tiers[tier], side).store


# --- built-ins -------------------------------------------------------------------------


def test_builtins_exist():
    assert {"fp16", "kivi", "kivi_sink", "streaming_llm"} <= set(BUILTINS)


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_compiles(name):
    plan = plan_of(name)
    assert len(plan.layers) == SMOLLM2_135M.n_layers
    assert plan.recipe == name
    assert re.fullmatch(r"[0-9a-f]{16}", plan.fingerprint)
    assert "layers 0-29" in render(plan)


@pytest.mark.parametrize("path", GOOD_FILES, ids=[p.stem for p in GOOD_FILES])
def test_good_recipe_compiles(path):
    plan = plan_of(path)
    assert len(plan.layers) == 30


def test_kivi_plan():
    layer = plan_of("kivi").layers[7]
    assert [t.name for t in layer.tiers] == ["recent", "rest"]
    assert layer.tiers[0].route.n == 128 and layer.tiers[0].chunk == 32
    k, v = store(layer, side="keys"), store(layer, side="values")
    assert (k.bits, k.group, k.axis) == (2, 32, "channel")
    assert (v.bits, v.group, v.axis) == (2, 32, "token")


def test_streaming_llm_drops():
    layer = plan_of("streaming_llm").layers[0]
    assert [t.name for t in layer.tiers] == ["sink", "recent", "drop"]
    assert layer.tiers[-1].drops


def test_load_by_name_and_by_path_agree():
    assert plan_of("kivi").fingerprint == plan_of(ROOT / "recipes" / "kivi.yaml").fingerprint


# --- the pipeline language -------------------------------------------------------------


def _parse(text):
    return parse_pipeline(text, lambda line, col: None)


def test_whitespace_and_trailing_comma_do_not_matter():
    assert _parse("recent(8)>>affine(bits=4,)") == _parse("recent( 8 )\n  >> affine( bits = 4 )")


def test_split_sides_in_either_order():
    a = _parse("recent(8) >> keys: affine(axis=channel) values: fp16")
    b = _parse("recent(8) >> values: fp16 keys: affine(axis=channel)")
    assert a == b
    assert a.tiers[1].keys[0].name == "affine" and a.tiers[1].values[0].name == "fp16"


def test_shared_stage_before_split():
    tier = _parse("recent(8) >> hadamard | keys: affine(bits=4) values: affine(bits=2)").tiers[1]
    assert [c.name for c in tier.stages] == ["hadamard"]
    layer = plan_of(GOOD / "hybrid.yaml").layers[1]
    last = layer.tiers[-1]
    assert [s.stage_name for s in last.keys.transforms] == ["hadamard"]
    assert [s.stage_name for s in last.values.transforms] == ["hadamard"]


def test_keys_and_values_are_names_outside_a_split():
    # 'keys'/'values' only open a split when followed by ':'
    assert _parse("recent(8) >> drop").tiers[1].stages[0].name == "drop"


def test_positional_and_named_args_agree():
    a = plan_of_text("pipeline: recent(64) >> affine(4, 32, channel)")
    b = plan_of_text("pipeline: recent(64) >> affine(bits=4, group=32, axis=channel)")
    assert a.fingerprint == b.fingerprint


def test_string_value_for_enum():
    a = plan_of_text('pipeline: recent(64) >> affine(axis="channel")')
    b = plan_of_text("pipeline: recent(64) >> affine(axis=channel)")
    assert a.fingerprint == b.fingerprint


def plan_of_text(body, tmp=None, shape=SMOLLM2_135M, sets=()):
    import tempfile

    d = Path(tmp or tempfile.mkdtemp())
    f = d / "r.yaml"
    f.write_text("veloxquant: 1\nname: r\n" + body + "\n")
    return plan_of(f, shape, sets)


# --- extends ---------------------------------------------------------------------------


def test_extends_inherits_params_and_overrides_pipeline():
    kivi, sink = load_recipe("kivi"), load_recipe("kivi_sink")
    assert sink.extends == "kivi"
    assert set(sink.params) == set(kivi.params) | {"sinks"}
    assert sink.params["bits"] == kivi.params["bits"]
    layer = plan_of("kivi_sink").layers[0]
    assert [t.name for t in layer.tiers] == ["sink", "recent", "rest"]
    assert layer.tiers[0].route.n == 5 and layer.tiers[1].route.n == 128
    # the codecs it shares with kivi are the same
    assert layer.tiers[1:] == plan_of("kivi").layers[0].tiers


def test_extends_overrides_a_param_keeping_its_type_and_doc():
    r = load_recipe(str(GOOD / "overrides.yaml"))
    parent = load_recipe("kivi")
    assert r.params["bits"].default == 4 and r.params["bits"].type == "int"
    assert r.params["bits"].doc == parent.params["bits"].doc
    assert r.pipeline == parent.pipeline  # no pipeline given: inherited
    assert r.summary == parent.summary


def test_extends_relative_path():
    child = plan_of(GOOD / "hybrid_8bit.yaml").layers[5]
    parent = plan_of(GOOD / "hybrid.yaml").layers[5]
    assert store(child, side="keys").bits == 8 and store(parent, side="keys").bits == 4
    assert store(child, side="values") == store(parent, side="values")
    # the parent's layer override comes along
    assert tiers(plan_of(GOOD / "hybrid_8bit.yaml").layers[0]) == ["fp16"]


def test_extends_without_pipeline_in_parent_chain(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "veloxquant: 1\nname: base\nparams: {w: 16}\npipeline: recent($w) >> affine(bits=8)\n"
    )
    (tmp_path / "mid.yaml").write_text("veloxquant: 1\nname: mid\nextends: base.yaml\nparams: {w: 32}\n")
    (tmp_path / "leaf.yaml").write_text("veloxquant: 1\nname: leaf\nextends: mid.yaml\n")
    assert plan_of(tmp_path / "leaf.yaml").layers[0].tiers[0].route.n == 32


# --- --set -----------------------------------------------------------------------------


def test_apply_sets():
    r = load_recipe("kivi")
    assert apply_sets(r, []) == {"bits": 2, "group": 32, "window": 128}
    assert apply_sets(r, ["bits=4", "window=64"]) == {"bits": 4, "group": 32, "window": 64}


def test_set_changes_the_plan():
    layer = plan_of("kivi", sets=["bits=4"]).layers[0]
    assert store(layer, side="keys").bits == 4 and store(layer, side="values").bits == 4


def test_set_schedule_and_list():
    vals = apply_sets(load_recipe("kivi"), ["window=linear(from=256, to=64)"])
    assert vals["window"] == Schedule("linear", 256.0, 64.0)
    plan = plan_of("kivi", sets=["window=linear(from=256, to=64)"])
    assert plan.layers[0].tiers[0].route.n == 256 and plan.layers[-1].tiers[0].route.n == 64


@pytest.mark.parametrize(
    "text,message",
    [
        ("bits=two", "parameter 'bits' is int, got 'two'"),
        ("bits=true", "parameter 'bits' is int, got True"),
        ("bits=[a, b]", "parameter 'bits' is int, got a list"),
        ("window={n: 1}", "parameter 'window' is int, got a map"),
        ("nope=1", "has no parameter 'nope'"),
    ],
)
def test_set_type_errors_name_the_param(text, message):
    with pytest.raises(RecipeError) as info:
        apply_sets(load_recipe("kivi"), [text])
    assert message in str(info.value)
    assert info.value.location.file == "--set"


def test_set_wins_over_layer_params():
    plan = plan_of(GOOD / "overrides.yaml", sets=["bits=3"])
    # layers 2-4 set bits=8 in the file; --set bits=3 applies to them too
    assert [store(plan.layers[i], side="keys").bits for i in (1, 2, 3, 4, 5)] == [3] * 5


def test_cli_check_and_explain_with_set(capsys):
    assert cli.main(["check", "kivi", "--set", "bits=4"]) == 0
    assert cli.main(["explain", "kivi", "--set", "bits=4"]) == 0
    out = capsys.readouterr().out
    assert "ok    kivi" in out and "params bits=4" in out and "affine(bits=4" in out


# --- per-layer overrides and selectors ---------------------------------------------------


def test_layer_overrides_change_only_their_layers():
    plan = plan_of(GOOD / "overrides.yaml")
    base = plan_of("kivi", sets=["bits=4"])
    changed = {l.index for l, b in zip(plan.layers, base.layers) if l.tiers != b.tiers}
    assert changed == {0, 2, 3, 4, 10, 12, 29}
    assert tiers(plan.layers[0]) == ["fp16"]
    assert {store(plan.layers[i], side="keys").bits for i in (2, 3, 4)} == {8}
    assert (
        tiers(plan.layers[10]) == tiers(plan.layers[12]) == ["recent(32) fp16", "affine(bits=8, group=32, axis=token)"]
    )
    assert plan.layers[29].tiers[0].route.n == 256
    assert plan.layers[28].tiers[0].route.n == 128


@pytest.mark.parametrize(
    "selector,layers",
    [
        ("0", [0]),
        ("-1", [29]),
        ("0-3", [0, 1, 2, 3]),
        ("0..3", [0, 1, 2, 3]),
        ("0,2", [0, 2]),
        ("-3..-1", [27, 28, 29]),
        ("1, 5-6, -1", [1, 5, 6, 29]),
        ("all", list(range(30))),
        ("sliding", []),
        ("full", list(range(30))),
    ],
)
def test_selectors(selector, layers, tmp_path):
    plan = plan_of_text(
        f'params: {{w: 128}}\npipeline: recent($w) >> affine(bits=4)\nlayers:\n  "{selector}": {{params: {{w: 16}}}}',
        tmp_path,
    )
    assert [l.index for l in plan.layers if l.tiers[0].route.n == 16] == layers


def test_later_override_wins(tmp_path):
    plan = plan_of_text(
        'params: {w: 128}\npipeline: recent($w) >> drop\nlayers:\n  "0-9": {params: {w: 64}}\n  "5": {params: {w: 8}}',
        tmp_path,
    )
    assert [l.tiers[0].route.n for l in plan.layers[:11]] == [64] * 5 + [8] + [64] * 4 + [128]


def test_layer_pipeline_and_params_together(tmp_path):
    plan = plan_of_text(
        "params: {w: 128}\npipeline: recent($w) >> drop\nlayers:\n"
        '  "-1":\n    pipeline: sink(4) >> recent($w) >> affine(bits=8)\n'
        "    params: {w: 32}",
        tmp_path,
    )
    assert tiers(plan.layers[-1]) == ["sink(4) fp16", "recent(32) fp16", "affine(bits=8, group=32, axis=token)"]
    assert tiers(plan.layers[0]) == ["recent(128) fp16", "drop"]


WINDOWED = ModelShape.uniform("toy", 6, 2, 64, windows=[512, None, 512, None, 512, None])


def test_sliding_and_full_selectors():
    plan = plan_of(GOOD / "sliding.yaml", shape=WINDOWED)
    assert [l.kind for l in plan.layers] == ["sliding", "full"] * 3
    for layer in plan.layers:
        if layer.window:
            assert tiers(layer) == ["identity"]
        else:
            assert [t.name for t in layer.tiers] == ["recent", "rest"]


def test_full_selector(tmp_path):
    plan = plan_of_text("pipeline: fp16\nlayers:\n  full: {pipeline: recent(8) >> drop}", tmp_path, WINDOWED)
    assert [tiers(l) for l in plan.layers] == [["fp16"], ["recent(8) fp16", "drop"]] * 3


def test_sliding_selects_nothing_on_a_model_without_windows():
    assert plan_of(GOOD / "sliding.yaml").fingerprint == plan_of("kivi").fingerprint


# --- schedules -------------------------------------------------------------------------


def test_linear_schedule():
    plan = plan_of(GOOD / "pyramid.yaml")
    ns = [l.tiers[0].route.n for l in plan.layers]
    assert ns[0] == 256 and ns[-1] == 64
    assert ns == sorted(ns, reverse=True)
    assert ns[15] == round(256 + (64 - 256) * 15 / 29)


def test_pyramid_schedule_is_the_same_line():
    a = plan_of("kivi", sets=["window=linear(from=512, to=32)"])
    b = plan_of("kivi", sets=["window=pyramid(from=512, to=32)"])
    assert a.fingerprint == b.fingerprint
    assert a.layers[0].tiers[0].route.n == 512 and a.layers[-1].tiers[0].route.n == 32


def test_list_schedule():
    plan = plan_of(GOOD / "list_schedule.yaml")
    assert [l.tiers[1].route.n for l in plan.layers] == [256 - 4 * i for i in range(30)]


def test_list_schedule_on_another_shape_is_an_error():
    small = ModelShape.uniform("small", 4, 2, 64)
    with pytest.raises(RecipeError, match="the list has 30 values but the model has 4 layers"):
        plan_of(GOOD / "list_schedule.yaml", shape=small)


def test_schedule_in_layer_override(tmp_path):
    plan = plan_of_text(
        'params: {w: 128}\npipeline: recent($w) >> drop\nlayers:\n  all: {params: {w: "linear(from=100, to=10)"}}',
        tmp_path,
    )
    assert plan.layers[0].tiers[0].route.n == 100 and plan.layers[-1].tiers[0].route.n == 10


def test_param_declarations(tmp_path):
    r = tmp_path / "p.yaml"
    r.write_text(
        "veloxquant: 1\nname: p\nparams:\n  a: 2\n  b: 0.5\n  c: true\n  d: hi\n"
        "  e: {default: 3, type: float, doc: a float given as an int}\n"
        "  f: [1, 2.5]\n  g: 'linear(from=1, to=2)'\n  h: 'linear(from=1, to=2.5)'\npipeline: fp16\n"
    )
    p = load_recipe(str(r)).params
    assert {k: v.type for k, v in p.items()} == {
        "a": "int",
        "b": "float",
        "c": "bool",
        "d": "str",
        "e": "float",
        "f": "float",
        "g": "int",
        "h": "float",
    }
    assert p["e"].default == 3.0 and isinstance(p["e"].default, float) and p["e"].doc.startswith("a float")


# --- fmt -------------------------------------------------------------------------------

FMT_FILES = BUILTIN_FILES + GOOD_FILES


@pytest.mark.parametrize("path", FMT_FILES, ids=[f"{p.parent.name}/{p.stem}" for p in FMT_FILES])
def test_fmt_idempotent_and_keeps_plan(path, tmp_path):
    # format a copy of the folder, so relative `extends` still resolve
    shutil.copytree(path.parent, tmp_path / "r")
    copy = tmp_path / "r" / path.name
    once, _ = format_file(str(copy))
    twice = format_text(Source(str(copy), once))
    assert twice == once
    copy.write_text(once)
    assert format_file(str(copy)) == (once, False)
    assert plan_of(copy).fingerprint == plan_of(path).fingerprint


@pytest.mark.parametrize("path", BUILTIN_FILES, ids=BUILTINS)
def test_builtins_are_canonical(path):
    assert format_file(str(path)) == (path.read_text(), False)


def test_fmt_check_cli(capsys):
    assert cli.main(["fmt", "--check", *map(str, BUILTIN_FILES)]) == 0
    assert cli.main(["fmt", "--check", str(GOOD / "messy.yaml")]) == 1
    assert "would reformat" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["commented.yaml", "hybrid.yaml", "messy.yaml"])
def test_fmt_keeps_full_line_comments(name):
    path = GOOD / name
    comments = [l.strip() for l in path.read_text().splitlines() if l.strip().startswith("#")]
    assert comments
    out, _ = format_file(str(path))
    kept = [l.strip() for l in out.splitlines() if l.strip().startswith("#")]
    assert sorted(kept) == sorted(comments)  # each stays with the key it precedes


def test_fmt_canonical_form():
    out, changed = format_file(str(GOOD / "messy.yaml"))
    assert changed
    keys = [l.split(":")[0] for l in out.splitlines() if re.match(r"[a-z]", l)]
    assert keys == ["veloxquant", "name", "params", "pipeline", "layers"]
    assert (
        "pipeline: |\n  recent($window)\n  >> keys:   affine(bits=$bits, group=32, axis=channel)\n"
        "     values: affine(bits=$bits, axis=token)\n" in out
    )


def test_fmt_refuses_trailing_comments(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("veloxquant: 1\nname: t\npipeline: fp16  # uncompressed\n")
    with pytest.raises(RecipeError, match="full-line comments only") as info:
        format_file(str(f))
    assert (info.value.location.line, info.value.location.column) == (3, 17)


def test_fmt_refuses_invalid_recipe():
    with pytest.raises(RecipeError):
        format_file(str(Path(__file__).parent / "recipes_bad" / "stray_char.yaml"))


# --- fingerprints ----------------------------------------------------------------------

KIVI_TEXT = (ROOT / "recipes" / "kivi.yaml").read_text()


def _fp(tmp_path, text, name="k.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return plan_of(f).fingerprint


def test_fingerprint_ignores_formatting_comments_summary_and_name(tmp_path):
    base = _fp(tmp_path, KIVI_TEXT)
    assert base == plan_of("kivi").fingerprint
    variants = [
        "# a comment\n" + KIVI_TEXT.replace("params:", "# params\nparams:"),
        KIVI_TEXT.replace("summary: Tuning-free", "summary: Something else entirely, tuning-free"),
        KIVI_TEXT.replace("name: kivi", "name: renamed"),
        KIVI_TEXT.replace(
            "pipeline: |\n  recent($window)\n  >> keys:   ", "pipeline: |\n  recent( $window )>>\n  keys: "
        ),
        KIVI_TEXT.replace("paper: Liu", "paper: Someone, after Liu"),
    ]
    for i, text in enumerate(variants):
        assert text != KIVI_TEXT
        assert _fp(tmp_path, text, f"v{i}.yaml") == base, text


def test_fingerprint_changes_with_params(tmp_path):
    base = plan_of("kivi").fingerprint
    assert plan_of("kivi", sets=["bits=4"]).fingerprint != base
    assert plan_of("kivi", sets=["window=64"]).fingerprint != base
    assert _fp(tmp_path, KIVI_TEXT.replace("default: 32", "default: 64")) != base
    assert _fp(tmp_path, KIVI_TEXT.replace("axis=token", "axis=channel"), "b.yaml") != base
    # the same value written as a default or through --set gives the same plan
    assert (
        _fp(tmp_path, KIVI_TEXT.replace("default: 2,", "default: 4,"), "c.yaml")
        == plan_of("kivi", sets=["bits=4"]).fingerprint
    )


def test_fingerprint_depends_on_the_model_shape():
    other = ModelShape.uniform("other", 30, 3, 128)
    assert plan_of("kivi", shape=other).fingerprint != plan_of("kivi").fingerprint


# --- docs/recipe-language.md -------------------------------------------------------------


def doc_examples():
    if not DOC.is_file():
        return []
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    return [b for b in blocks if b.startswith("veloxquant: 1")]


DOC_EXAMPLES = doc_examples()


def test_doc_has_examples():
    assert len(DOC_EXAMPLES) >= 6


@pytest.mark.parametrize("index", range(len(DOC_EXAMPLES)))
def test_doc_example_compiles(index, tmp_path):
    text = DOC_EXAMPLES[index]
    f = tmp_path / "example.yaml"
    f.write_text(text)
    shape = WINDOWED if re.search(r"^\s+(sliding|full):", text, flags=re.M) else SMOLLM2_135M
    plan = plan_of(f, shape=shape)
    assert plan.layers


def test_doc_shows_builtins_as_they_are():
    for text in DOC_EXAMPLES:
        name = re.search(r"^name: (\S+)$", text, flags=re.M).group(1)
        if name in BUILTINS:
            assert text == (ROOT / "recipes" / f"{name}.yaml").read_text(), name


def test_doc_examples_through_cli(tmp_path, capsys):
    files = []
    for i, text in enumerate(DOC_EXAMPLES):
        files.append(tmp_path / f"ex{i}.yaml")
        files[-1].write_text(text)
    assert cli.main(["check", *map(str, files)]) == 0
    assert capsys.readouterr().out.count("ok    ") == len(files)
