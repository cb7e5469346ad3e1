"""What a per-head eviction tier (head_tier.py) saves and how it comes back from a file.

Every buffer under its side ("k.codes", "v.r0.idx", ...), the positions and scores ("pos",
"score", the scorer's token state) by name, the scorer's own state under "scorer.", the
allocated budgets as "alloc.budgets"; a ragged tier (ragged.py) its heads' runs flat, their
lengths as "ragged.lens" and its shared tail under "tail.".
"""

from typing import Dict, List, Optional

import mlx.core as mx

from .ragged import restore_ragged


class HeadArrays:
    """The persistence half of HeadTier: reads and sets its buffers, meta, scorer and budgets."""

    __slots__ = ()

    def arrays(self) -> Dict[str, mx.array]:
        # Ragged: what is held, as held: each head's run, flat [B, 1, sum(lens), ...], and the shared tail.
        held = (lambda buf: buf.flat) if self.ragged is not None else (lambda buf: buf.view())
        named = [(f"{side}.{name}", buf) for side, bufs in self.buffers.items() for name, buf in bufs.items()]
        named += list(self.meta.items())
        out = {key: held(buf) for key, buf in named}
        out.update({f"scorer.{name}": arr for name, arr in self.scorer.state().items()})
        if self.ragged is not None:
            out["ragged.lens"] = self.ragged.array
            out.update({f"tail.{key}": buf.tail.view() for key, buf in named if buf.tail.used})
        if self.budgets is not None:
            out["alloc.budgets"] = self.budget_array
        return {k: v for k, v in out.items() if v is not None}

    def expected_names(self) -> List[str]:
        return [f"{side}.{name}" for side, bufs in self.buffers.items() for name in bufs] + list(self.meta)

    def restore(self, start: int, count: int, arrays: Dict[str, mx.array]) -> Optional[str]:
        self.count = count
        self.decided = True  # saving ends the prompt (persist calls finish_prompt first)
        self.uniform = False  # what was evicted before saving is not known here
        self.scorer.load({k[len("scorer.") :]: v for k, v in arrays.items() if k.startswith("scorer.")})
        self.collecting = False  # a saved prompt is over: its budgets were allocated (or are fixed)
        self.meta.pop("seen", None)
        if "alloc.budgets" in arrays:
            self.budget_array = arrays["alloc.budgets"].astype(mx.int32)
            self.budgets = [int(b) for b in self.budget_array.tolist()]
        if "ragged.lens" in arrays:
            return restore_ragged(self, arrays)
        for key in self.expected_names():
            side, _, name = key.partition(".") if key.split(".")[0] in self.buffers else ("", "", key)
            buf = self.buffers[side][name] if side else self.meta[name]  # residual arrays: "k.r0.idx"
            arr = arrays.get(key)
            if count == 0:
                buf.set(None)
                continue
            if arr is None:
                return f"missing array {key}"
            if arr.ndim < 3 or arr.shape[2] != count:
                return f"array {key} has shape {tuple(arr.shape)}, which does not hold {count} tokens per head"
            buf.set(arr)
        pos = self.positions
        if count and (pos.dtype != mx.int32 or bool(mx.any(pos[..., 1:] <= pos[..., :-1]).item())):
            return "positions are not increasing int32 per head"
        return None
