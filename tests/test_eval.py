"""veloxquant.eval: the mechanics on a tiny random Llama (fast), one short real-model run (slow)."""

import json
import math
import struct

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from veloxquant.cli import _parser, main
from veloxquant.errors import VeloxError
from veloxquant.eval import EvalConfig, evaluate, expand, fidelity, parse_row, passkey, ppl, report

from conftest import tiny_llama

SENTENCES = " ".join(
    f"Sentence number {i} is about the {w} garden."
    for i, w in enumerate(["green", "old", "quiet", "large", "wet", "bright"] * 40)
)


class CharTokenizer:
    """Characters as tokens (code points clipped to the tiny model's 500-token vocabulary)."""

    eos_token_id = None
    bos_token = None
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [min(ord(c), 499) for c in text]

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)

    def get_vocab(self):
        return {chr(i): i for i in range(500)}

    def apply_chat_template(self, messages, **kw):
        raise NotImplementedError


def random_windows(n, length, seed=3):
    mx.random.seed(seed)
    return mx.random.randint(0, 500, (n, length)).tolist()


# --- rows -------------------------------------------------------------------


def test_rows_parse_and_expand():
    r = parse_row("kivi[bits=4, window=16]")
    assert (r.kind, r.ref, r.sets) == ("recipe", "kivi", ("bits=4", "window=16"))
    q = parse_row("mlx-q3")
    assert (q.kind, q.bits, q.group) == ("mlx-lm", 3, 64)
    with pytest.raises(VeloxError):
        parse_row("mlx-q7")
    with pytest.raises(VeloxError):
        parse_row("no_such_recipe_anywhere")
    rows = expand(["all", "kivi[bits=4]"], [8, 2])
    names = [r.name for r in rows]
    assert names[0] == "fp16" and names.count("fp16") == 1
    assert {"kivi", "kivi[bits=4]", "mlx-q8", "mlx-q2"} <= set(names)


# --- perplexity ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_fp16_recipe_ppl_equals_mlx_kvcache(dtype):
    """Same windows, same protocol: the fp16 recipe scores like mlx-lm's KVCache
    (bit for bit when the model computes in float16; within fp16 rounding of
    K/V in a float32 model)."""
    model = tiny_llama(dtype, layers=2)
    fp16 = parse_row("fp16")
    for w in random_windows(2, 97):
        ours = ppl.window_nll(model, lambda: fp16.make(model), w, prefix=64, prefill_chunk=24, score_chunk=8)
        ref = ppl.window_nll(model, lambda: [KVCache() for _ in model.layers], w, 64, 24, 8)
        assert ours["tokens"] == ref["tokens"] == 32
        assert ours["attention"] == "by tiers (hook)" and ref["attention"] == "mlx-lm SDPA"
        if dtype == mx.float16:
            assert ours["nll"] == ref["nll"]
        else:
            assert math.isclose(ours["nll"], ref["nll"], rel_tol=1e-3)


def test_windows_do_not_overlap():
    ws = ppl.windows(list(range(1000)), 3, 300)
    assert [w[0] for w in ws] == [0, 333, 666] and all(len(w) == 300 for w in ws)
    assert len(ppl.windows(list(range(1000)), 9, 300)) == 3


def test_score_chunk_is_exact_for_fp16(llama_model):
    """Feeding the continuation token by token or in chunks gives the same NLL
    under an uncompressed cache: chunking only matters for compressed tiers."""
    fp16 = parse_row("fp16")
    w = random_windows(1, 81)[0]
    a = ppl.window_nll(llama_model, lambda: fp16.make(llama_model), w, 48, 16, 1)["nll"]
    b = ppl.window_nll(llama_model, lambda: fp16.make(llama_model), w, 48, 16, 32)["nll"]
    assert math.isclose(a, b, rel_tol=1e-4)


# --- attention fidelity -------------------------------------------------------


def test_fidelity_fp16_vs_itself_is_one(llama_model):
    rows = [parse_row("fp16"), parse_row("kivi[window=16,group=16]"), parse_row("mlx-q8"), parse_row("mlx-q2")]
    per_layer = fidelity.measure(
        llama_model, rows[0], rows, random_windows(1, 129), prefix=96, prefill_chunk=32, score_chunk=8
    )
    assert len(per_layer["fp16"]) == len(llama_model.layers)
    assert all(abs(c - 1) < 1e-6 for c in per_layer["fp16"])
    assert all(0.99 < c <= 1 + 1e-6 for c in per_layer["mlx-q8"])
    assert all(c < 1 - 1e-4 for c in per_layer["kivi[window=16,group=16]"])
    assert sum(per_layer["mlx-q2"]) < sum(per_layer["mlx-q8"])
    s = fidelity.summarize(per_layer["mlx-q2"])
    assert s["min"] == per_layer["mlx-q2"][s["min_layer"]] <= s["mean"]


