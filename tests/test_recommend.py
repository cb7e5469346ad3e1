"""veloxquant recommend: predicted bytes vs measured, and the choice logic on three scenarios."""

import types

import mlx.core as mx
import pytest

from veloxquant.board import predict
from veloxquant.board import recommend as rec
from veloxquant.cli import main
from veloxquant.compiler import SMOLLM2_135M, ModelShape
from veloxquant.errors import VeloxError
from veloxquant.eval.cost import held_bytes
from veloxquant.eval.feed import prefill
from veloxquant.eval.rows import parse_row
from veloxquant.runtime import uninstall


@pytest.mark.parametrize(
    "spec", ["kivi[window=32]", "kivi[bits=4]", "streaming_llm[window=60]", "h2o[budget=128]", "fp16"]
)
def test_predicted_bytes_match_what_the_cache_holds(llama_model, spec):
    context = 1100
    mx.random.seed(0)
    tokens = mx.random.randint(0, 500, (1, context))
    row = parse_row(spec)
    caches = row.make(llama_model)
    try:
        prefill(llama_model, tokens, caches, 256)
        measured = held_bytes(caches)
    finally:
        uninstall(llama_model)
    predicted = predict.held_bytes(row.ref, row.sets, ModelShape.from_model(llama_model), context)
    assert predicted == pytest.approx(measured, rel=0.02)


def _row(spec, family, dppl, kld):
    return {
        "spec": spec,
        "family": family,
        "setting": "defaults",
        "held_ratio": 0.2,
        "delta_ppl_pct": dppl,
        "divergence": {"kld_mean": kld, "top1_agreement": 0.9},
        "passkey": {"accuracy": 1.0},
    }


BOARD = {
    "veloxquant_leaderboard": 1,
    "model": "SmolLM2-135M-Instruct",
    "protocol_name": "cpu",
    "source": "x",
    "rows": [
        _row("fp16", "baseline", 0, 0),
        _row("kivi[bits=4]", "compression", 0.5, 0.001),
        _row("kivi", "compression", 4.0, 0.02),
        _row("h2o[budget=1024]", "eviction", 12.0, 0.2),
        _row("streaming_llm[window=252]", "eviction", 30.0, 0.5),
    ],
}
GEMMA3_270M = ModelShape("gemma-3-270m", (1,) * 18, (256,) * 18, tuple(None if i % 6 == 5 else 512 for i in range(18)))
LLAMA3_8B = ModelShape.uniform("llama-3-8b", 32, 8, 128)


def test_smollm2_32k_in_1gb_takes_the_best_quality():
    answer = rec.recommend([BOARD], SMOLLM2_135M, 32768, memory=rec.parse_size("1GB"), model="SmolLM2-135M-Instruct")
    # fp16 at 32k is 755 MB on SmolLM2: every measured recipe fits, the lowest ΔPPL wins (fp16 is no candidate).
    assert answer["fp16_bytes"] == 23040 * 32768
    assert answer["choice"]["spec"] == "kivi[bits=4]" and answer["fits"] == 4


def test_gemma3_128k_within_one_percent():
    answer = rec.recommend([BOARD], GEMMA3_270M, 131072, ratio=0.5, max_dppl=1.0, model="gemma-3-270m")
    assert answer["choice"]["spec"] == "kivi[bits=4]"
    assert answer["choice"]["measured_on"] == "SmolLM2-135M-Instruct"  # no Gemma board: says where it was measured
    assert answer["choice"]["predicted_bytes"] <= 0.5 * answer["fp16_bytes"]
    text = rec.render(answer, "gemma3")
    assert "measured on SmolLM2-135M-Instruct" in text and "veloxquant run kivi --model gemma3 --set bits=4" in text


