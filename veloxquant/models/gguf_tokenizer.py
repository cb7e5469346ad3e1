"""Rebuild a Hugging Face ``tokenizer.json`` from the vocabulary stored in a GGUF file.

A GGUF file carries no tokenizer.json, only llama.cpp's ``tokenizer.ggml.*`` metadata.
mlx-lm loads tokenizers through ``transformers.AutoTokenizer``, so we rebuild the
equivalent ``tokenizers`` pipeline here: byte-level BPE for ``gpt2`` vocabularies
(SmolLM2, Llama 3, Qwen 2) and sentencepiece-style BPE with byte fallback for
``llama`` vocabularies (Gemma, Llama 2).
"""

from __future__ import annotations

import warnings
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .errors import ModelError

# llama.cpp token types (see gguf.TokenType): only these two need special handling.
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Gemma 3 base GGUFs ship without a chat template; this is the text-only part of the
# template Google publishes with the instruction-tuned checkpoints.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _byte_level_pre_tokenizer(pre: str | None):
    """The split llama.cpp applies before BPE, keyed by ``tokenizer.ggml.pre``."""
    if pre == "smollm":
        # SmolLM2 splits every digit on its own before the GPT-2 regex.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in (None, "default", "gpt2", "gpt-2"):
        # Better a close tokenizer than none: the GPT-2 regex differs only on edge cases.
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using the GPT-2 split", stacklevel=3)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _spm_merges(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a sentencepiece vocabulary (it stores none).

    Every way of cutting a token into two vocabulary pieces is a merge; merges are
    ranked by the token they produce, as transformers' ``generate_merges`` does.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in rank.items():
        local = [
            (token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _spm_model(arch: str, meta: dict[str, Any]) -> tuple[Tokenizer, list[str]]:
    tokens = list(meta["tokenizer.ggml.tokens"])
    if arch.startswith("gemma"):
        # Gemma stores runs of spaces as real spaces but matches them as "▁" runs, and
        # its merge order follows file order, not the (unrelated) scores.
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        rank = dict(zip(tokens, meta["tokenizer.ggml.scores"]))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=_spm_merges(tokens, rank), unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    strip = []
    if arch.startswith("gemma"):
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        prepend = "first" if meta.get("tokenizer.ggml.add_space_prefix", True) else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend, split=False)
        strip = [decoders.Strip(" ", 1, 0)] if prepend == "first" else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok, tokens


def _bpe_model(meta: dict[str, Any]) -> Tokenizer:
    tokens = list(meta["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.merges" not in meta:
        raise ModelError("GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tok.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, tokens


def _token(meta: dict[str, Any], key: str) -> str | None:
    idx = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta["tokenizer.ggml.tokens"]
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None


def build_tokenizer(arch: str, meta: dict[str, Any]):
    """Return ``(tokenizer, tokenizer_config, special_tokens_map)`` for a GGUF's metadata.

    ``meta`` maps GGUF keys to plain Python values (lists for arrays).
    """
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if kind == "gpt2":
        tok, spelled = _bpe_model(meta)
        add_bos_default = False
    elif kind == "llama":
        tok, spelled = _spm_model(arch, meta)
        add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies
    else:
        raise ModelError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # Control tokens (<|im_end|>, <bos>, ...) must never be split by BPE.
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == _CONTROL]
    )
    # User-defined tokens (Gemma's "\n\n", "<table>") are matched whole, like llama.cpp
    # does; ones we respelled (space runs) are left to BPE, which reaches the same ids.
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, s, ty in zip(tokens, spelled, types)
        if ty == _USER_DEFINED and t == s
    ]
    if user:
        tok.add_tokens(user)

    specials = {
        name: _token(meta, key)
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
    }
    specials = {k: v for k, v in specials.items() if v is not None}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if add_bos and "bos_token" in specials:
        bos, bos_id = specials["bos_token"], meta["tokenizer.ggml.bos_token_id"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )

    chat_template = meta.get("tokenizer.chat_template")
    if chat_template is None and arch.startswith("gemma3") and "<start_of_turn>" in tokens:
        chat_template = GEMMA_CHAT_TEMPLATE
    config = {
        # The generic fast tokenizer class uses tokenizer.json exactly as written,
        # instead of re-deriving a pipeline from the model type.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    # model_max_length is left unset on purpose: transformers warns on every encode of a
    # longer text (a whole novel for perplexity), although models only see windows of it.
    if chat_template is not None:
        config["chat_template"] = chat_template
    return tok, config, specials
