"""What a tier (tier.py) saves and how it comes back from a file.

Every buffer under its side ("k.codes", "v.scales", "k.r0.idx", ...), a fitted store's arrays as
"k.fit.NAME" (held since its first block) and the running sums it keeps for its codec as "state.NAME".
"""

from typing import Dict, List, Optional

import mlx.core as mx


class TierArrays:
    """The persistence half of Tier: needs `buffers` ({side: {name: Buffer}}), `codecs`, `side_state`."""

    def arrays(self) -> Dict[str, mx.array]:
        out = {
            f"{side}.{name}": buf.view()
            for side, bufs in self.buffers.items()
            for name, buf in bufs.items()
            if buf.view() is not None
        }
        for side, c in self.codecs.items():
            out.update({f"{side}.fit.{name}": a for name, a in getattr(c, "fitted", {}).items()})
        out.update({f"state.{name}": a for name, a in self.side_state.items()})
        return out

    def expected_names(self) -> List[str]:
        return [f"{side}.{name}" for side, bufs in self.buffers.items() for name in bufs]

    def restore(self, start: int, count: int, arrays: Dict[str, mx.array]) -> Optional[str]:
        """Load saved arrays; returns a problem description instead of raising."""
        self._views = {}
        self.start, self.count = start, count
        self.side_state = {k[len("state.") :]: v for k, v in arrays.items() if k.startswith("state.")}
        for side, codec in self.codecs.items():
            for name, per_unit in codec.units().items():
                arr = arrays.get(f"{side}.{name}")
                if count == 0:
                    self.buffers[side][name].set(None)
                    continue
                if arr is None:
                    return f"missing array {side}.{name}"
                if arr.ndim != 4 or arr.shape[2] * per_unit != count:
                    return f"array {side}.{name} has shape {tuple(arr.shape)}, which does not hold {count} tokens"
                self.buffers[side][name].set(arr)
            if getattr(codec, "fits", False):  # a fitted store's arrays (nuq's levels), held since its first block
                codec.fitted = {k.split(".", 2)[2]: v for k, v in arrays.items() if k.startswith(f"{side}.fit.")}
                if count and not codec.fitted:
                    return f"missing the fitted arrays {side}.fit.*"
        return None
