"""What the compiler needs to know about a model: layers, kv heads, head_dim, windows."""

from typing import Optional, Tuple

import attrs

from ..errors import VeloxError
from ..stages.unrope import rope_spec
from . import layout


@attrs.frozen
class ModelShape:
    name: str
    n_kv_heads: Tuple[int, ...]  # per layer
    head_dim: Tuple[int, ...]
    windows: Tuple[Optional[int], ...]  # sliding-window size per layer, None = full attention
    # Per layer: the RoPE settings unrope inverts (stages/unrope.RopeSpec), or a string saying why there are
    # none. Not part of the fingerprint: the unrope stages that use them carry their own copy.
    ropes: Tuple = ()
    # The model's cache list when it is not one attention cache per layer (compiler/layout.py): per entry,
    # "attention" (the next of the caches above, which the recipe compresses) or the mlx-lm class of a
    # non-attention layer's state, passed through; and per cache above, the model layers attending over it
    # (Gemma 4's last layers read earlier layers' caches). Empty for the usual layout, so its plans keep
    # their fingerprints.
    slots: Tuple[str, ...] = ()
    readers: Tuple[Tuple[int, ...], ...] = ()
    # (rank, world size) of a model sharded by tensor parallelism (mlx-lm's `model.shard()`): each layer's
    # kv heads above are this rank's. Empty for a model that is not sharded, so its plans keep their
    # fingerprints.
    shard: Tuple[int, ...] = ()

    @property
    def n_layers(self) -> int:
        return len(self.head_dim)

    @classmethod
    def uniform(cls, name: str, n_layers: int, n_kv_heads: int, head_dim: int, windows=None):
        return cls(
            name, (n_kv_heads,) * n_layers, (head_dim,) * n_layers, tuple(windows) if windows else (None,) * n_layers
        )

    @classmethod
    def from_model(cls, model, name: str = "model") -> "ModelShape":
        """Read the shape off an mlx-lm model: its attention caches, as its own make_cache() lays them out
        (compiler/layout.py); heads, head_dim and RoPE from the layer that owns each cache."""
        read = layout.read(model, name)
        layers = list(model.layers)
        owners = [layers[r[0]] for r in read.readers]
        heads, dims = [], []
        args = getattr(model, "args", None)
        for r, layer in zip(read.readers, owners):
            attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
            n_kv = (
                getattr(attn, "n_kv_heads", None)
                or getattr(attn, "num_key_value_heads", None)
                or getattr(args, "num_key_value_heads", None)
            )
            hd = getattr(attn, "head_dim", None) or getattr(args, "head_dim", None)
            proj = getattr(getattr(attn, "k_proj", None), "weight", None)
            if hd is None and n_kv and proj is not None and args is None:  # mlx-vlm's LLaVA: read off k_proj
                hd = proj.shape[0] // int(n_kv)
            if hd is None and args is not None:
                hd = args.hidden_size // args.num_attention_heads
            if not n_kv or not hd:
                raise VeloxError(f"layer {r[0]} of {name} has no attention veloxquant can read (n_kv_heads/head_dim)")
            heads.append(int(n_kv))
            dims.append(int(hd))
        shared = () if read.trivial else read.slots, () if read.trivial else read.readers
        return cls(name, tuple(heads), tuple(dims), read.windows, tuple(_ropes(owners)), *shared, shard=_shard(owners))

    @property
    def trivial_layout(self) -> bool:
        """One attention cache per model layer (no kept state caches, no shared caches)."""
        return not self.slots

    def layout_text(self) -> str:
        """Which model layers the recipe compresses, and what the others keep (explain, run, errors)."""
        if self.trivial_layout:
            return f"{self.n_layers} layers, one attention cache each"
        kept = [(i, s) for i, s in enumerate(self.slots) if s != layout.ATTENTION]
        owners = [r[0] for r in self.readers]
        n_model = len(self.slots) + sum(len(r) - 1 for r in self.readers)
        parts = [
            f"{n_model} model layers; the recipe compresses {self.n_layers} attention caches "
            f"(model layers {_list(owners)}; recipe layer i is the i-th of them)"
        ]
        for name in sorted({s for _, s in kept}):
            parts.append(f"layers {_list([i for i, s in kept if s == name])} keep their own {name} (not compressed)")
        shared = [(j, r[0]) for r in self.readers for j in r[1:]]
        if shared:
            parts.append(
                "KV-shared layers "
                + ", ".join(f"{j} (reads {o}'s)" for j, o in shared)
                + " attend over their owner's compressed cache"
            )
        return "; ".join(parts)

    def model_layers(self, index: int) -> Tuple[int, ...]:
        """The model layers attending over attention cache `index` (its owner first)."""
        return self.readers[index] if self.readers else (index,)


def _list(values) -> str:
    return ", ".join(map(str, values))


def _shard(layers) -> Tuple[int, ...]:
    """(rank, world size) when the attention's projections are mx.distributed sharded linears (mlx-lm's
    `model.shard()`: the layer keeps n_kv_heads / N heads); () otherwise. `shard_inplace` keeps no group:
    such a model's caches still hold the rank's heads, but carry no rank."""
    for layer in layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        for part in attn.values() if hasattr(attn, "values") else ():
            group = getattr(part, "group", None)
            if group is not None and hasattr(group, "size") and group.size() > 1:
                return (int(group.rank()), int(group.size()))
    return ()


def _ropes(layers):
    for layer in layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        spec, why = rope_spec(getattr(attn, "rope", None))
        yield spec if spec is not None else why


# The default model's shape, so `explain` works without loading weights.
SMOLLM2_135M = attrs.evolve(
    ModelShape.uniform("SmolLM2-135M-Instruct", 30, 3, 64), ropes=((64, False, 100000.0, 1.0, None),) * 30
)
