"""KL divergence and top-1 agreement vs fp16 (veloxquant/eval/divergence.py), on a tiny random Llama."""

import math

import mlx.core as mx
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from veloxquant.eval import EvalConfig, divergence, evaluate, expand, parse_row, ppl, report

from test_eval import SENTENCES, CharTokenizer, random_windows


def test_compare_is_kl_and_argmax():
    ref = divergence.log_probs(mx.array([[[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]]]))
    logits = mx.array([[[0.0, 2.0, -1.0], [0.0, 1.0, 0.0]]])
    kld, agree = divergence.compare(logits, ref)
    p = [math.exp(x) for x in ref[0, 0].tolist()]
    q = [math.exp(x) for x in divergence.log_probs(logits)[0, 0].tolist()]
    expected = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    assert kld[0].item() == pytest.approx(expected, rel=1e-5) and kld[1].item() == pytest.approx(0, abs=1e-7)
    assert agree.tolist() == [False, True]


def _row_divergence(model, spec, window, ref):
    tracker = divergence.Tracker()
    row = parse_row(spec)
    ppl.window_nll(model, lambda: row.make(model), window, 96, 32, 8, tracker.observer(ref))
    return tracker.summary()


def test_fp16_is_zero_and_lossy_rows_diverge(llama_model):
    window = random_windows(1, 129)[0]
    ref = divergence.reference(llama_model, lambda: parse_row("fp16").make(llama_model), window, 96, 32, 8)
    assert len(ref) == 4 and ref[0].shape[1] == 8  # 32 scored positions in chunks of 8
    same = _row_divergence(llama_model, "fp16", window, ref)
    assert same["positions"] == 32 and same["kld_mean"] <= 1e-6 and same["kld_p99"] <= 1e-6
    assert same["top1_agreement"] == 1.0
    lossy = _row_divergence(llama_model, "kivi[bits=2,window=16,group=16]", window, ref)
    assert lossy["kld_mean"] > 1e-4 and lossy["kld_p99"] >= lossy["kld_mean"]
    assert 0 <= lossy["top1_agreement"] <= 1
    q8 = _row_divergence(llama_model, "mlx-q8", window, ref)
    assert q8["kld_mean"] < lossy["kld_mean"]


def test_evaluate_reports_divergence_columns(llama_model):
    tok = TokenizerWrapper(CharTokenizer())
    cfg = EvalConfig(
        windows=2,
        prefix=96,
        score_tokens=32,
        prefill_chunk=32,
        score_chunk=8,
        fidelity_windows=0,
        passkey_lengths=(),
        passkey_trials=1,
    )
    result = evaluate(
        llama_model, tok, expand(["kivi[bits=2,window=16,group=16]"], []), SENTENCES * 4, cfg, progress=False
    )
    fp16, kivi = result["rows"]
    assert fp16["divergence"]["kld_mean"] <= 1e-6 and fp16["divergence"]["positions"] == 64
    assert kivi["divergence"]["kld_mean"] > 0 and 0 <= kivi["divergence"]["top1_agreement"] <= 1
    table = report.table(result)
    assert "| KLD mean | KLD p99 | top-1 |" in table and f"| {kivi['divergence']['top1_agreement']:.3f} |" in table
