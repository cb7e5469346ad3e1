"""Austen corpus: fast tests on a synthetic R lazy-load database, slow one on the real package."""

import gzip
import struct
import subprocess
import zlib

import numpy as np
import pytest
import rdata

from veloxquant.data import AUSTEN_BOOKS, CorpusError, austen_text, book_key, corpus, load_text

LINES = [
    "PRIDE AND PREJUDICE",
    "",
    "Chapter 1",
    "",
    "It is a truth universally",
    "acknowledged, that a single man",
    "",
    "",
    "Mr. Bennet replied.",
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "corpora" / "austen"


def _serialize(obj, tmp_path):
    """R serialization bytes of ``obj`` (what each lazy-load entry holds)."""
    rdata.write_rds(tmp_path / "obj.rds", obj, compression=None)
    return (tmp_path / "obj.rds").read_bytes()


def _make_lazyload_pkg(tmp_path, books):
    """A janeaustenr-like folder: data/Rdata.rdb + Rdata.rdx as R's LazyData builds them."""
    data = tmp_path / "pkg" / "data"
    data.mkdir(parents=True)
    blobs, index = b"", {}
    for name, lines in books.items():
        raw = _serialize(np.array(lines), tmp_path)
        blob = struct.pack(">I", len(raw)) + zlib.compress(raw)
        index[name] = np.array([len(blobs), len(blob)], dtype=np.int32)
        blobs += blob
    (data / "Rdata.rdb").write_bytes(blobs)
    rdx = {"variables": index, "references": {}, "compressed": np.array([True])}
    rdata.write_rds(data / "Rdata.rdx", rdx, compression="gzip")
    return tmp_path / "pkg"


def test_book_keys():
    for name in (None, "pride", "Pride & Prejudice", "Pride and Prejudice", "prideprejudice"):
        assert book_key(name) == "pride"
    assert book_key("Sense & Sensibility") == "sense" and book_key("EMMA") == "emma"
    assert set(AUSTEN_BOOKS) == {"pride", "sense", "emma", "mansfield", "northanger", "persuasion"}
    with pytest.raises(CorpusError, match="unknown Austen book"):
        book_key("Middlemarch")


def test_lines_to_text_joins_paragraphs():
    text = corpus.lines_to_text(LINES + [None])
    assert text == (
        "PRIDE AND PREJUDICE\n\nChapter 1\n\nIt is a truth universally "
        "acknowledged, that a single man\n\nMr. Bennet replied.\n"
    )


def test_unpack_blob_codecs():
    raw = b"X\n" + b"abc" * 100
    head = struct.pack(">I", len(raw))
    assert corpus._unpack_blob(head + zlib.compress(raw), 1) == raw
    assert corpus._unpack_blob(head + b"Z" + zlib.compress(raw), 2) == raw
    assert corpus._unpack_blob(head + b"0" + raw, 3) == raw
    with pytest.raises(CorpusError):
        corpus._unpack_blob(struct.pack(">I", 5) + zlib.compress(raw), 1)


def test_read_r_books_from_lazyload_db(tmp_path):
    pkg = _make_lazyload_pkg(tmp_path, {"prideprejudice": LINES, "emma": ["EMMA", "", "x"]})
    books = corpus.read_r_books(pkg)
    assert books["prideprejudice"] == LINES and books["emma"] == ["EMMA", "", "x"]
    with pytest.raises(CorpusError):
        corpus.read_r_books(tmp_path / "nothing")


def test_austen_text_fetches_once_and_caches_all_books(cache, tmp_path, monkeypatch):
    books = {rname: [title.upper(), "", f"Text of {title}."] for title, rname in AUSTEN_BOOKS.values()}
    calls = []
    monkeypatch.setattr(corpus, "_fetch_books", lambda progress: calls.append(1) or books)
    assert austen_text(progress=False) == "PRIDE & PREJUDICE\n\nText of Pride & Prejudice.\n"
    assert load_text("austen:emma", progress=False).endswith("Text of Emma.\n")
    assert load_text("austen", progress=False).startswith("PRIDE")
    assert len(calls) == 1
    assert sorted(p.name for p in cache.iterdir()) == sorted(f"{k}.txt" for k in AUSTEN_BOOKS)


def test_apt_failure_suggests_update(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 100, "", "E: Unable to locate package r-cran-janeaustenr")
    monkeypatch.setattr(corpus.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(CorpusError, match="apt-get update"):
        corpus._apt_download(tmp_path)


def test_load_text_from_path(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("héllo\n", encoding="utf-8")
    assert load_text(f) == "héllo\n" and load_text(str(f)) == "héllo\n"
    with pytest.raises(CorpusError, match="not found"):
        load_text(tmp_path / "missing.txt")


def test_rdx_is_gzip_rds(tmp_path):
    # Guards the fixture itself: R writes the index as a gzip-compressed RDS.
    pkg = _make_lazyload_pkg(tmp_path, {"emma": ["a"]})
    assert gzip.decompress((pkg / "data" / "Rdata.rdx").read_bytes())[:2] == b"X\n"


@pytest.mark.slow  # needs the Debian mirror on first use
def test_real_austen_corpus():
    text = austen_text("Pride & Prejudice", progress=False)
    assert "It is a truth universally acknowledged, that a single man in possession" in text
    assert 600_000 < len(text) < 800_000 and "\n\n" in text
    for key in AUSTEN_BOOKS:
        assert len(austen_text(key, progress=False)) > 300_000
