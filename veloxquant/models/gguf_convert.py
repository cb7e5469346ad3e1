"""Convert a llama.cpp GGUF file into an mlx-lm model folder.

The folder holds ``config.json``, ``model.safetensors`` (float16 by default),
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``, so
``mlx_lm.load(folder)`` works.  Quantized tensors are dequantized with
``gguf.quants.dequantize``; we re-quantize later with our own schemes, so starting
from dense weights is what we want.

Supported architectures: ``llama`` (SmolLM2, Llama 2, TinyLlama, ...) and
``gemma3`` (Gemma 3 text models).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from .errors import ModelError
from .gguf_tokenizer import build_tokenizer

# Bumped whenever the output of the converter changes, so cached folders get rebuilt.
CONVERTER_VERSION = 1

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_NAMES = {
    **_LLAMA_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def _f32(x: float) -> float:
    # GGUF stores float32; going through its shortest repr turns 9.99999974e-06 into 1e-05.
    return float(str(np.float32(x)))


def read_metadata(reader) -> dict[str, Any]:
    """All GGUF key/value fields as plain Python values (arrays become lists)."""
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception as exc:  # a malformed field is a corrupt file
            raise ModelError(f"cannot decode GGUF field {key!r}: {exc}") from exc
    return meta


def open_gguf(path: str | os.PathLike):
    """Open a GGUF file, turning every failure into a ``ModelError``."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except Exception as exc:  # GGUFReader raises ValueError, struct.error, IndexError, ...
        raise ModelError(
            f"not a readable GGUF file (corrupt or truncated?): {path} ({type(exc).__name__}: {exc})"
        ) from exc


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (it reorders rows for its interleaved rope)."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _llama_config(meta: dict, shapes: dict) -> dict:
    a = "llama"
    n_head = int(meta[f"{a}.attention.head_count"])
    hidden = int(meta[f"{a}.embedding_length"])
    head_dim = int(meta.get(f"{a}.attention.key_length") or meta.get(f"{a}.rope.dimension_count") or hidden // n_head)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta[f"{a}.feed_forward_length"]),
        "num_hidden_layers": int(meta[f"{a}.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{a}.context_length", 4096)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
    }
    if meta.get(f"{a}.rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": _f32(meta[f"{a}.rope.scaling.factor"])}
    elif meta.get(f"{a}.rope.scaling.type") not in (None, "none"):
        raise ModelError(f"unsupported rope scaling {meta[f'{a}.rope.scaling.type']!r}")
    if "rope_freqs" in shapes:  # Llama 3.1-style frequency factors: not stored fully in GGUF
        raise ModelError("GGUF uses rope_freqs (Llama 3.1 rope); not supported")
    return cfg


def _gemma3_config(meta: dict, shapes: dict) -> dict:
    a = "gemma3"
    n_layers = int(meta[f"{a}.block_count"])
    n_head = int(meta[f"{a}.attention.head_count"])
    hidden = int(meta[f"{a}.embedding_length"])
    head_dim = int(meta.get(f"{a}.attention.key_length", 256))
    pattern = 6  # llama.cpp hard-codes Gemma 3's 5 local : 1 global layer pattern
    # llama.cpp scales queries by 1/sqrt(head_dim), except the 27B (62 layers) which uses
    # hidden/heads; mlx-lm expresses the same thing as query_pre_attn_scalar.
    scalar = hidden // n_head if n_layers == 62 else head_dim
    cfg = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": int(meta[f"{a}.feed_forward_length"]),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32(meta.get(f"{a}.rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10000.0,  # not stored in GGUF; llama.cpp hard-codes it too
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(meta.get(f"{a}.attention.sliding_window", 512)),
        "sliding_window_pattern": pattern,
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)],
        "max_position_embeddings": int(meta.get(f"{a}.context_length", 32768)),
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "rope_scaling": None,
    }
    if meta.get(f"{a}.rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _f32(meta[f"{a}.rope.scaling.factor"])}
    return cfg


def _llama_transform(name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    if name.endswith("q_proj.weight"):
        return _unpermute(w, cfg["num_attention_heads"])
    if name.endswith("k_proj.weight"):
        return _unpermute(w, cfg["num_key_value_heads"])
    return w


def _gemma3_transform(name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    # llama.cpp stores Gemma norms as (1 + w); mlx-lm's Gemma RMSNorm adds the 1 itself.
    return w - 1.0 if name.endswith("norm.weight") else w


# arch -> (config builder, per-layer tensor names, tensor transform)
_ARCHS: dict[str, tuple[Callable, dict, Callable]] = {
    "llama": (_llama_config, _LLAMA_LAYER_NAMES, _llama_transform),
    "gemma3": (_gemma3_config, _GEMMA3_LAYER_NAMES, _gemma3_transform),
}


def _hf_name(gguf_name: str, layer_names: dict) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
        return f"model.layers.{int(parts[1])}.{layer_names[parts[2]]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise ModelError(f"unexpected tensor {gguf_name!r} in GGUF file")


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        flat = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:  # a quantization type gguf-py cannot decode
        raise ModelError(f"tensor {tensor.name}: {exc}") from exc
    except (ValueError, IndexError) as exc:
        raise ModelError(f"tensor {tensor.name} is malformed: {exc}") from exc
    # GGUF lists dimensions fastest-first; numpy/PyTorch order is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(flat, dtype=np.float32).reshape(shape)


def _convert_weights(reader, arch: str, meta: dict, dtype, progress: bool):
    make_config, layer_names, transform = _ARCHS[arch]
    shapes = {t.name.rpartition(".")[0]: tuple(reversed(t.shape)) for t in reader.tensors}
    if "token_embd" not in shapes:
        raise ModelError("GGUF file has no token_embd tensor")
    cfg = make_config(meta, shapes)
    cfg["vocab_size"] = int(shapes["token_embd"][0])
    cfg["tie_word_embeddings"] = "output" not in shapes
    weights = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", file=sys.stderr, disable=not progress, leave=False):
        name = _hf_name(t.name, layer_names)
        w = transform(name, _dequantize(t), cfg)
        if not np.isfinite(w).all():
            raise ModelError(f"tensor {t.name} has non-finite values (corrupt file?)")
        if dtype == mx.float16 and np.abs(w).max() > 65504:
            raise ModelError(f"tensor {t.name} overflows float16; convert with dtype='float32'")
        weights[name] = mx.array(w).astype(dtype)
    return cfg, weights


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float16",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert ``gguf_path`` into an mlx-lm folder at ``out_dir`` and return its path.

    The folder is written next to ``out_dir`` under a temporary name and renamed at
    the end, so an interrupted conversion never leaves a half-written model behind.
    Raises ``ModelError`` for a missing or corrupt file or an unsupported architecture.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass overwrite=True)")
    if progress:  # parsing a large vocabulary takes a while: say what is happening
        print(f"veloxquant: reading {Path(gguf_path).name}", file=sys.stderr, flush=True)
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ModelError(f"unsupported GGUF architecture {arch!r} (supported: {sorted(_ARCHS)})")

    cfg, weights = _convert_weights(reader, arch, meta, _DTYPES[dtype], progress)
    if progress:
        print("veloxquant: building tokenizer", file=sys.stderr, flush=True)
    tokenizer, tok_config, specials = build_tokenizer(arch, meta)
    for key, tid in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{tid}" in meta:
            cfg[key] = int(meta[f"tokenizer.ggml.{tid}"])
    vocab = tokenizer.get_vocab()
    if arch == "gemma3" and "<end_of_turn>" in vocab and "eos_token_id" in cfg:
        # Chat turns end with <end_of_turn>, not <eos>; mlx-lm stops on every id listed.
        cfg["eos_token_id"] = [cfg["eos_token_id"], vocab["<end_of_turn>"]]
    cfg["torch_dtype"] = dtype
    cfg["veloxquant"] = {"converter_version": CONVERTER_VERSION, "source": Path(gguf_path).name}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the final folder should not be
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        for fname, obj in (
            ("config.json", cfg),
            ("tokenizer_config.json", tok_config),
            ("special_tokens_map.json", specials),
        ):
            (tmp / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
