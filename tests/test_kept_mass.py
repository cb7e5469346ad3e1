"""bench.kept_mass: the share of fp16's attention on held positions, ragged (padded) heads included."""

import mlx.core as mx
import numpy as np

from veloxquant.bench.kept_mass import held_per_head, kept_mass
from veloxquant.runtime.eviction.ragged import PAD


def test_kept_mass_counts_only_held_positions_and_ignores_padding():
    n = 6
    # [B=1, Hkv=2, rep=1, Lq=1, n]: head 0 puts its mass on 0 and 5, head 1 spreads it evenly.
    w = np.zeros((1, 2, 1, 1, n), np.float32)
    w[0, 0, 0, 0, [0, 5]] = 0.5
    w[0, 1, 0, 0, :] = 1.0 / n
    # Head 0 holds 3 positions, head 1 only 2 (its third slot is ragged padding).
    pos = np.array([[[0, 1, 5], [2, 3, PAD]]], np.int32)
    (share,) = kept_mass([mx.array(w)], [pos], n)
    assert abs(share - (1.0 + 2.0 / n) / 2) < 1e-6
    assert held_per_head([pos], n) == 2.5
