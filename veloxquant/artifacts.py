"""The calibration-artifact store: `<cache>/calibration/<key>.safetensors` + `<key>.json`.

Below the stages (calibrated stages read their arrays from here) and above only
`data` and `errors`; fitting and collecting live in `veloxquant.calibration`,
binding a plan to its artifact in `veloxquant.compiler.binding`.

The key hashes what the artifact was made from (model weights, the recipe's
compiled plan, the calibration text, the fitter version); the artifact's own
content hash (of its arrays) is what bound plans carry and saved caches check.
"""

import hashlib
import json
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .data.corpus import cache_root
from .errors import VeloxError

# The samples a calibrated stage fits on keep every QUERY_STRIDE-th query (calibration/collect.py):
# their second moments need far fewer samples than keys' bases.
QUERY_STRIDE = 4
FIT_VERSION = 2  # bump when a fitter changes what it computes: old artifacts then read as stale
_LOADED: Dict[str, Dict[str, mx.array]] = {}  # content hash -> arrays


class CalibrationError(VeloxError):
    """A calibrated recipe without its artifact (missing, stale, or damaged)."""


def directory() -> Path:
    return cache_root() / "calibration"


def weights_identity(model) -> str:
    """Hash of the model's weights as float16 (the same for a float16 and a float32 load);
    computed once per model object (kept on it: weights loaded into it later are not seen)."""
    if getattr(model, "_veloxquant_weights", None) is None:
        h = hashlib.blake2b(digest_size=16)
        for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
            arr = p.astype(mx.float16) if mx.issubdtype(p.dtype, mx.floating) else p
            h.update(f"{name}{tuple(p.shape)}".encode())
            h.update(memoryview(np.array(arr)).tobytes())
        object.__setattr__(model, "_veloxquant_weights", h.hexdigest())
    return model._veloxquant_weights


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def key_of(weights: str, plan_fingerprint: str, corpus_digest: str, settings: Dict) -> str:
    blob = json.dumps(
        {
            "weights": weights,
            "plan": plan_fingerprint,
            "corpus": corpus_digest,
            "settings": settings,
            "fit": FIT_VERSION,
        },
        sort_keys=True,
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def content_hash(arrays: Dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def save(key: str, arrays: Dict[str, np.ndarray], meta: Dict) -> Path:
    d = directory()
    d.mkdir(parents=True, exist_ok=True)
    digest = content_hash(arrays)
    path = d / f"{key}.safetensors"
    mx.save_safetensors(str(path), {k: mx.array(v) for k, v in arrays.items()}, {"content": digest, "key": key})
    meta = {**meta, "key": key, "content": digest, "bytes": path.stat().st_size}
    (d / f"{key}.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    return path


def find(key: str) -> Optional[Dict]:
    """The metadata of the artifact made under `key`, or None."""
    p = directory() / f"{key}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def others_for(recipe: str, weights: str):
    """Metadata of artifacts made for the same recipe and model under other keys (stale ones)."""
    d = directory()
    for p in sorted(d.glob("*.json")) if d.is_dir() else ():
        meta = json.loads(p.read_text())
        if meta.get("recipe") == recipe and meta.get("weights") == weights:
            yield meta


def by_content(digest: str) -> Optional[Dict]:
    d = directory()
    for p in sorted(d.glob("*.json")) if d.is_dir() else ():
        meta = json.loads(p.read_text())
        if meta.get("content") == digest:
            return meta
    return None


def arrays(digest: str) -> Dict[str, mx.array]:
    """The arrays of the artifact with this content hash (loaded once per process)."""
    if digest not in _LOADED:
        meta = by_content(digest)
        if meta is None:
            raise CalibrationError(
                f"calibration artifact {digest} is not in {directory()}: this cache or plan was made with it. "
                "Copy the artifact there, or recalibrate with `veloxquant calibrate RECIPE --model M` and "
                "make the cache again"
            )
        loaded, file_meta = mx.load(str(directory() / f"{meta['key']}.safetensors"), return_metadata=True)
        if file_meta.get("content") != digest or content_hash({k: np.array(v) for k, v in loaded.items()}) != digest:
            raise CalibrationError(
                f"calibration artifact {meta['key']}.safetensors does not hash to {digest} "
                "(damaged or replaced); recalibrate"
            )
        _LOADED[digest] = loaded
    return _LOADED[digest]


_SLOTS: Dict[tuple, Dict[str, mx.array]] = {}


def slot_arrays(digest: str, slot: str) -> Dict[str, mx.array]:
    """One stage's arrays ("3.1.k.basis" -> "basis" for slot "3.1.k"); read every encode, so cached."""
    if (digest, slot) not in _SLOTS:
        prefix = f"{slot}."
        _SLOTS[(digest, slot)] = {k[len(prefix) :]: v for k, v in arrays(digest).items() if k.startswith(prefix)}
    return _SLOTS[(digest, slot)]


def hold_slot(digest: str, slot: str, held: Dict[str, mx.array]) -> None:
    """Hold one stage's arrays in memory under (digest, slot), with no file behind them: a bench
    that fits a stage in the process runs it as a calibrated stage reading `slot_arrays`."""
    _SLOTS[(digest, slot)] = dict(held)
