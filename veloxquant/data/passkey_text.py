"""Synthetic passkey-retrieval text (DuoAttention's calibration data): documents of prose with
5-digit keys planted at random depths, each followed by the question and its answer, so the
answer's queries must reach far back to the needle (retrieval heads) while the prose around
them is local (streaming heads). Deterministic for a seed."""

import random

INTRO = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
ANSWER = "\n\nWhat is the pass key? The pass key is {key}.\n\n"
DOCUMENT_CHARS = 6000  # about 1.4k tokens of prose per document


def passkey_corpus(haystack: str, seed: int = 0, documents: int = 24) -> str:
    """`documents` passkey documents cut from consecutive stretches of `haystack`."""
    rng = random.Random(seed)
    out = []
    at = 0
    for _ in range(documents):
        hay = haystack[at : at + DOCUMENT_CHARS]
        at = (at + DOCUMENT_CHARS) % max(1, len(haystack) - DOCUMENT_CHARS)
        key = f"{rng.randrange(10000, 100000)}"
        cut = hay.rfind(". ", 0, int(len(hay) * rng.uniform(0.05, 0.8))) + 1  # after a sentence
        out.append(INTRO + hay[:cut] + NEEDLE.format(key=key) + hay[cut:] + ANSWER.format(key=key))
    return "".join(out)
