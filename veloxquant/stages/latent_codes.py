"""How the `latent` store codes its latents: per component width, packed along the tokens (a
component's `group` tokens of b bits fill whole 32-bit words, for any b), float16 at width 16.

quant=minmax -- affine codes, a float16 scale and zero per component and group;
quant=gauss  -- Lloyd-Max levels of a unit gaussian on the latent standardised by its
                prompt mean and deviation: no metadata per token, the budget is codes.

`LatentCoding` reads only the store's `group` and `quant`; the basis and the widths it is
given come from latent.py.
"""

from typing import Dict, Tuple

import mlx.core as mx
import numpy as np

from ..kernels.bitpack import pack, unpack
from .codebook import lloyd_max

FLOAT = 16  # width that stores a latent as float16


class LatentCoding:
    """Latents <-> codes, for a store with `group` (tokens per code run) and `quant` ("minmax", "gauss")."""

    __slots__ = ()
    group: int
    quant: str

    def classes(self, widths: np.ndarray) -> Tuple[Tuple[int, np.ndarray], ...]:
        """(width, component indices) per distinct width, widest first."""
        return tuple((int(b), np.flatnonzero(widths == b)) for b in sorted(set(widths.tolist()), reverse=True))

    def stats(self, z: mx.array) -> Dict[str, mx.array]:
        """quant=gauss: each latent's prompt mean and deviation {"loc", "std"} [G, r] (float16)."""
        if self.quant != "gauss":
            return {}
        loc = mx.mean(z, axis=(0, 2))
        std = mx.sqrt(mx.mean(mx.square(z - loc[:, None]), axis=(0, 2)))
        return {
            "loc": mx.contiguous(loc.astype(mx.float16)),
            "std": mx.contiguous(mx.maximum(std, 1e-6).astype(mx.float16)),
        }

    def _standard(self, stats: Dict[str, mx.array], idx: np.ndarray):
        """(loc, std) of the components idx as [1, G, 1, n, 1] (they broadcast over [B, G, groups, n, tokens])."""
        sel = mx.array(idx)
        return tuple(stats[k][:, sel].astype(mx.float32)[None, :, None, :, None] for k in ("loc", "std"))

    def encode(self, z: mx.array, widths: np.ndarray, stats: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Latents z [B, G, L, r] (L a multiple of `group`) -> arrays whose axis 2 counts token groups."""
        B, G, L, r = z.shape
        n_groups = L // self.group
        out = {}
        for b, idx in self.classes(widths):
            zb = z[..., mx.array(idx)].astype(mx.float32)
            zb = zb.reshape(B, G, n_groups, self.group, len(idx)).swapaxes(-1, -2)  # [.., comps, tokens]
            if b == FLOAT:
                out["f16"] = zb.astype(mx.float16).reshape(B, G, n_groups, -1)
                continue
            if self.quant == "gauss":
                loc, std = self._standard(stats, idx)
                levels = mx.array(lloyd_max(b, "gaussian"))
                q = mx.sum(((zb - loc) / std)[..., None] > (levels[1:] + levels[:-1]) / 2, axis=-1)
                out[f"c{b}.codes"] = pack(q, b).reshape(B, G, n_groups, -1)
                continue
            lo, hi = mx.min(zb, axis=-1, keepdims=True), mx.max(zb, axis=-1, keepdims=True)
            levels = (1 << b) - 1
            scale, zero = ((hi - lo) / levels).astype(mx.float16), lo.astype(mx.float16)
            q = mx.clip(
                mx.round((zb - zero.astype(mx.float32)) / mx.maximum(scale.astype(mx.float32), 1e-12)), 0, levels
            )
            out[f"c{b}.codes"] = pack(q, b).reshape(B, G, n_groups, -1)
            out[f"c{b}.scales"], out[f"c{b}.zeros"] = scale.squeeze(-1), zero.squeeze(-1)
        return out

    def decode(self, enc: Dict[str, mx.array], widths: np.ndarray, stats: Dict[str, mx.array]) -> mx.array:
        """Inverse of encode: latents [B, G, L, r] in float32."""
        parts, order = [], []
        for b, idx in self.classes(widths):
            n = len(idx)
            if b == FLOAT:
                x = enc["f16"].astype(mx.float32)
                B, G, n_groups, _ = x.shape
                zb = x.reshape(B, G, n_groups, n, self.group)
            else:
                words = enc[f"c{b}.codes"]
                B, G, n_groups, _ = words.shape
                q = unpack(words.reshape(B, G, n_groups, n, self.group * b // 32), b, self.group)
                if self.quant == "gauss":
                    loc, std = self._standard(stats, idx)
                    zb = mx.array(lloyd_max(b, "gaussian"))[q] * std + loc
                else:
                    zb = (
                        q.astype(mx.float32) * enc[f"c{b}.scales"].astype(mx.float32)[..., None]
                        + enc[f"c{b}.zeros"].astype(mx.float32)[..., None]
                    )
            parts.append(zb.swapaxes(-1, -2).reshape(B, G, n_groups * self.group, n))
            order.append(idx)
        z = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        inverse = np.argsort(np.concatenate(order))
        return z if (inverse == np.arange(len(inverse))).all() else z[..., mx.array(inverse)]

    def units(self, widths: np.ndarray) -> Dict[str, int]:
        """Tokens per unit of axis 2 of each latent array."""
        out = {}
        for b, _ in self.classes(widths):
            names = (
                ("f16",)
                if b == FLOAT
                else (f"c{b}.codes",)
                if self.quant == "gauss"
                else (f"c{b}.codes", f"c{b}.scales", f"c{b}.zeros")
            )
            out.update({name: self.group for name in names})
        return out

    def coded_names(self, names) -> Tuple[Tuple[str, int, int], ...]:
        """(array, code width, tokens per unit) of the integer codes among `names` (for entropy coding)."""
        return tuple(
            (n, int(n[1 : -len(".codes")]), self.group)
            for n in sorted(names)
            if n.startswith("c") and n.endswith(".codes")
        )
