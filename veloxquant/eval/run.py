"""One evaluation: every row (fp16 first) on the same windows and prompts.

Order of work: the fidelity pass (all rows at once, fp16 driving), then per
row its perplexity windows and its passkey prompts, inside one peak-memory
measurement. Results are plain JSON (see docs/eval.md for the fields).
"""

import math
import platform
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import attrs
import mlx.core as mx
from tqdm import tqdm

from ..compiler import ModelShape
from ..runtime import uninstall
from . import cost, divergence, fidelity, passkey, ppl
from .config import EvalConfig
from .rows import Row

SCHEMA = 1


def _row_cost(shape: ModelShape, wins: List[Dict], asked: List[Dict], peak: Optional[cost.PeakMemory]) -> Dict:
    last = wins[-1] if wins else None
    prefill_tps = sum(w["prefill_tokens"] for w in wins) / sum(w["prefill_s"] for w in wins) if wins else None
    gen_s = sum(a["generation_tokens"] / a["generation_tps"] for a in asked if a["generation_tps"])
    decode_tps = sum(a["generation_tokens"] for a in asked) / gen_s if gen_s else None
    return cost.summary(
        last["cache_bytes"] if last else 0,
        last["context"] if last else 0,
        cost.fp16_bytes(shape, last["context"]) if last else 0,
        peak,
        prefill_tps,
        decode_tps,
    )


