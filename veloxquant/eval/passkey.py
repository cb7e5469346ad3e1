"""Passkey retrieval: a 5-digit key hidden at a depth of a long haystack.

The prompt is the classic one (Mohtashami & Jaggi, 2023): an instruction, a
haystack of real prose (Austen) with one needle sentence planted in it, and a
question whose answer the model greedy-decodes. Correct means the first number
in the answer is the key. The needle sits at a fraction `depth` of the
haystack, snapped back to the nearest sentence end so it never splits a word.
"""

import random
import re
from typing import Dict, List, Sequence

import attrs
from mlx_lm import stream_generate

from ..errors import VeloxError

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n\n"
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
_ANSWERED = re.compile(r"\d+\D")
_ENDS = (".", "!", "?", '."', '!"', '?"')


@attrs.frozen
class PasskeyPrompt:
    tokens: List[int]
    key: str
    length: int  # requested prompt length in tokens
    depth: float  # requested fraction of the haystack before the needle
    needle_at: int  # token index where the needle starts
    needle_len: int
    hay_start: int  # token index of the first haystack token
    hay_tokens: int

    @property
    def actual_depth(self) -> float:
        """Where the needle landed, as a fraction of the haystack."""
        return (self.needle_at - self.hay_start) / self.hay_tokens


def sentence_ends(tokenizer, ids: Sequence[int]) -> List[int]:
    """Indices i such that ids[i] ends a sentence (the needle may go after it)."""
    ends = {t for t in set(ids) if tokenizer.decode([t]).rstrip().endswith(_ENDS)}
    return [i for i, t in enumerate(ids) if t in ends]


def build_prompt(
    tokenizer, haystack: Sequence[int], length: int, depth: float, key: str, ends: Sequence[int] = ()
) -> PasskeyPrompt:
    """A prompt of exactly `length` tokens with the needle at `depth` of the haystack.

    `haystack` must hold the tokens left after instruction, needle and question;
    `ends` (from sentence_ends) lets the needle snap back to a sentence end
    within 64 tokens.
    """
    intro, question = tokenizer.encode(INTRO), tokenizer.encode(QUESTION, add_special_tokens=False)
    needle = tokenizer.encode(NEEDLE.format(key=key), add_special_tokens=False)
    n_hay = length - len(intro) - len(needle) - len(question)
    if n_hay < 1:
        raise VeloxError(
            f"a passkey prompt of {length} tokens leaves no room for a haystack: instruction, "
            f"needle and question take {length - n_hay} tokens"
        )
    if len(haystack) < n_hay:
        raise VeloxError(f"a passkey prompt of {length} tokens needs {n_hay} haystack tokens, got {len(haystack)}")
    cut = round(depth * n_hay)
    snapped = [e + 1 for e in ends if cut - 64 <= e + 1 <= cut]
    cut = snapped[-1] if snapped else cut
    tokens = intro + list(haystack[:cut]) + needle + list(haystack[cut:n_hay]) + question
    return PasskeyPrompt(tokens, key, length, depth, len(intro) + cut, len(needle), len(intro), n_hay)


def make_prompts(
    tokenizer, corpus: Sequence[int], lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int = 0
) -> List[PasskeyPrompt]:
    """The same prompts for every row: keys and haystack offsets come from `seed`."""
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                start = rng.randrange(0, max(1, len(corpus) - length))
                hay = corpus[start : start + length]
                key = str(rng.randint(10000, 99999))
                prompts.append(build_prompt(tokenizer, hay, length, depth, key, sentence_ends(tokenizer, hay)))
    return prompts


def answer_ok(answer: str, key: str) -> bool:
    first = re.search(r"\d+", answer)
    return bool(first) and first.group(0) == key


def ask(model, tokenizer, prompt: PasskeyPrompt, caches, prefill_chunk: int, max_tokens: int = 8) -> Dict:
    """Greedy-decode the answer under `caches`, as `veloxquant run` generates."""
    pieces, last = [], None
    for r in stream_generate(
        model, tokenizer, prompt.tokens, max_tokens=max_tokens, prompt_cache=caches, prefill_step_size=prefill_chunk
    ):
        pieces.append(r.text)
        last = r
        if _ANSWERED.search("".join(pieces)):
            break  # the number is complete: more tokens cannot change the verdict
    answer = "".join(pieces)
    return {
        "length": prompt.length,
        "depth": prompt.depth,
        "key": prompt.key,
        "answer": answer,
        "correct": answer_ok(answer, prompt.key),
        "prompt_tokens": last.prompt_tokens,
        "prompt_tps": last.prompt_tps,
        "generation_tokens": last.generation_tokens,
        "generation_tps": last.generation_tps,
    }


def summarize(results: List[Dict]) -> Dict:
    """Accuracy overall and per (length, depth) cell."""
    cells: Dict[tuple, List[bool]] = {}
    for r in results:
        cells.setdefault((r["length"], r["depth"]), []).append(r["correct"])
    return {
        "accuracy": sum(r["correct"] for r in results) / len(results) if results else None,
        "cells": [
            {"length": L, "depth": d, "correct": sum(v), "trials": len(v)} for (L, d), v in sorted(cells.items())
        ],
        "answers": [{k: r[k] for k in ("length", "depth", "key", "answer", "correct")} for r in results],
    }
