"""Saved cache files, mutated (tests/cache_fuzz.py): refused with CacheFileError or loaded
exactly, never a crash, a hang or other numbers. CI runs a bounded count; the long run
is `python tests/cache_fuzz.py --count 20000`."""

import mlx.core as mx
import pytest

import veloxquant as vq
from veloxquant.errors import CacheFileError

import cache_fuzz
from conftest import tiny_gemma3


def test_mutated_files_are_refused_or_load_exactly(tmp_path):
    failures = []
    tally = cache_fuzz.run(250, seed=1, folder=tmp_path, log=failures)
    assert not failures, failures[:5]
    kinds = {k for k, _ in tally}
    assert {
        "truncate at a section boundary",
        "bit flip in array data",
        "bit flip in the metadata",
        "length prefix claiming a huge size",
        "header claiming huge or wrong sizes",
        "metadata of another recipe's file",
    } <= kinds
    assert any(k.startswith("damaged entropy stream") for k in kinds)
    assert sum(tally.values()) > 500


def test_files_of_another_model_or_recipe_are_refused(llama_model, tmp_path):
    paths = cache_fuzz.save_sources(llama_model, tmp_path)
    kivi = str(paths["kivi"])
    with pytest.raises(CacheFileError, match="made for a model with 4 layers"):
        vq.load_prompt_cache(kivi, model=tiny_gemma3())
    h2o = vq.make_prompt_cache(llama_model, "h2o", ["budget=48"])[0].fingerprint
    with pytest.raises(CacheFileError, match="made by recipe 'kivi'"):
        vq.load_prompt_cache(kivi, expect_fingerprint=h2o)


def test_the_entropy_coded_source_really_is_coded(llama_model, tmp_path):
    arrays = mx.load(str(cache_fuzz.save_sources(llama_model, tmp_path)["cachegen"]))
    assert any(k.endswith(".rans") for k in arrays)
