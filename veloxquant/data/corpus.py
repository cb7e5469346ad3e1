"""Evaluation text: Jane Austen's six novels, or any local text file.

The novels come from Debian's ``r-cran-janeaustenr`` package (public domain texts,
MIT-licensed packaging).  On first use we ``apt-get download`` the .deb, unpack it
with ``dpkg -x``, read the R lazy-load database that holds one character vector per
novel (one element per printed line) with the ``rdata`` package, join the lines into
paragraphs, and cache one plain-text file per book under
``$VELOXQUANT_CACHE/corpora/austen/<key>.txt``.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

from ..errors import VeloxError
from .passkey_text import passkey_corpus

DEB_PACKAGE = "r-cran-janeaustenr"
DEFAULT_BOOK = "pride"

# short key -> (title, object name inside the R package)
AUSTEN_BOOKS = {
    "sense": ("Sense & Sensibility", "sensesensibility"),
    "pride": ("Pride & Prejudice", "prideprejudice"),
    "mansfield": ("Mansfield Park", "mansfieldpark"),
    "emma": ("Emma", "emma"),
    "northanger": ("Northanger Abbey", "northangerabbey"),
    "persuasion": ("Persuasion", "persuasion"),
}

_R_LIB = Path("usr/lib/R/site-library/janeaustenr")


class CorpusError(VeloxError):
    """A corpus could not be found, fetched or decoded."""


def cache_root() -> Path:
    return Path(os.environ.get("VELOXQUANT_CACHE") or Path.home() / ".cache" / "veloxquant")


def _squash(s: str) -> str:
    return re.sub(r"[^a-z]", "", s.lower().replace("&", "and"))


def book_key(book: str | None) -> str:
    """Canonical short key for a book named by key, title or R name ("Pride & Prejudice")."""
    if book is None:
        return DEFAULT_BOOK
    wanted = _squash(book)
    for key, (title, rname) in AUSTEN_BOOKS.items():
        if wanted in (key, _squash(title), rname):
            return key
    raise CorpusError(f"unknown Austen book {book!r}; choose one of {', '.join(AUSTEN_BOOKS)}")


def lines_to_text(lines) -> str:
    """Join printed lines into paragraphs: blank lines separate paragraphs."""
    paragraphs, current = [], []
    for line in lines:
        line = "" if line is None else str(line).strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp files are private; cached text is not secret
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _unpack_blob(blob: bytes, compressed) -> bytes:
    """Decode one object of an R lazy-load database (.rdb); see R's lazyLoadDBfetch."""
    if not compressed:
        return blob
    size = struct.unpack(">I", blob[:4])[0]
    kind = int(compressed)
    if kind == 1:  # plain zlib after the length
        data = zlib.decompress(blob[4:])
    else:  # types 2/3 add one byte naming the codec
        codec, body = blob[4:5], blob[5:]
        if codec == b"Z":
            data = zlib.decompress(body)
        elif codec == b"2":
            import bz2

            data = bz2.decompress(body)
        elif codec == b"X":
            import lzma

            data = lzma.decompress(body)
        elif codec == b"0":
            data = body
        else:
            raise CorpusError(f"unknown R lazy-load compression {codec!r}")
    if len(data) != size:
        raise CorpusError("corrupt R lazy-load database (size mismatch)")
    return data


def read_r_books(pkg_dir: Path) -> dict[str, list]:
    """Return {R object name: lines} from an installed/unpacked janeaustenr folder."""
    import rdata

    data_dir = pkg_dir / "data"
    books = {}
    if (data_dir / "Rdata.rdx").is_file():  # LazyData: true builds this database
        index = rdata.read_rds(data_dir / "Rdata.rdx")
        # TRUE means zlib; 2 and 3 (bzip2, xz) tag each object with a codec byte.
        compressed = int(index["compressed"][0]) if "compressed" in index else 1
        raw = (data_dir / "Rdata.rdb").read_bytes()
        for name, (offset, length) in index["variables"].items():
            blob = _unpack_blob(raw[int(offset) : int(offset) + int(length)], compressed)
            books[str(name)] = list(rdata.conversion.convert(rdata.parser.parse_data(blob, extension=".rds")))
    for rda in sorted(data_dir.glob("*.rda")) + sorted(data_dir.glob("*.RData")):
        for name, value in rdata.read_rda(rda).items():  # source-package layout
            books[str(name)] = list(value)
    if not books:
        raise CorpusError(f"no R data found in {data_dir}")
    return books


def _apt_download(dest: Path) -> Path:
    try:
        proc = subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=dest, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise CorpusError(
            f"apt-get not found: the Austen corpus needs Debian's {DEB_PACKAGE} "
            "package (or pass a text file path instead)"
        ) from exc
    debs = list(dest.glob("*.deb"))
    if proc.returncode != 0 or not debs:
        hint = ""
        if "Unable to locate" in proc.stderr or "no installation candidate" in proc.stderr:
            hint = " The package lists look empty: run `apt-get update` first."
        raise CorpusError(
            f"`apt-get download {DEB_PACKAGE}` failed: {proc.stderr.strip() or proc.stdout.strip()}.{hint}"
        )
    return debs[0]


def _fetch_books(progress: bool) -> dict[str, list]:
    installed = Path("/") / _R_LIB  # R package already installed system-wide
    if installed.is_dir():
        return read_r_books(installed)
    with tempfile.TemporaryDirectory(prefix="veloxquant-austen-") as tmp:
        tmp = Path(tmp)
        if progress:
            print(f"veloxquant: downloading {DEB_PACKAGE} with apt-get ...", file=sys.stderr)
        deb = _apt_download(tmp)
        subprocess.run(["dpkg", "-x", str(deb), str(tmp / "root")], check=True, capture_output=True)
        return read_r_books(tmp / "root" / _R_LIB)


def austen_text(book: str | None = None, progress: bool = True) -> str:
    """Full text of one Austen novel (default: Pride & Prejudice), paragraphs joined by
    blank lines.  Downloads and caches all six novels on first use."""
    key = book_key(book)
    cache = cache_root() / "corpora" / "austen"
    path = cache / f"{key}.txt"
    if not path.is_file():
        from tqdm import tqdm

        books = _fetch_books(progress)
        for k, (title, rname) in tqdm(
            AUSTEN_BOOKS.items(), desc="austen: caching books", file=sys.stderr, disable=not progress, leave=False
        ):
            if rname not in books:
                raise CorpusError(f"{DEB_PACKAGE} has no {title!r} ({rname})")
            _atomic_write(cache / f"{k}.txt", lines_to_text(books[rname]))
    return path.read_text(encoding="utf-8")


def load_text(name_or_path: str | os.PathLike, progress: bool = True) -> str:
    """Text by corpus name ("austen", "austen:emma", "passkey": data/passkey_text.py) or from a text file path."""
    name = str(name_or_path)
    if name == "passkey" or name.startswith("passkey:"):  # synthetic retrieval text over an Austen book
        return passkey_corpus(austen_text(name.partition(":")[2] or "emma", progress=progress))
    if name == "austen" or name.startswith("austen:"):
        book = name.partition(":")[2] or None
        return austen_text(book, progress=progress)
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise CorpusError(f"text file not found: {path} (or use a corpus name such as 'austen' or 'austen:emma')")
    return path.read_bytes().decode("utf-8", errors="replace")