def test_fidelity_feeds_attention_to_caches_that_learn_from_it(llama_model):
    """Saliency routing (zipcache) and per-head bit allocation (adakv_bits) need the
    prefill's attention: the fidelity pass must route it to them, not refuse."""
    rows = [
        parse_row("fp16"),
        parse_row("adakv_bits[window=16,group=16,sinks=0]"),
        parse_row("zipcache[window=64,chunk=64,sinks=0]"),
    ]
    per_layer = fidelity.measure(
        llama_model, rows[0], rows, random_windows(1, 129), prefix=96, prefill_chunk=32, score_chunk=8
    )
    for name in ("adakv_bits[window=16,group=16,sinks=0]", "zipcache[window=64,chunk=64,sinks=0]"):
        assert len(per_layer[name]) == len(llama_model.layers)
        assert all(0.5 < c < 1 - 1e-6 for c in per_layer[name])


# --- passkey --------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_passkey_prompt_puts_key_at_depth(depth):
    tok = CharTokenizer()
    hay = tok.encode(SENTENCES)
    p = passkey.build_prompt(tok, hay, 1200, depth, "48213", passkey.sentence_ends(tok, hay))
    assert len(p.tokens) == 1200
    assert tok.decode(p.tokens[p.needle_at : p.needle_at + p.needle_len]) == passkey.NEEDLE.format(key="48213")
    assert tok.decode(p.tokens[: p.hay_start]) == passkey.INTRO
    assert tok.decode(p.tokens).endswith(passkey.QUESTION)
    # Snapped back to a sentence end, never more than 64 tokens before the asked depth.
    assert depth - 64 / p.hay_tokens <= p.actual_depth <= depth + 1e-9
    if 0 < p.needle_at - p.hay_start < p.hay_tokens:
        assert tok.decode(p.tokens[p.needle_at - 1 : p.needle_at]) == "."
    assert tok.decode(p.tokens).count("48213") == 2


def test_passkey_prompts_are_seeded_and_answers_checked():
    tok = CharTokenizer()
    corpus = tok.encode(SENTENCES * 3)
    a = passkey.make_prompts(tok, corpus, (300, 600), (0.2, 0.8), 2, seed=5)
    b = passkey.make_prompts(tok, corpus, (300, 600), (0.2, 0.8), 2, seed=5)
    assert [p.tokens for p in a] == [p.tokens for p in b] and len(a) == 8
    assert len({p.key for p in a}) > 1
    assert passkey.answer_ok(" 48213.", "48213") and passkey.answer_ok("48213", "48213")
    assert not passkey.answer_ok(" 482130", "48213") and not passkey.answer_ok(" 1 or 48213", "48213")
    assert not passkey.answer_ok("a key", "48213")


# --- the whole evaluation, and compare -----------------------------------------------


def test_evaluate_then_compare(llama_model, tmp_path):
    tok = TokenizerWrapper(CharTokenizer())
    cfg = EvalConfig(
        windows=2,
        prefix=96,
        score_tokens=32,
        prefill_chunk=32,
        score_chunk=8,
        fidelity_windows=1,
        passkey_lengths=(400,),
        passkey_depths=(0.2, 0.7),
        passkey_trials=1,
        passkey_max_tokens=3,
    )
    rows = expand(["kivi[window=32]", "streaming_llm[window=60]"], [4])
    seen = []  # partial results: the rows so far, after each row
    result = evaluate(
        llama_model,
        tok,
        rows,
        SENTENCES * 4,
        cfg,
        {"model": "tiny-llama"},
        progress=False,
        on_row=lambda done: seen.append([r["name"] for r in done]),
    )
    names = [r["name"] for r in result["rows"]]
    assert seen == [names[:i] for i in range(1, len(names) + 1)]
    assert names == ["fp16", "kivi[window=32]", "streaming_llm[window=60]", "mlx-q4"]
    fp16, kivi, stream, q4 = result["rows"]
    assert fp16["delta_ppl_pct"] == 0 and fp16["fidelity"]["mean"] == pytest.approx(1, abs=1e-6)
    # Bytes are measured: 128 tokens held in one 256-token growth step (the slack is held memory)
    # x 4 layers x K,V x 3 heads x 64 dims x 2 bytes; the fp16 baseline counts the 128 tokens only.
    assert fp16["cost"]["cache_bytes"] == 256 * 4 * 2 * 3 * 64 * 2 and fp16["cost"]["ratio"] == 2
    assert kivi["cost"]["ratio"] < 1 and stream["cost"]["tokens"] == 128
    assert stream["cost"]["cache_bytes"] == (4 + 60) * 4 * 2 * 3 * 64 * 2
    assert q4["cost"]["cache_bytes"] > 0 and q4["attention"] == "mlx-lm quantized SDPA"
    for r in result["rows"]:
        assert r["passkey"]["cells"] == [
            {"length": 400, "depth": 0.2, "correct": r["passkey"]["cells"][0]["correct"], "trials": 1},
            r["passkey"]["cells"][1],
        ]
        assert r["cost"]["prefill_tok_s"] > 0 and r["cost"]["peak_memory_bytes"] > 0
        assert len(r["window_ppl"]) == 2 and r["scored_tokens"] == 64
    # Everything is JSON, and compare renders every row and a PNG.
    out = tmp_path / "r.json"
    out.write_text(json.dumps(result))
    md, png = tmp_path / "r.md", tmp_path / "r.png"
    assert main(["compare", str(out), str(out), "--md", str(md), "--png", str(png)]) == 0
    text = md.read_text()
    for name in names:
        assert f"| {name} |" in text
    assert "400 @ 0.2" in text
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 400 and height > 300


