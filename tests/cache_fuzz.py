"""A mutation fuzzer over real saved cache files.

Each mutation of a file saved by several recipes (a tiny random Llama) must be
refused with CacheFileError or load exactly what was saved (array-equal): never
another exception, a hang, or other numbers. Mutations: truncation at every
section boundary and at random points, bit flips in the length prefix, header,
metadata and array data, headers claiming huge sizes, files spliced from
another recipe's arrays and metadata, and entropy-coded streams damaged and
re-signed (valid checksums: the decoder's own checks must refuse them).

    python tests/cache_fuzz.py --count 20000     # the long run; prints the breakdown
"""

import argparse
import json
import signal
import struct
import sys
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import veloxquant as vq  # noqa: E402
from veloxquant.errors import CacheFileError  # noqa: E402
from veloxquant.runtime import checksums  # noqa: E402

from conftest import feed, tiny_llama  # noqa: E402

SOURCES = {"fp16": [], "kivi": ["window=32"], "cachegen": ["window=32"], "xquant": ["window=32"], "h2o": ["budget=48"]}
LOAD_SECONDS = 20  # a load slower than this is a hang


def save_sources(model, folder: Path):
    """{recipe: path} of real saved caches; the prompt is smooth so cachegen's codes entropy-code."""
    tokens = mx.array(np.repeat(np.arange(3, 33), 5)[None, :130])
    out = {}
    for recipe, sets in SOURCES.items():
        caches = vq.make_prompt_cache(model, recipe, sets)
        feed(model, tokens, caches, 50)
        out[recipe] = folder / f"{recipe}.safetensors"
        vq.save_prompt_cache(str(out[recipe]), caches)
    return out


def sections(data: bytes):
    """(header length, header dict, [(tensor name, absolute start, absolute end)])."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    spans = [
        (k, 8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    ]
    return n, header, sorted(spans, key=lambda s: s[1])


def _with_header(data: bytes, header: dict) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data[8 + n :]


def _flip(data: bytes, lo: int, hi: int, rng) -> bytes:
    out = bytearray(data)
    at = int(rng.integers(lo, hi))
    out[at] ^= 1 << int(rng.integers(0, 8))
    return bytes(out)


def boundary_truncations(data: bytes):
    n, _, spans = sections(data)
    cuts = {0, 4, 8, 8 + n // 2, 8 + n, len(data) - 1}
    for _, start, end in spans:
        cuts |= {start, start + 1, end - 1, end}
    return [("truncate at a section boundary", data[:c]) for c in sorted(cuts) if c < len(data)]


def random_mutation(data: bytes, rng, other: bytes):
    """One random mutation: (kind, bytes)."""
    n, header, spans = sections(data)
    meta_at = data.find(b'"__metadata__"', 8, 8 + n)
    kind = int(rng.integers(0, 9))
    if kind == 0:
        return "truncate at a random point", data[: int(rng.integers(0, len(data)))]
    if kind == 1:
        return "bit flip in the length prefix", _flip(data, 0, 8, rng)
    if kind == 2:
        return "bit flip in the header", _flip(data, 8, 8 + n, rng)
    if kind == 3 and meta_at >= 0:
        return "bit flip in the metadata", _flip(data, meta_at, 8 + n, rng)
    if kind in (3, 4, 5):
        name, start, end = spans[int(rng.integers(0, len(spans)))]
        return "bit flip in array data", _flip(data, start, end, rng) if end > start else data
    if kind == 6:
        huge = [1 << int(rng.integers(20, 64)), len(data), len(data) - 7][int(rng.integers(0, 3))]
        return "length prefix claiming a huge size", struct.pack("<Q", huge) + data[8:]
    if kind == 7:
        name = spans[int(rng.integers(0, len(spans)))][0]
        h = json.loads(json.dumps(header))
        which = int(rng.integers(0, 3))
        if which == 0:
            h[name]["shape"] = [1 << int(rng.integers(20, 62))] + h[name]["shape"][1:]
        elif which == 1:
            h[name]["data_offsets"][1] = 1 << int(rng.integers(20, 62))
        else:
            h[name]["shape"] = h[name]["shape"][:-1] + [h[name]["shape"][-1] * 2]
        return "header claiming huge or wrong sizes", _with_header(data, h)
    return "metadata of another recipe's file", _splice(data, other)


def _splice(data: bytes, other: bytes) -> bytes:
    """This file's arrays with the other file's metadata (its checksums included)."""
    _, header, _ = sections(data)
    _, other_header, _ = sections(other)
    header["__metadata__"] = other_header["__metadata__"]
    return _with_header(data, header)


def damaged_stream(path: Path, rng):
    """An entropy-coded array damaged, then re-signed: only the decoder can tell."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    coded = sorted(k for k in arrays if k.rsplit(".", 1)[-1] in ("rans", "freq", "head"))
    arrays = {k: np.array(a) for k, a in arrays.items()}
    key = coded[int(rng.integers(0, len(coded)))]
    a = arrays[key].copy()
    how = int(rng.integers(0, 3))
    if how == 0 and a.size:
        flat = a.reshape(-1)
        i = int(rng.integers(0, flat.size))
        flat[i] ^= flat.dtype.type(1 << int(rng.integers(0, 8 * flat.itemsize)))
    elif how == 1:
        a = a.reshape(-1)[: int(rng.integers(0, a.size + 1))]
    else:
        a = np.concatenate([a.reshape(-1), rng.integers(0, 255, int(rng.integers(1, 64))).astype(a.dtype)])
    arrays[key] = a
    arrays = {k: mx.array(v) for k, v in arrays.items()}
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        mx.save_safetensors(f.name, arrays, checksums.sign(arrays, meta))
        return f"damaged entropy stream ({key.rsplit('.', 1)[-1]}), re-signed", Path(f.name).read_bytes()


