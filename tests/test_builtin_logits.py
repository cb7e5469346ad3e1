"""Every built-in's logits on the default model equal the record captured before the runtime was
restructured (tests/data/builtin_logits/CORE.json, written by `python tests/builtin_logits.py write`).

A record holds for one OpenBLAS kernel family; on a machine whose family has none the test skips,
saying so: write one from a tree before the change under test."""

import json

import numpy as np
import pytest

import builtin_logits as record

pytestmark = pytest.mark.slow
PATH = record.record_path()
RECORDED = json.loads(PATH.read_text())["recipes"] if PATH is not None and PATH.exists() else {}
NONE_HERE = f"no logits record for OpenBLAS kernel family {PATH and PATH.stem} (tests/builtin_logits.py write)"


@pytest.fixture(scope="module")
def model_and_prompt():
    return record.load()


@pytest.mark.skipif(not RECORDED, reason=NONE_HERE)
@pytest.mark.parametrize("name", sorted(n for n, r in RECORDED.items() if "steps" in r) or ["-"])
def test_logits_equal_the_record(model_and_prompt, name):
    model, ids = model_and_prompt
    got = record.recipe_logits(model, ids, name)
    if "skipped" in got:
        pytest.skip(got["skipped"])
    for step, (g, w) in enumerate(zip(got["steps"], RECORDED[name]["steps"], strict=True)):
        assert g["token"] == w["token"], (name, step)
        assert g["top_ids"] == w["top_ids"], (name, step)
        np.testing.assert_allclose(g["probe"] + g["top"], w["probe"] + w["top"], rtol=0, atol=1e-5)
