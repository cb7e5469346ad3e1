"""veloxquant leaderboard (veloxquant/board/): rows, resumable JSON, columns; on a tiny random Llama."""

import json

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from veloxquant.board import leaderboard, protocol
from veloxquant.errors import VeloxError
from veloxquant.eval import EvalConfig

from test_eval import SENTENCES, CharTokenizer

TINY = EvalConfig(
    windows=1,
    prefix=96,
    score_tokens=32,
    prefill_chunk=32,
    score_chunk=8,
    fidelity_windows=0,
    passkey_lengths=(400,),
    passkey_depths=(0.5,),
    passkey_trials=1,
    passkey_max_tokens=3,
)


def test_rows_cover_every_builtin_with_byte_matched_settings():
    from veloxquant.recipe import builtin_names

    rows = protocol.rows(1152)
    specs = [r[0] for r in rows]
    assert set(builtin_names()) - {"fp16"} <= set(specs) and len(specs) == len(set(specs))
    assert "h2o[budget=288]" in specs and "h2o[budget=144]" in specs
    assert "streaming_llm[window=284]" in specs  # 1/4 of 1152 with its 4 sinks
    assert "kivi[bits=4]" in specs and "kivi[bits=2]" not in specs  # 2 bits is kivi's default
    assert "nsnquant" in specs and "nsnquant[bits=4]" not in specs  # nsn codes 1 or 2 bits only
    first_variant = next(i for i, r in enumerate(rows) if r[2] != "defaults")
    assert all(r[2] != "defaults" for r in rows[first_variant:])  # defaults first


def test_leaderboard_resumes_and_reports_columns(llama_model, tmp_path, monkeypatch):
    monkeypatch.setitem(protocol.PROTOCOLS, "tiny", TINY)
    tok = TokenizerWrapper(CharTokenizer())
    out = tmp_path / "board.json"
    args = (llama_model, tok, "tiny-llama", SENTENCES * 4, "sentences", "tiny", out, ["streaming_llm"])
    first = leaderboard.run(*args, limit=2, progress=False)
    assert first["partial"] and [r["spec"] for r in first["rows"]] == [
        "fp16",
        "streaming_llm",
        "streaming_llm[window=28]",
    ]
    saved = json.loads(out.read_text())
    assert saved["partial"] and saved["versions"]["mlx"] and saved["context"] == 128
    board = leaderboard.run(*args, progress=False)  # resumes: only the missing row runs
    specs = [r["spec"] for r in board["rows"]]
    assert not board["partial"] and specs == [
        "fp16",
        "streaming_llm",
        "streaming_llm[window=28]",
        "streaming_llm[window=12]",
    ]
    by = {r["spec"]: r for r in board["rows"]}
    assert by["fp16"]["held_ratio"] > 1 and by["fp16"]["divergence"]["kld_mean"] <= 1e-6  # 256-token slack
    quarter, eighth = by["streaming_llm[window=28]"], by["streaming_llm[window=12]"]
    assert quarter["held_ratio"] == pytest.approx(32 / 128) and eighth["held_ratio"] == pytest.approx(16 / 128)
    assert eighth["bits_per_element"] == pytest.approx(2.0)
    assert eighth["divergence"]["kld_mean"] > 0 and eighth["delta_ppl_pct"] is not None
    for r in board["rows"][1:]:
        assert r["decode_vs_fp16"] > 0 and r["wall_s"] > 0 and r["cost"]["peak_memory_bytes"] > 0
        assert r["family"] == "eviction" and r["calibration"] is None
    only_tova = (llama_model, tok, "tiny-llama", SENTENCES * 4, "sentences", "tiny", out, ["tova"])
    grown = leaderboard.run(*only_tova, limit=1, progress=False)  # --only adds rows, keeps the others
    assert [r["spec"] for r in grown["rows"]] == specs + ["tova"]
    with pytest.raises(VeloxError, match="pass another --out"):
        leaderboard.run(llama_model, tok, "other-model", SENTENCES, "s", "tiny", out, progress=False)
