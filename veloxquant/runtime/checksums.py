"""Checksums of a saved cache: every array's bytes, dtype and shape, and the metadata.

safetensors carries no checksum, and a flipped bit in raw fp16 data or in a
digit of the metadata (a layer's offset) would otherwise load as other numbers.
Saving records, per array, [CRC-32 of its bytes, dtype, shape] under
`arrays`, and a CRC-32 of every other metadata entry under `crc`; loading
verifies both before anything is rebuilt and names what does not match.
"""

import json
import zlib
from typing import Dict, Optional

import mlx.core as mx
import numpy as np

ARRAYS, CRC = "arrays", "crc"


def array_crc(a: mx.array) -> int:
    return zlib.crc32(np.array(a.view(mx.uint8)).tobytes())  # raw bytes: any dtype, bfloat16 included


def _dtype(a: mx.array) -> str:
    return str(a.dtype).split(".")[-1]


def _meta_crc(meta: Dict[str, str]) -> str:
    body = json.dumps({k: v for k, v in meta.items() if k != CRC}, sort_keys=True)
    return str(zlib.crc32(body.encode("utf-8", "surrogatepass")))


def sign(arrays: Dict[str, mx.array], meta: Dict[str, str]) -> Dict[str, str]:
    """`meta` plus the two checksum entries, for these arrays."""
    table = {name: [array_crc(a), _dtype(a), list(a.shape)] for name, a in arrays.items()}
    out = {**meta, ARRAYS: json.dumps(table, sort_keys=True)}
    out[CRC] = _meta_crc(out)
    return out


def problem(arrays: Dict[str, mx.array], meta: Dict[str, str]) -> Optional[str]:
    """What does not match its checksum, or None."""
    if CRC not in meta or ARRAYS not in meta:
        return "no checksums in the metadata"
    if meta[CRC] != _meta_crc(meta):
        return "the metadata fails its checksum (damaged header)"
    try:
        table = json.loads(meta[ARRAYS])
        if not isinstance(table, dict) or not all(isinstance(v, list) and len(v) == 3 for v in table.values()):
            return "unreadable array checksums (expected {name: [crc, dtype, shape]})"
    except ValueError as e:
        return f"unreadable array checksums ({e})"
    missing, extra = sorted(set(table) - set(arrays)), sorted(set(arrays) - set(table))
    if missing or extra:
        return f"arrays missing: {missing[:3]}, not recorded: {extra[:3]}"
    for name in sorted(arrays):
        a = arrays[name]
        crc, dtype, shape = table[name]
        if [dtype, shape] != [_dtype(a), list(a.shape)]:
            return f"array {name} is {_dtype(a)} {list(a.shape)}, recorded as {dtype} {shape}"
        if crc != array_crc(a):
            return f"array {name} fails its checksum (damaged data)"
    return None
