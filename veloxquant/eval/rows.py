"""What one row of an evaluation is: a named way to build a model's caches.

Rows are veloxquant recipes (`kivi`, `kivi[bits=4]`, a YAML path) or mlx-lm's
own quantized cache (`mlx-q4`), so both are measured by the same code.
"""

import re
from typing import List, Optional, Sequence

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

from ..errors import VeloxError
from ..recipe import builtin_names
from ..recipe.load import resolve
from ..runtime import make_prompt_cache

_SPEC = re.compile(r"^(?P<ref>[^\[\]]+?)(?:\[(?P<sets>[^\[\]]*)\])?$")
_MLX = re.compile(r"^mlx-q(?P<bits>\d+)$")


class Fp16QuantizedKVCache(QuantizedKVCache):
    """mlx-lm's QuantizedKVCache, handed float16 K/V.

    Its scales and biases take the dtype of the incoming keys: on a float32 CPU
    model they would be float32, on the 16-bit models it is deployed with they
    are float16. Casting first measures the bytes it holds in deployment and
    rounds K/V the same way our `fp16` baseline does. Everything else
    (quantization of every token including the current chunk, attention over
    quantized K/V via mx.quantized_matmul) is mlx-lm's own code.
    """

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))


@attrs.frozen
class Row:
    name: str  # the label in tables and plots
    kind: str  # "recipe" or "mlx-lm"
    ref: str  # recipe reference, or "QuantizedKVCache"
    sets: tuple = ()
    bits: Optional[int] = None  # mlx-lm rows: code width
    group: int = 64

    def make(self, model) -> list:
        """Fresh caches for `model` (recipe rows also install the attention hook)."""
        if self.kind == "mlx-lm":
            return [self._quantized(c) for c in mlx_prompt_cache(model)]
        return make_prompt_cache(model, self.ref, self.sets)

    def _quantized(self, cache):
        """What mlx-lm's `kv_bits` turns this layer's cache into (generate's
        maybe_quantize_kv_cache). Sliding-window layers raise there, as in mlx-lm."""
        quantized = cache.to_quantized(group_size=self.group, bits=self.bits)
        if type(cache) is KVCache:
            return Fp16QuantizedKVCache(group_size=self.group, bits=self.bits)
        return quantized

    def describe(self, caches) -> dict:
        d = {"name": self.name, "kind": self.kind, "ref": self.ref, "sets": list(self.sets)}
        if self.kind == "mlx-lm":
            d.update(bits=self.bits, group=self.group)
        elif caches:
            d["fingerprint"] = caches[0].fingerprint
        return d


def parse_row(spec: str, common_sets: Sequence[str] = ()) -> Row:
    """`kivi`, `kivi[bits=4,window=64]`, `path/to/r.yaml`, `mlx-q4` -> Row."""
    spec = spec.strip()
    m = _MLX.match(spec)
    if m:
        bits = int(m["bits"])
        if bits not in (2, 3, 4, 5, 6, 8):
            raise VeloxError(f"{spec}: mlx-lm quantizes K/V to 2, 3, 4, 5, 6 or 8 bits")
        return Row(spec, "mlx-lm", "QuantizedKVCache", bits=bits)
    m = _SPEC.match(spec)
    if not m:
        raise VeloxError(f"bad row {spec!r}: expected RECIPE or RECIPE[name=value,...] or mlx-qBITS")
    sets = tuple(common_sets) + tuple(s.strip() for s in (m["sets"] or "").split(",") if s.strip())
    ref = m["ref"].strip()
    resolve(ref)  # fail early, before a model is loaded, on a recipe that does not exist
    return Row(spec if not common_sets else f"{spec}[{','.join(common_sets)}]", "recipe", ref, sets)


def spec_caches(model, spec: str, sets: Sequence[str] = ()):
    """make_prompt_cache for a row spec (`h2o`, `h2o[slack=32]`, a YAML path): the benches' one way in."""
    row = parse_row(spec)
    if row.kind != "recipe":
        raise VeloxError(f"{spec}: not a veloxquant recipe")
    return make_prompt_cache(model, row.ref, (*row.sets, *sets))


def split_specs(text: str) -> List[str]:
    """`fp16,h2o[slack=32,sinks=8],tova` -> the three specs (commas inside brackets stay)."""
    return [s for s in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text) if s.strip()]


def expand(specs: Sequence[str], mlx_bits: Sequence[int], common_sets: Sequence[str] = ()) -> List[Row]:
    """The rows of one evaluation: fp16 first (the baseline), then the recipes
    asked for ('all' = every built-in), then mlx-lm's cache at `mlx_bits`."""
    names: List[str] = []
    for s in specs:
        names += [n for n in builtin_names() if n != "fp16"] if s == "all" else [s]
    rows = [Row("fp16", "recipe", "fp16")]
    for s in names:
        row = parse_row(s, common_sets)
        if row not in rows:
            rows.append(row)
    rows += [parse_row(f"mlx-q{b}") for b in mlx_bits if f"mlx-q{b}" not in names]
    return rows