def evaluate(
    model,
    tokenizer,
    rows: Sequence[Row],
    text: str,
    cfg: EvalConfig,
    meta: Optional[Dict] = None,
    progress: bool = True,
    only: Optional[Sequence[str]] = None,
    on_row: Optional[Callable[[List[Dict]], None]] = None,
    references: Optional[Dict] = None,
) -> Dict:
    """Measure every row; rows[0] must be the fp16 baseline.

    `only`: report just these rows (every row still takes part in the fidelity
    pass); how eval/distributed.py splits one evaluation into Ray tasks.
    `on_row`: called with the rows measured so far after each row (partial results).
    `references`: a dict kept between calls on the same model, windows and
    config, so fp16's reference distributions are computed once (a leaderboard)."""
    t_start = time.perf_counter()
    shape = ModelShape.from_model(model)
    corpus = tokenizer.encode(text)
    wins = ppl.windows(corpus, cfg.windows, cfg.window_len) if cfg.windows else []
    # Passkey haystacks come from the corpus too; keys and offsets are seeded,
    # so every row answers exactly the same prompts.
    prompts = passkey.make_prompts(
        tokenizer, corpus, cfg.passkey_lengths, cfg.passkey_depths, cfg.passkey_trials, cfg.seed
    )
    fid_wins = wins[: cfg.fidelity_windows]
    total = len(fid_wins) + len(wins) + len(rows) * (len(wins) + len(prompts))
    bar = tqdm(total=total, desc="eval", unit="step", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    out_rows = []
    try:
        # A row whose cache cannot run on this backend (e.g. an op the backend
        # lacks) is reported with its error instead of ending the evaluation.
        failed = {row.name: _probe(model, row, corpus, cfg.prefill_chunk) for row in rows}
        failed = {k: v for k, v in failed.items() if v}
        fid, fid_error = {}, None
        live = [row for row in rows if row.name not in failed]
        if fid_wins and live:
            bar.set_description("eval fidelity (all rows)")
            try:
                fid = fidelity.measure(
                    model,
                    rows[0],
                    live,
                    fid_wins,
                    cfg.prefix,
                    cfg.prefill_chunk,
                    cfg.score_chunk,
                    on_window=lambda: bar.update(1),
                )
            except Exception as e:  # noqa: BLE001 -- recorded in the result
                fid_error = _why(e)
                uninstall(model)
        # fp16's next-token distributions, once, outside every row's peak-memory
        # measurement: each row's scoring pass is compared with them (KLD, top-1).
        bar.set_description("eval fp16 reference distributions")
        refs = (references or {}).get("fp16", [])
        for w in wins[len(refs) :]:
            refs.append(
                divergence.reference(
                    model, lambda: rows[0].make(model), w, cfg.prefix, cfg.prefill_chunk, cfg.score_chunk
                )
            )
            bar.update(1)
        if references is not None:
            references["fp16"] = refs
        for row in rows:
            if only is not None and row.name not in only:
                continue
            bar.set_description(f"eval {row.name}")
            done, asked, diverged = [], [], divergence.Tracker()
            error = failed.get(row.name)
            probe = None if error else row.make(model)  # only to describe the row (fingerprint); never fed
            with cost.PeakMemory() as peak:
                try:
                    for w, ref in [] if error else zip(wins, refs):
                        done.append(
                            ppl.window_nll(
                                model,
                                lambda: row.make(model),
                                w,
                                cfg.prefix,
                                cfg.prefill_chunk,
                                cfg.score_chunk,
                                diverged.observer(ref),
                            )
                        )
                        bar.update(1)
                    for p in [] if error else prompts:
                        asked.append(
                            passkey.ask(model, tokenizer, p, row.make(model), cfg.prefill_chunk, cfg.passkey_max_tokens)
                        )
                        bar.update(1)
                except Exception as e:  # noqa: BLE001 -- recorded in the result
                    error = _why(e)
                    done, asked, diverged = [], [], divergence.Tracker()
                    uninstall(model)
            nll, n = sum(d["nll"] for d in done), sum(d["tokens"] for d in done)
            r = row.describe(probe)
            r["ppl"] = math.exp(nll / n) if n else None
            r["nll_per_token"] = nll / n if n else None
            r["scored_tokens"] = n
            r["window_ppl"] = [math.exp(d["nll"] / d["tokens"]) for d in done]
            r["divergence"] = diverged.summary()  # vs fp16: kld_mean, kld_p99 (nats), top1_agreement
            r["passkey"] = passkey.summarize(asked) if asked else None
            r["fidelity"] = fidelity.summarize(fid[row.name]) if row.name in fid else None
            r["cost"] = _row_cost(shape, done, asked, None if error else peak)
            r["attention"] = done[0]["attention"] if done else None
            if error:
                r["error"] = error
            elif fid_error and fid_wins:
                r["fidelity_error"] = fid_error
            out_rows.append(r)
            if on_row is not None:
                on_row(out_rows)
    finally:
        bar.close()
        uninstall(model)
    base = next((r["ppl"] for r in out_rows if r["name"] == rows[0].name), None)
    for r in out_rows:
        r["delta_ppl_pct"] = 100 * (r["ppl"] / base - 1) if base and r["ppl"] else None
    return {
        "veloxquant_eval": SCHEMA,
        **(meta or {}),
        "model_shape": {
            "layers": shape.n_layers,
            "kv_heads": list(set(shape.n_kv_heads)),
            "head_dim": list(set(shape.head_dim)),
        },
        "dtype": _compute_dtype(model),
        "device": str(mx.default_device().type).split(".")[-1],
        "platform": f"{platform.system()} {platform.machine()}, mlx {mx.__version__}",
        "protocol": {
            **attrs.asdict(cfg),
            "window_len": cfg.window_len,
            "windows_used": len(wins),
            "passkey_prompts": len(prompts),
        },
        "rows": out_rows,
        "wall_s": time.perf_counter() - t_start,
    }


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def _probe(model, row, corpus: List[int], chunk: int) -> Optional[str]:
    """None if a short prefill plus one decode step runs with the row's caches,
    else the error (type: first line)."""
    toks = corpus[: max(2, min(chunk, 256) + 1)]
    try:
        caches = row.make(model)
        x = mx.array(toks)[None]
        mx.eval(model(x[:, :-1], cache=caches))
        mx.eval(model(x[:, -1:], cache=caches))
        return None
    except Exception as e:  # noqa: BLE001 -- the caller records it
        return _why(e)
    finally:
        uninstall(model)


def _compute_dtype(model) -> str:
    """The floating dtype most parameters have (quantized weights also hold uint32)."""
    from collections import Counter

    from mlx.utils import tree_flatten

    floats = Counter(p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating))
    return str(floats.most_common(1)[0][0]).replace("mlx.core.", "") if floats else "?"
