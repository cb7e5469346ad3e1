"""What the compiler needs to know about a model: layers, kv heads, head_dim, windows."""
from typing import Optional, Tuple

import attrs

from ..errors import VeloxError
from ..stages.unrope import rope_spec


@attrs.frozen
class ModelShape:
    name: str
    n_kv_heads: Tuple[int, ...]  # per layer
    head_dim: Tuple[int, ...]
    windows: Tuple[Optional[int], ...]  # sliding-window size per layer, None = full attention
    # Per layer: the RoPE settings unrope inverts (stages/unrope.RopeSpec), or a string saying why there are
    # none. Not part of the fingerprint: the unrope stages that use them carry their own copy.
    ropes: Tuple = ()

    @property
    def n_layers(self) -> int:
        return len(self.head_dim)

    @classmethod
    def uniform(cls, name: str, n_layers: int, n_kv_heads: int, head_dim: int, windows=None):
        return cls(name, (n_kv_heads,) * n_layers, (head_dim,) * n_layers,
                   tuple(windows) if windows else (None,) * n_layers)

    @classmethod
    def from_model(cls, model, name: str = "model") -> "ModelShape":
        """Read the shape off an mlx-lm model; windows come from its own make_cache()."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        layers = list(model.layers)
        heads, dims = [], []
        args = getattr(model, "args", None)
        for i, layer in enumerate(layers):
            attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
            n_kv = getattr(attn, "n_kv_heads", None) or getattr(args, "num_key_value_heads", None)
            hd = getattr(attn, "head_dim", None) or getattr(args, "head_dim", None)
            if hd is None and args is not None:
                hd = args.hidden_size // args.num_attention_heads
            if not n_kv or not hd:
                raise VeloxError(f"layer {i} of {name} has no attention veloxquant can read (n_kv_heads/head_dim)")
            heads.append(int(n_kv))
            dims.append(int(hd))
        windows = [None] * len(layers)
        if hasattr(model, "make_cache"):
            for i, c in enumerate(model.make_cache()):
                if isinstance(c, RotatingKVCache):
                    windows[i] = int(c.max_size)
                elif not isinstance(c, KVCache):
                    raise VeloxError(f"layer {i} of {name} uses {type(c).__name__}, not an attention KV cache; "
                                     "veloxquant compresses attention KV caches only")
        return cls(name, tuple(heads), tuple(dims), tuple(windows), tuple(_ropes(layers)))


def _ropes(layers):
    for layer in layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        spec, why = rope_spec(getattr(attn, "rope", None))
        yield spec if spec is not None else why


# The default model's shape, so `explain` works without loading weights.
SMOLLM2_135M = attrs.evolve(ModelShape.uniform("SmolLM2-135M-Instruct", 30, 3, 64),
                            ropes=((64, False, 100000.0, 1.0, None),) * 30)
