"""Bytes to text for text.pages: find the encoding of a plain-text or Markdown file, or say why it is not text.

Order: a byte-order mark decides (UTF-8, UTF-16, UTF-32); otherwise strict UTF-8; otherwise Windows-1252 (the usual
"Latin-1" of real files: it is Latin-1 plus printable characters in 0x80-0x9F), then ISO-8859-1 itself. Latin-1
decodes any byte string, so each candidate must also *look* like text: no NUL bytes and almost no control characters.
"""

from __future__ import annotations

import codecs
import unicodedata

#: Control characters that real text files contain (tab, newlines, vertical tab, form feed, escape for ANSI colours).
_ALLOWED_CONTROLS = frozenset("\t\n\r\x0b\x0c\x1b")
#: Above this share of control characters a decoded string is binary data that happened to decode.
MAX_CONTROL_FRACTION = 0.01

_BOMS: tuple[tuple[bytes, str], ...] = (
    (codecs.BOM_UTF32_LE, "utf-32"),  # before UTF-16 LE: it starts with the same two bytes
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


class NotText(ValueError):
    """The bytes are not a text file; the message says what they look like."""


def looks_like_pdf(data: bytes) -> bool:
    """PDF readers accept the header anywhere in the first 1024 bytes, so a text stage must look there too."""
    return b"%PDF-" in data[:1024]


def control_fraction(text: str) -> float:
    """Share of characters that are control characters no text file contains (C0 and C1, minus tab/newlines)."""
    if not text:
        return 0.0
    bad = sum(1 for ch in text if unicodedata.category(ch) == "Cc" and ch not in _ALLOWED_CONTROLS)
    return bad / len(text)


def _textlike(text: str) -> bool:
    return "\x00" not in text and control_fraction(text) <= MAX_CONTROL_FRACTION


def decode_text(data: bytes) -> tuple[str, str]:
    """Return ``(text, encoding)`` with newlines normalised to ``\\n``; raise NotText when the bytes are not text."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                text = data.decode(encoding)
            except UnicodeDecodeError as exc:
                raise NotText(f"it starts with a {encoding} byte-order mark but does not decode as {encoding} ({exc.reason})") from exc
            if not _textlike(text):
                raise NotText(f"it decodes as {encoding} but holds control characters, so it looks binary")
            return _normalise_newlines(text.lstrip("\ufeff")), encoding
    if b"\x00" in data:
        raise NotText("it holds NUL bytes, so it looks binary (or UTF-16 without a byte-order mark)")
    for encoding in ("utf-8", "cp1252", "latin-1"):
        try:
            text = data.decode(encoding)
        except UnicodeDecodeError:
            continue
        if _textlike(text):
            return _normalise_newlines(text), encoding
    raise NotText("it is neither UTF-8 nor Latin-1/Windows-1252 text (too many control characters, so it looks binary)")


def _normalise_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")
