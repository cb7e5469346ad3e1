"""`veloxquant run RECIPE` with no prompt: the shipped sample, long enough to show compression."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from veloxquant.data.sample import sample_prompt

ROOT = Path(__file__).resolve().parent.parent


def test_sample_prompt_ships_with_the_package():
    text = sample_prompt()
    assert text.startswith("The opening chapter of Jane Austen's Pride and Prejudice")
    assert text.rstrip().endswith("and why?") and len(text) > 4000


@pytest.mark.slow
def test_default_run_compresses_most_tokens():
    out = subprocess.run(
        [sys.executable, "-m", "veloxquant.cli", "run", "kivi", "--max-tokens", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["prompt_tokens"] > 1000
    assert report["ratio"] < 0.3 and report["fp16_bytes"] > 3 * report["cache_bytes"]


def test_more_prompt_tokens_than_the_prompt_has_is_an_error():
    """--prompt-tokens only cuts: asking 8,192 of the ~1,200-token sample must fail, not run on 1,200."""
    out = subprocess.run(
        [sys.executable, "-m", "veloxquant.cli", "run", "fp16", "--prompt-tokens", "8192", "--max-tokens", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--prompt-tokens 8192: the prompt has only" in out.stderr and "--corpus austen" in out.stderr
