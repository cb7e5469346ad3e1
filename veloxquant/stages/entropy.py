"""Entropy stages: lossless coding of a store's integer codes, for saved caches.

Coded data cannot be attended in place, so a live cache keeps the packed codes
and these stages run when a prompt cache is saved (runtime/coded.py). A codec's
entropy chain is zero or more code transforms (`delta`) then one coder (`rans`).

Both work on unpacked codes `q` of shape [B, H, L, D] (token axis 2), integers
in [0, 2**bits), as numpy arrays (constriction takes and returns numpy arrays).
"""

from typing import Dict

import attrs
import numpy as np

from .registry import choices, stage

TABLE_MAX = 255  # frequency tables are stored as uint8 rows scaled to this maximum


@stage("delta", "entropy")
@attrs.frozen
class Delta:
    """Token-axis delta of integer codes, modulo 2**bits (reversible; same alphabet)."""

    coder = False

    def forward(self, q: np.ndarray, bits: int) -> np.ndarray:
        # Neighbouring tokens have similar codes in slowly rotating key channels,
        # so differences concentrate near 0 (mod 2**bits: no wider alphabet needed).
        d = q.astype(np.int64)
        d[:, :, 1:] = (d[:, :, 1:] - q[:, :, :-1].astype(np.int64)) % (1 << bits)
        return d

    def inverse(self, d: np.ndarray, bits: int) -> np.ndarray:
        return np.cumsum(d.astype(np.int64), axis=2) % (1 << bits)


@stage("rans", "entropy")
@attrs.frozen
class Rans:
    """Range-ANS coding of integer codes with stored frequency tables (constriction's AnsCoder).

    table=channel keeps one table per (batch, head, channel) -- CacheGen's
    per-channel distributions; table=tensor one table for the whole array
    (less table overhead for short caches)."""

    table: str = attrs.field(default="channel", validator=choices("channel", "tensor"))

    coder = True

    def _rows(self, q: np.ndarray) -> np.ndarray:
        """Symbols as [contexts, n]: each row is coded with its own table."""
        if self.table == "tensor":
            return q.reshape(1, -1)
        B, H, L, D = q.shape
        return q.transpose(0, 1, 3, 2).reshape(B * H * D, L)

    def _unrows(self, rows: np.ndarray, shape) -> np.ndarray:
        if self.table == "tensor":
            return rows.reshape(shape)
        B, H, L, D = shape
        return rows.reshape(B, H, D, L).transpose(0, 1, 3, 2)

    def encode(self, q: np.ndarray, bits: int) -> Dict[str, np.ndarray]:
        """{"rans": uint32 words, "freq": uint8 [contexts, 2**bits]}: the coder's real output."""
        rows = self._rows(q).astype(np.int64)
        alphabet = 1 << bits
        counts = np.bincount(
            (np.arange(rows.shape[0])[:, None] * alphabet + rows).ravel(), minlength=rows.shape[0] * alphabet
        ).reshape(rows.shape[0], alphabet)
        # Quantize each row to uint8 (max TABLE_MAX), never rounding a seen symbol to 0;
        # encoder and decoder both build their models from this stored table.
        peak = np.maximum(counts.max(axis=1, keepdims=True), 1)
        freq = np.where(counts > 0, np.maximum(1, np.rint(counts * TABLE_MAX / peak)), 0).astype(np.uint8)
        coder = _constriction().stream.stack.AnsCoder()
        models = _models(freq)
        for r in reversed(range(rows.shape[0])):  # ANS is a stack: encode backwards, decode forwards
            coder.encode_reverse(rows[r].astype(np.int32), models[r])
        return {"rans": coder.get_compressed().astype(np.uint32), "freq": freq}

    def decode(self, arrays: Dict[str, np.ndarray], shape, bits: int) -> np.ndarray:
        """Inverse of encode; raises ValueError on a stream or table that cannot be this array's."""
        alphabet = 1 << bits
        contexts = 1 if self.table == "tensor" else shape[0] * shape[1] * shape[3]
        freq, words = arrays["freq"], arrays["rans"]
        if freq.dtype != np.uint8 or freq.shape != (contexts, alphabet):
            raise ValueError(
                f"frequency table has shape {freq.shape} ({freq.dtype}), expected ({contexts}, {alphabet}) (uint8)"
            )
        if freq.sum(axis=1).min(initial=1) == 0:
            raise ValueError("frequency table has an empty row")
        n = int(np.prod(shape)) // contexts
        constriction = _constriction()
        try:
            coder = constriction.stream.stack.AnsCoder(np.ascontiguousarray(words, dtype=np.uint32))
            models = _models(freq)
            rows = np.stack([coder.decode(models[r], n) for r in range(contexts)])
            leftover = not coder.is_empty()
        except BaseException as e:  # constriction raises its own types (and panics) on garbage
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise ValueError(f"the coded stream does not decode ({type(e).__name__}: {e})") from None
        if leftover:
            raise ValueError("the coded stream is damaged (data left over after the last symbol)")
        return self._unrows(rows.astype(np.int64), shape)


def _constriction():
    # Imported when a cache is saved or loaded, not whenever the stage registry loads.
    try:
        import constriction
    except ImportError:
        raise ImportError("the 'rans' stage needs the constriction package: pip install constriction") from None
    return constriction


def _models(freq: np.ndarray):
    constriction = _constriction()
    probs = freq.astype(np.float64)
    probs /= probs.sum(axis=1, keepdims=True)
    # perfect=False: fast, deterministic quantization of the same stored table on both sides.
    return [constriction.stream.model.Categorical(p, perfect=False) for p in probs]
