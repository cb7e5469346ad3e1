"""The default model (SmolLM2-135M-Instruct) under the built-in recipes."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

import veloxquant as vq
from veloxquant.bench.parity import chunked_logits
from veloxquant.run import cache_report

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from veloxquant.models import load_model

    return load_model()


@pytest.fixture(scope="module")
def austen_ids(smollm2):
    from veloxquant.data import load_text

    return smollm2[1].encode(load_text("austen"))


def test_identity_recipe_reproduces_mlx_kvcache_logits(smollm2, austen_ids, tmp_path):
    model, _ = smollm2
    tokens = mx.array(austen_ids[:512])[None]
    ref = chunked_logits(model, tokens, mlx_prompt_cache(model), 128)
    recipe = tmp_path / "raw.yaml"
    recipe.write_text("veloxquant: 1\nname: raw\npipeline: identity\n")
    got = chunked_logits(model, tokens, vq.make_prompt_cache(model, str(recipe)), 128)
    assert float(mx.abs(ref - got).max()) == 0.0
    # The fp16 recipe rounds float32 K/V to float16: close, not equal, on the CPU.
    fp16 = chunked_logits(model, tokens, vq.make_prompt_cache(model, "fp16"), 128)
    assert 0 < float(mx.abs(ref - fp16).max()) < 0.1


def test_kivi_holds_under_a_quarter_of_fp16_on_2048_austen_tokens(smollm2, austen_ids):
    model, _ = smollm2
    caches = vq.make_prompt_cache(model, "kivi")
    chunked_logits(model, mx.array(austen_ids[:2048])[None], caches, 512)
    report = cache_report(caches)
    assert report["tokens"] == 2048 and report["attention"] == "by tiers (hook)"
    assert report["ratio"] <= 0.25, report


def test_run_command_prints_one_json_object(tmp_path):
    saved = tmp_path / "c.safetensors"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "veloxquant.cli",
            "run",
            "kivi_sink",
            "--prompt",
            "Name three fruits.",
            "--max-tokens",
            "12",
            "--json",
            "--save-cache",
            str(saved),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for key in (
        "text",
        "tokens",
        "cache_bytes",
        "fp16_bytes",
        "ratio",
        "prefill_tok_s",
        "decode_tok_s",
        "peak_memory_bytes",
        "recipe",
        "fingerprint",
    ):
        assert key in report
    assert report["text"].strip() and report["recipe"] == "kivi_sink"
    caches, meta = vq.load_prompt_cache(str(saved), expect_fingerprint=report["fingerprint"])
    assert caches[0].offset == report["tokens"] and meta == {"recipe": "kivi_sink"}


def test_run_command_puts_recipes_side_by_side():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "veloxquant.cli",
            "run",
            "fp16",
            "kivi",
            "--corpus",
            "austen",
            "--prompt-tokens",
            "600",
            "--max-tokens",
            "6",
            "--warmup",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("== kivi ==") == 1  # the warm-up generations print nothing
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in out.stdout.splitlines()
        if line.startswith("| fp16 ") or line.startswith("| kivi ")
    }
    assert set(rows) == {"fp16", "kivi"}, out.stdout
    assert float(rows["kivi"][0]) < 0.4 * float(rows["fp16"][0])  # cache MiB: 600 tokens, most of them 2-bit


def test_gemma3_identity_recipe_is_exact_across_sliding_windows():
    """Gemma-3-270M: 15 sliding-window layers (512) + 3 global, prompt > window."""
    from veloxquant.data import load_text
    from veloxquant.models import load_model

    model, tokenizer = load_model("gemma3")
    tokens = mx.array(tokenizer.encode(load_text("austen"))[:700])[None]
    ref = chunked_logits(model, tokens, mlx_prompt_cache(model), 256)
    caches = vq.make_prompt_cache(model, _raw_recipe())
    got = chunked_logits(model, tokens, caches, 256)
    assert float(mx.abs(ref - got).max()) == 0.0
    sliding = [c for c in caches if c.plan.window]
    assert len(sliding) == 15 and all(c.size() <= 512 + 256 for c in sliding)


def _raw_recipe() -> str:
    import tempfile

    path = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    path.write("veloxquant: 1\nname: raw\npipeline: identity\n")
    path.close()
    return path.name


@pytest.mark.parametrize("name", ["h2o", "tova", "snapkv", "pyramidkv", "cachegen", "xquant", "turboquant_rvq"])
def test_builtin_runs_in_mlx_lm_generate_with_honest_bytes(smollm2, austen_ids, name):
    """mlx-lm's own generate loop drives the caches; bytes are those of the arrays held."""
    from mlx_lm.generate import generate_step

    model, _ = smollm2
    caches = vq.make_prompt_cache(model, name, ["budget=128"] if name in ("h2o", "tova", "snapkv") else [])
    prompt = mx.array(austen_ids[:384])
    steps = [tok for (tok, _), _ in zip(generate_step(prompt, model, prompt_cache=caches), range(4))]
    assert len(steps) == 4
    report = cache_report(caches)
    assert report["attention"] == "by tiers (hook)"
    from veloxquant.runtime.kinds.tier import UNBOUNDED_STEP

    for c in caches:  # nbytes is the allocation: what state shows plus growth slack (< one step per array)
        shown = sum(a.nbytes for a in c.state)
        slack = sum(a.nbytes // a.shape[2] * UNBOUNDED_STEP for a in c.state if a.ndim >= 3)
        assert shown <= c.nbytes <= shown + slack, (shown, c.nbytes)
    if name in ("h2o", "tova"):
        assert all(c.size() == 128 for c in caches)
    if name == "snapkv":  # decided when the last prompt token arrives alone; it and decode tokens are appended
        assert all(c.size() == 128 + c.offset - 383 for c in caches)  # the last prompt token comes after
    if name == "pyramidkv":
        sizes = [c.size() for c in caches]
        assert sizes[0] == caches[0].offset and sizes[-1] == 64, sizes  # layer 0's budget (448) exceeds it
