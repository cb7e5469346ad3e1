"""Principal axes of K or V vectors for a basis fitted at the end of the prompt (`latent`, `amc`).

float64 throughout: the second-moment matrix by numpy's matmul (BLAS), the
eigenvectors by MLX's LAPACK on its CPU stream (see symmetric_eigh for why).
"""

import mlx.core as mx
import numpy as np


def grouped(x, hg: int) -> np.ndarray:
    """Vectors x [B, H, L, D] (mlx or numpy) -> [G, B*L, hg*D] float64, a group's heads side by side."""
    B, H, L, D = x.shape
    X = np.array(x.astype(mx.float32) if isinstance(x, mx.array) else x, dtype=np.float64)
    return X.reshape(B, H // hg, hg, L, D).transpose(1, 0, 3, 2, 4).reshape(H // hg, B * L, hg * D)


def centred(x, hg: int, center: bool):
    """(Xc [G, B*L, hg*D], mean [G, hg*D]): x grouped, minus its per-group mean (zero when not `center`)."""
    X = grouped(x, hg)
    mean = X.mean(axis=1) if center else np.zeros(X[:, 0].shape)
    return X - mean[:, None], mean


def principal_axes(x, hg: int, center: bool):
    """PCA of vectors x [B, H, L, D], one per group of hg heads (their channels side by side):
    (mean [G, hg*D], variances [G, hg*D] descending, axes [G, hg*D, hg*D] as columns), float64."""
    Xc, mean = centred(x, hg, center)
    evals, evecs = symmetric_eigh(Xc.transpose(0, 2, 1) @ Xc / max(Xc.shape[1], 1))
    return mean, evals[:, ::-1].clip(min=0), evecs[:, :, ::-1]  # descending energy


def symmetric_eigh(m: np.ndarray):
    """Eigenvalues (ascending) and eigenvectors of symmetric matrices m [..., C, C], float64.

    MLX's LAPACK on its CPU stream (mx.linalg runs only there, whatever the default device):
    numpy's bundled OpenBLAS spins its threads on these small matrices, 10-100x slower when
    other processes share the cores. Each vector's sign is fixed (its largest entry positive) so
    the basis does not depend on the LAPACK build."""
    try:
        vals, vecs = mx.linalg.eigh(mx.array(np.ascontiguousarray(m, dtype=np.float64)), stream=mx.cpu)
        vals, vecs = np.array(vals), np.array(vecs)
    except (RuntimeError, ValueError):  # an MLX build without float64 LAPACK: numpy's, slower but the same
        vals, vecs = np.linalg.eigh(m)
    top = np.take_along_axis(vecs, np.abs(vecs).argmax(axis=-2)[..., None, :], axis=-2)
    return vals, vecs * np.where(top < 0, -1.0, 1.0)