def test_llama3_8b_128k_in_8gb_and_nothing_fits():
    answer = rec.recommend([BOARD], LLAMA3_8B, 131072, memory=8 * 10**9)
    fp16 = 32 * 8 * 128 * 2 * 2 * 131072
    assert answer["fp16_bytes"] == fp16
    # 8 GB is 0.47 of fp16: kivi[bits=4] (~0.28) fits and is best
    assert answer["choice"]["spec"] == "kivi[bits=4]" and answer["choice"]["predicted_bytes"] <= 8e9
    tight = rec.recommend([BOARD], LLAMA3_8B, 131072, memory=8 * 10**9, max_dppl=0.1)
    assert tight["choice"] is None and "veloxquant tune" in rec.render(tight, None)
    small = rec.recommend([BOARD], LLAMA3_8B, 131072, memory=int(2e9))  # 0.12 of fp16: only eviction
    assert small["choice"]["family"] == "eviction"


def test_a_recipe_that_does_not_compile_for_the_shape_is_named_not_fatal():
    """A uniform --shape carries no RoPE settings, so a2ats (keys coded before RoPE) cannot compile for it:
    the recommendation goes on without it and says so."""
    board = {**BOARD, "rows": BOARD["rows"] + [_row("a2ats", "compression", 0.1, 0.001)]}
    answer = rec.recommend([board], LLAMA3_8B, 131072, memory=8 * 10**9)
    assert answer["choice"]["spec"] == "kivi[bits=4]"
    assert [spec for spec, _ in answer["refused"]] == ["a2ats"] and "RoPE" in answer["refused"][0][1]
    assert "not for this shape: a2ats (" in rec.render(answer, None)


def test_check_runs_the_recommended_recipe_and_measures_its_bytes(llama_model):
    """--check: the recommended recipe run over the asked context holds the predicted bytes (within 2%)."""
    words = types.SimpleNamespace(encode=lambda text: [1 + ord(c) % 400 for c in text])
    answer = rec.recommend([BOARD], ModelShape.from_model(llama_model), 700, ratio=0.5)
    assert answer["choice"]["spec"] == "kivi[bits=4]"
    got = rec.check(llama_model, words, "It is a truth universally acknowledged. ", answer, chunk=128)
    assert got["within"] and got["measured_bytes"] > 0
    assert "checked: kivi[bits=4] holds" in rec.render_check(got, answer)
    off = {**answer, "choice": {**answer["choice"], "predicted_bytes": got["measured_bytes"] * 1.05}}
    assert not rec.check(llama_model, words, "It is a truth universally acknowledged. ", off, chunk=128)["within"]


def test_bad_input():
    with pytest.raises(VeloxError, match="--memory"):
        rec.parse_size("lots")
    assert rec.parse_size("512MiB") == 512 * 2**20 and rec.parse_size("8G") == 8 * 10**9
    with pytest.raises(VeloxError, match="--shape"):
        rec.parse_shape("32x8")
    with pytest.raises(VeloxError, match="exactly one"):
        rec.recommend([BOARD], SMOLLM2_135M, 1000)


def test_recommend_command(tmp_path, capsys):
    import json

    path = tmp_path / "leaderboard-x.json"
    path.write_text(json.dumps(BOARD))
    assert (
        main(["recommend", "--shape", "32x8x128", "--context", "131072", "--memory", "8GB", "--board", str(path)]) == 0
    )
    out = capsys.readouterr().out
    assert "recommended: kivi[bits=4]" in out and "from the recipe's plan" in out
    assert main(["recommend", "--context", "1000", "--ratio", "0.001", "--board", str(path)]) == 1


def test_list_states_held_bytes_at_a_context_in_80_columns(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "4096 tokens" in lines[0] and all(len(line) <= 80 for line in lines)
    held = {line.split()[0]: line.split()[1] for line in lines[2:] if not line.startswith("¹")}
    assert "nan" not in held.values() and held["xkv"] == "run¹" and held["fp16"] == "1.000"
    assert held["streaming_llm"] == "0.250" and float(held["kivi"]) < 0.25  # 1024 of 4096 tokens; 2-bit codes


def test_explain_names_route_fields_and_shows_only_non_defaults(capsys):
    assert main(["explain", "tova"]) == 0
    out = capsys.readouterr().out
    assert "evict(budget=256, score=current)" in out and "kappa" not in out and "evict(256," not in out
    assert main(["explain", "kivi_sink"]) == 0
    out = capsys.readouterr().out
    assert "sink(n=5)" in out and "recent(n=128)" in out
