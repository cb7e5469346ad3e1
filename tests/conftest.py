# The README's test command gets the CPU speed the `veloxquant` command gets: where a
# system OpenBLAS is installed and MLX would use its bundled reference BLAS (~30x slower
# float32 matmuls), pytest starts again once with OpenBLAS preloaded (veloxquant/blas.py;
# VELOXQUANT_NO_OPENBLAS=1 keeps the bundled BLAS, whose float32 error the tolerances cover).
import os

# The tests compare float32 results (a batch against each sequence alone, a route against another);
# on CUDA, MLX runs float32 matmuls as TF32 unless told otherwise (ml-explore/mlx#3860), an error the
# tolerances are not made for. MLX's own test harness pins it the same way.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402
from mlx_lm.models import gemma3_text, llama  # noqa: E402

from veloxquant import blas as _blas  # noqa: E402


def pytest_configure(config):
    # pytest has redirected stdout/stderr to capture files by now: give the new process
    # the terminal back first (if nothing is started, capturing simply resumes).
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    _blas.maybe_reexec(["test"])
    if capture is not None:
        capture.resume_global_capture()
    # One OpenBLAS thread: recorded logits hold on any machine (sums split by thread count differ in
    # float32), and each pytest-xdist worker (the README's `-n auto`) takes one core without spinning.
    _blas.pin_threads(1)


class CharTokenizer:
    """A stand-in tokenizer for the random models (vocabulary 500): one id per character. The texts of a
    model pass the caches run (KVzip's repeat instruction) are tokenized with it, as load_model's are."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 500 for c in text]


def _with_tokenizer(model):
    from veloxquant.models.tokenizers import remember_tokenizer

    remember_tokenizer(model, CharTokenizer())
    return model


def tiny_llama(dtype=mx.float32, layers=4):
    """A random-init Llama with SmolLM2's head layout (3 kv heads of 64, GQA 3)."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=192,
        num_hidden_layers=layers,
        intermediate_size=256,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        vocab_size=500,
        head_dim=64,
        rope_theta=100000.0,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(dtype)
    return _with_tokenizer(model)


def tiny_gemma3(window=32):
    """A random-init Gemma 3 text model: sliding-window layers plus a global one."""
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=2,
        head_dim=64,
        num_key_value_heads=1,
        vocab_size=500,
        sliding_window=window,
        sliding_window_pattern=2,
    )
    mx.random.seed(1)
    return _with_tokenizer(gemma3_text.Model(args))


@pytest.fixture(scope="session")
def llama_model():
    return tiny_llama()


@pytest.fixture(autouse=True)
def _restore_attention():
    yield
    import veloxquant

    veloxquant.uninstall()


def feed(model, tokens, cache, chunk):
    """Logits for `tokens` fed through `cache` in chunks, as generation prefills."""
    outs = [model(tokens[:, s : s + chunk], cache=cache) for s in range(0, tokens.shape[1], chunk)]
    return mx.concatenate(outs, axis=1)


def pipeline_recipe(tmp_path, pipeline, name="r"):
    """A recipe file holding just `pipeline`, loaded."""
    from veloxquant.recipe import load_recipe

    path = tmp_path / f"{name}.yaml"
    path.write_text(f"veloxquant: 1\nname: {name}\npipeline: |\n  " + pipeline.replace("\n", "\n  ") + "\n")
    return load_recipe(str(path))