def test_pareto_front():
    pts = [(10, 5.0), (5, 20.0), (20, 0.0), (12, 6.0), (5, 30.0)]
    assert report.pareto_front(pts) == [1, 0, 2]


def test_compare_rejects_other_json(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert main(["compare", str(bad)]) == 2


def test_eval_limits_from_the_command_line():
    from veloxquant.eval.cli import config

    args = _parser().parse_args(["eval", "kivi", "--quick", "--windows", "2", "--passkey-depths", "0.3,0.6"])
    cfg = config(args)
    assert (cfg.windows, cfg.prefix, cfg.passkey_depths) == (2, 448, (0.3, 0.6))
    assert cfg.prefix + cfg.score_tokens == 512  # a multiple of mlx-lm's 256-token allocation step, past kivi's window
    args = _parser().parse_args(["eval", "kivi", "--passkey-lengths", ""])
    assert config(args).passkey_lengths == ()
    with pytest.raises(VeloxError):
        config(_parser().parse_args(["eval", "kivi", "--passkey-depths", "1.5"]))


# --- a real model ---------------------------------------------------------------


@pytest.mark.slow
def test_eval_on_smollm2(tmp_path, capsys):
    out = tmp_path / "smol.json"
    assert (
        main(
            [
                "eval",
                "kivi",
                "--quick",
                "--windows",
                "1",
                "--passkey-lengths",
                "320",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    fp16, kivi, q4 = result["rows"]
    assert 5 < fp16["ppl"] < 40 and fp16["passkey"]["accuracy"] == 1
    assert 0 < kivi["delta_ppl_pct"] < 25 and 0.3 < kivi["cost"]["ratio"] < 0.5
    assert q4["name"] == "mlx-q4" and q4["cost"]["ratio"] < 0.3
    assert 0.8 < kivi["fidelity"]["mean"] < 1
    assert "| kivi |" in capsys.readouterr().out


def test_mlx_rows_fail_where_mlx_lm_cannot_quantize():
    """Gemma-3's sliding layers use RotatingKVCache, which mlx-lm's kv_bits refuses: the
    whole evaluation runs and records the row with mlx-lm's own error (no traceback, no
    emulation over every layer)."""
    from conftest import tiny_gemma3

    tok = TokenizerWrapper(CharTokenizer())
    cfg = EvalConfig(
        windows=1,
        prefix=48,
        score_tokens=16,
        prefill_chunk=16,
        score_chunk=8,
        fidelity_windows=1,
        passkey_lengths=(300,),
        passkey_depths=(0.5,),
        passkey_trials=1,
        passkey_max_tokens=2,
    )
    result = evaluate(
        tiny_gemma3(),
        tok,
        expand(["kivi[window=16,group=16]"], [4]),
        SENTENCES * 2,
        cfg,
        {"model": "tiny-gemma3"},
        progress=False,
    )
    fp16, kivi, q4 = result["rows"]
    assert q4["name"] == "mlx-q4" and q4["error"].startswith("NotImplementedError")
    assert "RotatingKVCache" in q4["error"] and q4["ppl"] is None
    assert "error" not in kivi and kivi["ppl"] > 0 and fp16["ppl"] > 0
