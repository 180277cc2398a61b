"""Open one PDF's bytes: check what the file is, decrypt, repair, and hand back clean bytes.

Each way a file can fail is a :class:`PdfOpenError` with a short ``kind`` and a message that says what was
found and what to do about it, so the stage can turn it into an error row.
"""

from __future__ import annotations

from dataclasses import dataclass

import pymupdf

#: The PDF header may sit anywhere in the first 1024 bytes (ISO 32000 readers tolerate leading junk).
HEADER_WINDOW = 1024

_MAGIC = [
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"II*\x00", "a TIFF image"),
    (b"MM\x00*", "a TIFF image"),
    (b"PK\x03\x04", "a ZIP archive (perhaps a .docx, .xlsx or .epub)"),
    (b"\xd0\xcf\x11\xe0", "an old Microsoft Office file (.doc, .xls)"),
    (b"%!PS", "a PostScript file"),
    (b"{\\rtf", "an RTF document"),
    (b"\x1f\x8b", "a gzip archive"),
]


class PdfOpenError(Exception):
    """A document that cannot be opened; ``kind`` is the error row's kind, ``message`` names the fix."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class OpenedPdf:
    pdf: bytes          # the document without encryption, repaired if it needed it
    n_pages: int
    repaired: bool      # MuPDF rebuilt a broken cross-reference table
    decrypted: bool     # the input was encrypted (with a password, or with an empty one)


def describe_non_pdf(data: bytes) -> str:
    """What bytes without a PDF header look like, in words, with what to do instead."""
    head = data[:HEADER_WINDOW]
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return f"the file is {what}, not a PDF; convert it to PDF first or use a pipeline for that format"
    stripped = head.lstrip().lower()
    if stripped.startswith((b"<!doctype html", b"<html")):
        return ("the file is an HTML page (often a download that returned an error or login page); "
                "download the PDF itself")
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and sum(c.isprintable() or c in "\r\n\t" for c in text) >= 0.95 * max(len(text), 1):
        return "the file starts with plain text, not a PDF header; if it is text, use the text_qa pipeline"
    return ("the file has no '%PDF-' header in its first 1024 bytes and is not a known format; "
            "check that it is really a PDF (re-download or re-export it)")


def open_pdf(data: bytes, password: str | None = None) -> OpenedPdf:
    """Open, authenticate and repair one PDF; raise :class:`PdfOpenError` when that cannot be done.

    Clean, unencrypted files are passed through byte for byte (cheap for large documents). Encrypted or
    repaired files are rewritten without encryption and with a fresh cross-reference table, and the result is
    reopened to check that it needs no password and has the same pages.
    """
    if not data:
        raise PdfOpenError("empty_file", "the file is 0 bytes long; re-download or re-export the document")
    if b"%PDF-" not in data[:HEADER_WINDOW]:
        raise PdfOpenError("not_pdf", describe_non_pdf(data))
    try:
        doc = pymupdf.open(stream=data, filetype="pdf")
    except Exception as exc:  # MuPDF raises FileDataError, RuntimeError, ... for unreadable files
        if b" obj" not in data and b"\nobj" not in data:
            raise PdfOpenError("no_pages", "the file has a PDF header but no objects after it (an empty or "
                               "truncated download); re-download or re-export the document") from exc
        raise PdfOpenError("corrupt", f"MuPDF cannot read or repair the file ({exc}); re-export it from the "
                           "application that made it, or print it to a new PDF") from exc
    try:
        return _finish(doc, data, password)
    finally:
        doc.close()


def _finish(doc: pymupdf.Document, data: bytes, password: str | None) -> OpenedPdf:
    # Authenticate before touching page_count: on some encrypted files reading it first leaves it at 0.
    decrypted = bool(doc.is_encrypted or doc.needs_pass)
    if doc.needs_pass:
        if password is None:
            raise PdfOpenError("encrypted", "the PDF is protected by a password; pass it with "
                               "--set pages.password=... (the stage's `password` parameter)")
        if not doc.authenticate(password):
            raise PdfOpenError("wrong_password", "the given password does not open this PDF; check it, or "
                               "pass the user (open) password with --set pages.password=...")
    decrypted = decrypted or bool(doc.metadata and doc.metadata.get("encryption"))
    n_pages = doc.page_count
    if n_pages == 0:
        raise PdfOpenError("no_pages", "the PDF has no pages MuPDF could find, even after repair; "
                           "re-export or re-download the document")
    loadable = _count_loadable(doc, n_pages)
    if loadable == 0:
        raise PdfOpenError("corrupt", f"none of the {n_pages} pages can be loaded (broken page tree); "
                           "re-export the document, or print it to a new PDF")
    repaired = bool(doc.is_repaired)
    if not (repaired or decrypted):
        return OpenedPdf(pdf=data, n_pages=n_pages, repaired=False, decrypted=False)
    try:
        out = doc.tobytes(garbage=1, encryption=pymupdf.PDF_ENCRYPT_NONE)
        check = pymupdf.open(stream=out, filetype="pdf")
        ok = not check.needs_pass and check.page_count == n_pages
        check.close()
    except Exception as exc:
        raise PdfOpenError("corrupt", f"MuPDF could open the file but not write a repaired copy ({exc}); "
                           "re-export it, or print it to a new PDF") from exc
    if not ok:
        raise PdfOpenError("corrupt", "the repaired or decrypted copy does not reopen with the same pages; "
                           "re-export the document, or print it to a new PDF")
    return OpenedPdf(pdf=out, n_pages=n_pages, repaired=repaired, decrypted=decrypted)


def _count_loadable(doc: pymupdf.Document, n_pages: int) -> int:
    """Pages MuPDF can load. Loading a page parses only its dictionary, so this stays cheap; it also makes
    MuPDF repair the file now (setting ``is_repaired``) rather than later, in another stage."""
    loadable = 0
    for i in range(n_pages):
        try:
            doc.load_page(i)
            loadable += 1
        except Exception:
            continue
    return loadable
