"""`veloxquant schema`: generated from the stage registry; every good recipe validates, wrong types do not."""

import json
import re
from pathlib import Path

import attrs
import jsonschema
import pytest
import yaml

from veloxquant import cli
from veloxquant.compiler.schema import completions, recipe_schema
from veloxquant.recipe import builtin_names
from veloxquant.recipe.fmt import format_file
from veloxquant.recipe.load import load_recipe
from veloxquant.stages import REGISTRY
from veloxquant.stages.registry import in_range, stage

ROOT = Path(__file__).resolve().parent.parent
GOOD = sorted((Path(__file__).parent / "recipes_good").glob("*.yaml"))
BUILTINS = [ROOT / "recipes" / f"{n}.yaml" for n in builtin_names()]
DOC_EXAMPLES = [
    m
    for m in re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "recipe-language.md").read_text(), re.S)
    if m.startswith("veloxquant: 1")
]


@pytest.fixture(scope="module")
def validator():
    schema = recipe_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("path", BUILTINS + GOOD, ids=lambda p: p.name)
def test_good_recipes_validate(validator, path):
    validator.validate(yaml.safe_load(path.read_text()))


def test_doc_examples_validate(validator):
    assert DOC_EXAMPLES
    for text in DOC_EXAMPLES:
        validator.validate(yaml.safe_load(text))


@pytest.mark.parametrize(
    "patch, where",
    [
        ({"veloxquant": "1"}, "veloxquant"),
        ({"name": 3}, "name"),
        ({"pipline": "fp16"}, ""),  # unknown field
        ({"pipeline": ["recent(8)"]}, "pipeline"),
        ({"params": {"bits": {"default": 2, "type": "integer"}}}, "params"),
        ({"params": {"bits": {"default": 2, "dok": "x"}}}, "params"),
        ({"params": {"bits": {"x": 1}}}, "params"),
        ({"layers": {"0": {"pipeline": 3}}}, "layers"),
        ({"layers": {"1-": {"pipeline": "fp16"}}}, "layers"),
        ({"layers": {"0": {"bits": 4}}}, "layers"),
    ],
)
def test_wrong_types_are_rejected(validator, patch, where):
    doc = {**yaml.safe_load((ROOT / "recipes" / "kivi.yaml").read_text()), **patch}
    errors = list(validator.iter_errors(doc))
    assert errors
    assert any(list(e.absolute_path)[:1] == ([where] if where else []) for e in errors)


def test_stage_params_come_from_the_registry():
    stages = recipe_schema()["definitions"]["stages"]
    assert set(stages) == set(REGISTRY)
    bits = stages["affine"]["properties"]["bits"]
    assert (bits["type"], bits["minimum"], bits["maximum"], bits["default"]) == ("integer", 1, 8, 4)
    assert stages["affine"]["properties"]["axis"]["enum"] == ["token", "channel"]
    assert stages["evict"]["x-veloxquant-needs"] == ["attention"]
    assert stages["recent"]["x-veloxquant-family"] == "route"


def test_a_new_stage_appears_without_edits():
    @stage("zz_test_stage", "transform")
    @attrs.frozen
    class Zz:
        """A stage registered by a test. `k` is how much."""

        k: int = attrs.field(default=3, validator=in_range(1, 9))

    try:
        s = recipe_schema()["definitions"]["stages"]["zz_test_stage"]
        assert s["properties"]["k"]["maximum"] == 9 and "`k` is how much" in s["properties"]["k"]["description"]
        assert "zz_test_stage" in recipe_schema()["definitions"]["pipeline"]["description"]
    finally:
        del REGISTRY["zz_test_stage"]


def test_completions_read_the_schema():
    items = completions(recipe_schema(), "affine")
    assert items[0].startswith("bits=") and "1..8 = 4" in items[0]
    assert "token | channel = token" in items[2]


def test_cli_writes_the_schema(tmp_path, capsys):
    out = tmp_path / "recipe.schema.json"
    assert cli.main(["schema", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["properties"]["veloxquant"]["const"] == 1
    assert cli.main(["schema", "--stage", "recnt"]) == 2
    assert "did you mean 'recent'" in capsys.readouterr().err


def test_modeline_comment_loads_and_survives_fmt(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text(
        "# yaml-language-server: $schema=./recipe.schema.json\n"
        "veloxquant: 1\nname: r\nextends: kivi\nparams:\n  bits: 4\n"
    )
    load_recipe(str(f))
    text, _ = format_file(str(f))
    assert text.startswith("# yaml-language-server: $schema=./recipe.schema.json\nveloxquant: 1\n")
