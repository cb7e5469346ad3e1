"""The default prompt of `veloxquant run`: shipped with the package, so the first run needs no download.

About 1,200 tokens (SmolLM2's tokenizer, chat template included): with the
built-in recipes' 128-token fp16 windows, the compressed tiers hold ~90% of
the context, so the report shows what a recipe saves. A short prompt would
fit the fp16 window and show a ratio of 1.000.
"""

from pathlib import Path

SAMPLE = Path(__file__).with_name("sample_prompt.txt")


def sample_prompt() -> str:
    return SAMPLE.read_text(encoding="utf-8")
