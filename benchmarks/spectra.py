"""Rank spectra of a model's cached keys and values: what low-rank latents can keep.

    python -m benchmarks.spectra --model smollm2 --tokens 2048
    python -m benchmarks.spectra --model gemma3 --tokens 2048 --ranks 16,32,64,128

The prompt goes through an fp16 cache; per layer and kv head, the eigenvalues
of the keys' (values') second-moment matrix -- uncentred, as SVDq/PALU fit it,
or centred (PCA, as KVTC) with --center -- give the share of energy the first r
components hold. Printed per layer (mean over heads) at each rank, then the
model mean: the latent recipes' error at rank r is the energy left out.
"""

import argparse
from typing import List

import mlx.core as mx
import numpy as np

from veloxquant.data.corpus import load_text
from veloxquant.models.default import load_model
from veloxquant.runtime.make import make_prompt_cache


def energy_at(x: np.ndarray, ranks: List[int], center: bool, heads: int = 1) -> np.ndarray:
    """x [H, L, D] -> share of energy in the first r components, per rank (mean over head groups)."""
    H, L, D = x.shape
    g = x.reshape(H // heads, heads, L, D).transpose(0, 2, 1, 3).reshape(H // heads, L, heads * D)
    if center:
        g = g - g.mean(axis=1, keepdims=True)
    ev = np.linalg.eigvalsh(np.einsum("gli,glj->gij", g, g))[:, ::-1].clip(min=0)
    share = np.cumsum(ev, axis=1) / np.maximum(ev.sum(axis=1, keepdims=True), 1e-30)
    return np.stack([share[:, min(r, share.shape[1]) - 1] for r in ranks], axis=1).mean(axis=0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="path or alias (smollm2, gemma3)")
    ap.add_argument("--corpus", default="austen")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ranks", default="4,8,16,24,32,48")
    ap.add_argument("--center", action="store_true", help="PCA (mean removed) instead of uncentred SVD")
    ap.add_argument("--heads", type=int, default=1, help="kv heads per basis (PALU's head groups; 0 = all)")
    args = ap.parse_args(argv)
    model, tokenizer = load_model(args.model)
    ids = mx.array(tokenizer.encode(load_text(args.corpus))[: args.tokens])[None]
    caches = make_prompt_cache(model, "fp16")
    model(ids, cache=caches)
    mx.eval([c.state for c in caches])
    ranks = [int(r) for r in args.ranks.split(",")]
    kind = "centred (PCA)" if args.center else "uncentred (SVD)"
    print(
        f"{args.model}: {ids.shape[1]} tokens, {kind}, {args.heads or 'all'} kv head(s) per basis; "
        "share of energy in the first r components"
    )
    print(
        f"{'layer':>5} {'H x D':>7}  "
        + "  ".join(f"K@{r:<4}" for r in ranks)
        + "  "
        + "  ".join(f"V@{r:<4}" for r in ranks)
    )
    rows = []
    for i, c in enumerate(caches):
        k, v = (np.array(a[0].astype(mx.float32), dtype=np.float64) for a in c.tiers[0].decoded(mx.float32))
        heads = args.heads or k.shape[0]
        row = np.concatenate([energy_at(k, ranks, args.center, heads), energy_at(v, ranks, args.center, heads)])
        rows.append(row)
        print(f"{i:>5} {k.shape[0]:>2}x{k.shape[2]:<4}  " + "  ".join(f"{e:6.3f}" for e in row))
    print(f"{'mean':>5} {'':>7}  " + "  ".join(f"{e:6.3f}" for e in np.mean(rows, axis=0)))


if __name__ == "__main__":
    main()
