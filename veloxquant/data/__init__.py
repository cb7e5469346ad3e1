"""Evaluation corpora."""

from .corpus import AUSTEN_BOOKS, CorpusError, austen_text, book_key, load_text

__all__ = ["AUSTEN_BOOKS", "CorpusError", "austen_text", "book_key", "load_text"]
