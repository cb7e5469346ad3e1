"""The saved form of entropy-coded tiers: packed codes <-> the coder's real output.

For each codes array of a codec with entropy stages (the store's `codes`, and a
residual stage's `rN.codes`), saving writes in its place

    NAME.rans  uint32  the coded stream
    NAME.freq  uint8   the frequency tables the decoder needs
    NAME.head  uint32  [B, H, L, D, crc32 of the packed codes]

and loading decodes them back to the packed uint32 codes, bit for bit. The
checksum catches a damaged stream that would otherwise decode to other codes.
Codes the coder cannot shrink (i.i.d. uniform ones: tables and header then
cost more than they save) are saved packed under NAME, as without entropy
stages, so a coded file is never larger than the packed one.
"""

import zlib
from typing import Dict, Iterable, List, Tuple

import mlx.core as mx
import numpy as np

from ..compiler.plan import CodecPlan
from ..kernels.bitpack import pack, unpack

PARTS = ("rans", "freq", "head")


class CodedStreamError(ValueError):
    """A coded array that does not decode; the message names the array."""


def coded_arrays(codec: CodecPlan, names: Iterable[str] = ()) -> List[Tuple[str, int, int]]:
    """(array name, code width, tokens per unit of axis 2) of each codes array the codec's
    entropy stages code. A store whose code arrays depend on the data (the `latent`
    store's one per width) names them from the arrays held, `names`."""
    if not codec.entropy:
        return []
    if hasattr(codec.store, "coded_names"):
        return list(codec.store.coded_names(names))
    stores = [("", codec.store)] + [(f"r{i}.", r.inner) for i, r in enumerate(codec.residuals)]
    return [(f"{prefix}codes", s.bits, 1) for prefix, s in stores if getattr(s, "codes", False)]


def _crc(words: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(words, dtype=np.uint32).tobytes())


def encode(arrays: Dict[str, mx.array], sides: Dict[str, CodecPlan]) -> Dict[str, mx.array]:
    """A tier's saved arrays ({"k.codes": ...}) with coded arrays in place of packed codes."""
    out = dict(arrays)
    for side, codec in sides.items():
        held = [k[len(side) + 1 :] for k in arrays if k.startswith(f"{side}.")]
        for name, bits, _ in coded_arrays(codec, held):
            key = f"{side}.{name}"
            if key not in out:
                continue  # an empty tier saves no arrays
            words = out.pop(key)
            B, H, L, W = words.shape
            D = W * 32 // bits
            q = np.array(unpack(words, bits, D)).astype(np.int64)  # one vectorised unpack per array
            for stage in codec.entropy[:-1]:
                q = stage.forward(q, bits)
            coded = codec.entropy[-1].encode(q, bits)
            coded["head"] = np.array([B, H, L, D, _crc(np.array(words))], dtype=np.uint32)
            if sum(a.nbytes for a in coded.values()) >= words.nbytes:
                out[key] = words  # incompressible (e.g. i.i.d. codes): keep them packed, never grow the file
                continue
            out.update({f"{key}.{part}": mx.array(arr) for part, arr in coded.items()})
    return out


def sides_of(tier_plan) -> Dict[str, CodecPlan]:
    return {} if tier_plan.drops else {"k": tier_plan.keys, "v": tier_plan.values}


def decode(arrays: Dict[str, mx.array], sides: Dict[str, CodecPlan], tokens: int) -> Dict[str, mx.array]:
    """Inverse of encode for a tier holding `tokens` tokens; raises CodedStreamError
    naming the array that does not decode."""
    out = dict(arrays)
    for side, codec in sides.items():
        held = {
            k[len(side) + 1 :].rsplit(".", 1)[0] if k.endswith(tuple(f".{p}" for p in PARTS)) else k[len(side) + 1 :]
            for k in arrays
            if k.startswith(f"{side}.")
        }
        for name, bits, units in coded_arrays(codec, held):
            key = f"{side}.{name}"
            parts = {p: out.pop(f"{key}.{p}", None) for p in PARTS}
            if all(v is None for v in parts.values()):
                continue  # saved packed (incompressible), or the tier was empty: restore checks
            if key in out:
                raise CodedStreamError(f"coded array {key}: saved both packed and coded")
            missing = [f"{key}.{p}" for p, v in parts.items() if v is None]
            if missing:
                raise CodedStreamError(f"coded array {key}: missing {', '.join(missing)}")
            out[key] = _decode_one(key, {p: np.array(v) for p, v in parts.items()}, codec, bits, tokens // units)
    return out


def _decode_one(key: str, parts: Dict[str, np.ndarray], codec: CodecPlan, bits: int, tokens: int) -> mx.array:
    head = parts["head"]
    if head.dtype != np.uint32 or head.shape != (5,):
        raise CodedStreamError(f"coded array {key}: header has shape {head.shape} ({head.dtype}), expected (5,)")
    B, H, L, D, crc = (int(v) for v in head)
    # Check the header before decoding: a damaged one must not make us decode billions of symbols.
    if L != tokens or (D * bits) % 32 or min(B, H, D) == 0 or B * H * D > 1 << 24:
        raise CodedStreamError(f"coded array {key}: header shape {(B, H, L, D)} cannot hold {bits}-bit codes")
    try:
        q = codec.entropy[-1].decode(parts, (B, H, L, D), bits)
    except ValueError as e:
        raise CodedStreamError(f"coded array {key}: {e}") from None
    for stage in reversed(codec.entropy[:-1]):
        q = stage.inverse(q, bits)
    words = pack(mx.array(q.astype(np.uint32)), bits)
    if _crc(np.array(words)) != crc:
        raise CodedStreamError(f"coded array {key}: decoded codes fail their checksum (damaged stream)")
    return words
