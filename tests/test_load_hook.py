"""A saved cache whose scorers need the attention hook, loaded where no hook is installed:
load_prompt_cache installs it given the model, or refuses; a step without it is refused."""

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.errors import CacheFileError, VeloxError

from conftest import feed, tiny_gemma3

TOKENS = mx.random.randint(0, 500, (1, 140), key=mx.random.key(5))

FRESH_PROCESS = """
import sys
import mlx.core as mx, numpy as np
import veloxquant as vq
from conftest import feed, tiny_llama
model = tiny_llama()
tokens = mx.array(np.load(sys.argv[2]))
kwargs = {"model": model} if sys.argv[3] == "model" else {}
try:
    caches, _ = vq.load_prompt_cache(sys.argv[1], **kwargs)
except vq.VeloxError as e:
    print("refused:", e)
    raise SystemExit(3)
np.save(sys.argv[4], np.array(feed(model, tokens, caches, 1)))
"""


def run_fresh(tmp_path, path, rest, mode):
    np.save(tmp_path / "rest.npy", np.array(rest))
    out = tmp_path / f"out-{mode}.npy"
    tests = Path(__file__).parent
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(path), str(tmp_path / "rest.npy"), mode, str(out)],
        capture_output=True,
        text=True,
        cwd=tests.parent,
        env={**__import__("os").environ, "PYTHONPATH": f"{tests.parent}:{tests}"},
    )
    return proc, (np.load(out) if out.exists() else None)


@pytest.mark.parametrize(
    "recipe, sets", [("h2o", ["budget=48"]), ("tova", ["budget=48"]), ("pyramidkv", ["budget=pyramid(from=64, to=32)"])]
)
def test_fresh_process_installs_the_hook_and_continues_identically(llama_model, tmp_path, recipe, sets):
    caches = vq.make_prompt_cache(llama_model, recipe, sets)
    feed(llama_model, TOKENS[:, :100], caches, 50)
    path = tmp_path / f"{recipe}.safetensors"
    vq.save_prompt_cache(str(path), caches)
    expected = np.array(feed(llama_model, TOKENS[:, 100:], caches, 1))  # the process that made it
    proc, got = run_fresh(tmp_path, path, TOKENS[:, 100:], "model")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert np.array_equal(got, expected)
    proc, got = run_fresh(tmp_path, path, TOKENS[:, 100:], "no-model")
    assert proc.returncode == 3 and got is None
    assert "needs the attention hook" in proc.stdout and "model=model" in proc.stdout


def test_a_step_without_the_hook_is_refused_not_run_with_frozen_scores(llama_model, tmp_path):
    caches = vq.make_prompt_cache(llama_model, "h2o", ["budget=48"])
    feed(llama_model, TOKENS[:, :100], caches, 50)
    vq.uninstall(llama_model)
    with pytest.raises(VeloxError, match="attention did not come through it"):
        llama_model(TOKENS[:, 100:101], cache=caches)


def test_loading_for_another_model_is_refused(llama_model, tmp_path):
    caches = vq.make_prompt_cache(llama_model, "kivi", ["window=32"])
    feed(llama_model, TOKENS[:, :100], caches, 50)
    path = tmp_path / "kivi.safetensors"
    vq.save_prompt_cache(str(path), caches)
    with pytest.raises(CacheFileError, match="made for a model with 4 layers, kv heads 3, head_dim 64"):
        vq.load_prompt_cache(str(path), model=tiny_gemma3())
    loaded, _ = vq.load_prompt_cache(str(path), model=llama_model)
    assert vq.runtime.installed(llama_model)