def _contents(caches):
    return [
        (c.offset, str(c.dtype), [(t.start if t.count else 0, t.count, t.arrays()) for t in c.tiers]) for c in caches
    ]


def _same(a, b) -> bool:
    if [(o, d, [(s, n) for s, n, _ in t]) for o, d, t in a] != [(o, d, [(s, n) for s, n, _ in t]) for o, d, t in b]:
        return False
    return all(
        x.keys() == y.keys() and all(mx.array_equal(x[k], y[k]).item() for k in x)
        for (_, _, ta), (_, _, tb) in zip(a, b)
        for (_, _, x), (_, _, y) in zip(ta, tb)
    )


class _Hang(Exception):
    pass


def _alarm(*_):
    raise _Hang()


def outcome(model, data: bytes, expected, scratch: Path) -> str:
    """'refused', 'loaded exactly', or a failure: 'DIFFERENT', 'CRASH ...', 'HANG'."""
    scratch.write_bytes(data)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(LOAD_SECONDS)
    try:
        caches, _ = vq.load_prompt_cache(str(scratch), model=model)
        got = _contents(caches)
        mx.eval([c.state for c in caches])
    except CacheFileError:
        return "refused"
    except _Hang:
        return "HANG"
    except Exception as e:  # the property: nothing else may escape
        return f"CRASH {type(e).__name__}: {str(e)[:200]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return "loaded exactly" if _same(got, expected) else "DIFFERENT"


def run(count: int, seed: int = 0, folder: Path = None, log=None) -> Counter:
    """`count` random mutations plus every boundary truncation, over each source file."""
    model = tiny_llama()
    folder = Path(folder or tempfile.mkdtemp())
    paths = save_sources(model, folder)
    rng = np.random.default_rng(seed)
    scratch = folder / "mutant.safetensors"
    tally = Counter()
    names = list(paths)
    files = {r: p.read_bytes() for r, p in paths.items()}
    expected = {r: _contents(vq.load_prompt_cache(str(p), model=model)[0]) for r, p in paths.items()}
    jobs = [(r, m) for r in names for m in boundary_truncations(files[r])]
    per_source = max(1, count // len(names))
    for r in names:
        other = files[names[(names.index(r) + 1) % len(names)]]
        for i in range(per_source):
            if r == "cachegen" and i % 4 == 0:
                jobs.append((r, damaged_stream(paths[r], rng)))
            else:
                jobs.append((r, random_mutation(files[r], rng, other)))
    for r, (kind, data) in jobs:
        result = outcome(model, data, expected[r], scratch)
        tally[(kind, result if result in ("refused", "loaded exactly") else "FAIL")] += 1
        if result not in ("refused", "loaded exactly") and log is not None:
            log.append((r, kind, result))
    vq.uninstall(model)
    return tally


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    failures = []
    tally = run(args.count, args.seed, log=failures)
    kinds = sorted({k for k, _ in tally})
    print("| mutation | refused | loaded exactly | failed |\n| --- | --- | --- | --- |")
    for k in kinds:
        print(f"| {k} | {tally[(k, 'refused')]} | {tally[(k, 'loaded exactly')]} | {tally[(k, 'FAIL')]} |")
    total = sum(tally.values())
    print(
        f"| total ({total}) | {sum(v for (k, r), v in tally.items() if r == 'refused')} | "
        f"{sum(v for (k, r), v in tally.items() if r == 'loaded exactly')} | {len(failures)} |"
    )
    for f in failures[:20]:
        print("FAIL", *f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
