"""text.pages: .txt and .md sources to the pdf.text page contract."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pymupdf
import pytest

from docfuse.pipelines.registry import find_stage
from docfuse.stages import schemas
from docfuse.stages.text import TextPages
from docfuse.stages.text_decode import decode_text
from docfuse.stages.text_split import paragraph_blocks

CORPUS = Path(__file__).resolve().parent.parent.parent / "shared" / "corpus"


def _sources(*files: tuple[str, bytes]) -> pa.Table:
    rows = [schemas.empty_row(schemas.SOURCE, doc_id=f"id-{i}", source=name, data=data) for i, (name, data) in enumerate(files)]
    return pa.Table.from_pylist(rows, schema=schemas.SOURCE)


def _run(*files: tuple[str, bytes], **params) -> list[dict]:
    out = TextPages(**params).run(_sources(*files))
    assert out.schema == schemas.PAGE_TEXT
    return out.to_pylist()


def _paragraphs(n: int, words: int = 40, tag: str = "p") -> list[str]:
    return [" ".join(f"{tag}{i}w{j}" for j in range(words)) + "." for i in range(n)]


def test_registered_and_same_contract_as_pdf_text() -> None:
    assert find_stage("text.pages") is TextPages
    assert TextPages.output_schema == schemas.PAGE_TEXT
    assert set(TextPages.inputs["sources"].names) <= set(schemas.SOURCE.names)


def test_form_feeds_split_pages_and_keep_blank_pages() -> None:
    text = "First page line one.\nline two\fSecond page\f\fFourth page has four words\f"
    rows = _run(("doc.txt", text.encode()))
    assert [r["page"] for r in rows] == [0, 1, 2, 3]  # the \f after the last page does not make a fifth
    assert [r["text"] for r in rows] == ["First page line one.\nline two", "Second page", "", "Fourth page has four words"]
    assert [r["n_words"] for r in rows] == [6, 2, 0, 5]
    assert all(r["image_only"] is False and r["error"] is None for r in rows)
    assert all(r["doc_id"] == "id-0" and r["source"] == "doc.txt" for r in rows)


def test_form_feeds_win_over_page_chars() -> None:
    long_page = "\n\n".join(_paragraphs(10))
    rows = _run(("doc.txt", f"{long_page}\fshort".encode()), page_chars=500)
    assert [r["text"] for r in rows] == [long_page, "short"]


def test_plain_text_pages_break_at_paragraphs() -> None:
    paragraphs = _paragraphs(30)  # ~ 30 x 280 characters
    text = "\n\n".join(paragraphs)
    rows = _run(("essay.txt", text.encode()), page_chars=1000)
    assert len(rows) > 5 and [r["page"] for r in rows] == list(range(len(rows)))
    for r in rows:
        assert len(r["text"]) <= 1000
        assert all(p in paragraphs for p in r["text"].split("\n\n"))  # only whole paragraphs
    assert "\n\n".join(r["text"] for r in rows) == text  # nothing lost, nothing reordered
    assert sum(r["n_words"] for r in rows) == len(text.split())
    # Greedy: each page is full enough that the next paragraph would not have fitted.
    for r, nxt in zip(rows, rows[1:]):
        assert len(r["text"]) + 2 + len(nxt["text"].split("\n\n")[0]) > 1000


def test_default_page_chars_is_about_3000() -> None:
    text = "\n\n".join(_paragraphs(60))
    rows = _run(("a.txt", text.encode()))
    assert all(2000 < len(r["text"]) <= 3000 for r in rows[:-1])


def test_long_paragraph_is_cut_at_sentence_ends() -> None:
    sentences = [f"Sentence number {i} says something about the topic at hand." for i in range(60)]
    text = " ".join(sentences)  # one ~3600-character paragraph, no newlines
    rows = _run(("one.txt", text.encode()), page_chars=1000)
    assert len(rows) >= 4
    for r in rows:
        assert len(r["text"]) <= 1000
        assert r["text"].startswith("Sentence number") and r["text"].endswith("at hand.")
    assert " ".join(r["text"] for r in rows) == text


def test_text_without_any_break_is_cut_hard_at_page_chars() -> None:
    rows = _run(("dna.txt", ("ACGT" * 1000).encode()), page_chars=1000)
    assert [len(r["text"]) for r in rows] == [1000, 1000, 1000, 1000]


def test_markdown_prefers_heading_boundaries() -> None:
    sections = []
    for s in range(6):
        sections.append(f"## Section {s}\n\n" + "\n\n".join(_paragraphs(3, words=25, tag=f"s{s}p")))
    text = "# Title\n\n" + "\n\n".join(sections)
    md = _run(("notes.md", text.encode()), page_chars=1000)
    plain = _run(("notes.txt", text.encode()), page_chars=1000)
    assert all(len(r["text"]) <= 1000 for r in md)
    assert all(r["text"].startswith("## Section") for r in md[1:])  # every later page opens at a heading
    assert not all(r["text"].startswith("## Section") for r in plain[1:])  # plain text does not care
    assert "\n\n".join(r["text"] for r in md) == text
    forced = _run(("notes.txt", text.encode()), page_chars=1000, format="markdown")
    assert [r["text"] for r in forced] == [r["text"] for r in md]


def test_markdown_keeps_code_fences_whole_and_ignores_hashes_in_them() -> None:
    code = "```python\n# not a heading\nx = 1\n\n\ny = 2\n```"
    filler = "\n\n".join(_paragraphs(3, words=25))
    text = f"# Intro\n\n{filler}\n\n{code}\n\nAfter the code."
    rows = _run(("code.md", text.encode()), page_chars=700)
    assert sum(code in r["text"] for r in rows) == 1
    blocks = [text[b.start:b.end] for b in paragraph_blocks(text, markdown=True)]
    assert code in blocks and not any(b.startswith("# not a heading") for b in blocks)
    assert code not in [text[b.start:b.end] for b in paragraph_blocks(text, markdown=False)]  # plain text splits it
    assert not any(r["text"].startswith("# not a heading") for r in rows)
    assert "\n\n".join(r["text"] for r in rows) == text


def test_setext_headings_count_as_headings() -> None:
    body = "\n\n".join(_paragraphs(3, words=25))
    text = "\n\n".join(f"Part {i}\n======\n\n{body}" for i in range(4))
    rows = _run(("setext.md", text.encode()), page_chars=1200)
    assert all(r["text"].startswith("Part ") for r in rows)


def test_encodings() -> None:
    assert decode_text("café ≠ naïve\r\nline".encode("utf-8")) == ("café ≠ naïve\nline", "utf-8")
    assert decode_text("\ufeffwith bom".encode("utf-8")) == ("with bom", "utf-8-sig")
    assert decode_text("utf16 ünï".encode("utf-16")) == ("utf16 ünï", "utf-16")
    assert decode_text("“quoted” café".encode("cp1252")) == ("“quoted” café", "cp1252")
    assert decode_text("Grüße aus Köln".encode("latin-1"))[0] == "Grüße aus Köln"
    assert decode_text(b"old mac\rline")[0] == "old mac\nline"
    rows = _run(("bom.txt", "\ufeffHello there".encode("utf-8")), ("latin.txt", "Ça va très bien".encode("latin-1")))
    assert [r["text"] for r in rows] == ["Hello there", "Ça va très bien"]
    assert [r["n_words"] for r in rows] == [2, 4]


def test_binary_is_not_text() -> None:
    png = bytes.fromhex("89504e470d0a1a0a0000000d49484452") + bytes(range(256)) * 4
    controls = bytes([1, 2, 3, 4, 5, 6, 7, 8]) * 50 + b"some text"
    rows = _run(("image.png", png), ("odd.txt", controls), ("ok.txt", b"fine"))
    for r in rows[:2]:
        assert r["error"].startswith("not_text: ") and "UTF-8 .txt or .md" in r["error"]
        assert r["text"] is None and r["page"] is None
    assert "'image.png'" in rows[0]["error"] and "binary" in rows[0]["error"]
    assert rows[2]["error"] is None and rows[2]["text"] == "fine"


def test_pdf_is_refused_with_the_pipeline_to_use() -> None:
    doc = pymupdf.open()
    doc.new_page().insert_text((72, 72), "A real PDF page")
    rows = _run(("report.txt", doc.tobytes()), ("after.md", b"# Still fine"))
    assert rows[0]["error"].startswith("not_text: 'report.txt' is a PDF") and "pdf_* pipelines" in rows[0]["error"]
    assert rows[1]["error"] is None and rows[1]["text"] == "# Still fine"


def test_empty_and_blank_files() -> None:
    rows = _run(("empty.txt", b""), ("blank.md", b" \n\n\t\n"), ("real.txt", b"words here"))
    assert rows[0]["error"].startswith("empty_file: 'empty.txt'")
    assert rows[1]["error"].startswith("empty_file: 'blank.md'")
    assert rows[2] == {"doc_id": "id-2", "source": "real.txt", "page": 0, "text": "words here", "image_only": False,
                       "n_words": 2, "text_source": None, "ocr_confidence": None, "warning": None,
                       "error": None}


def test_params_are_validated() -> None:
    with pytest.raises(ValueError):
        TextPages(page_chars=10)
    with pytest.raises(ValueError):
        TextPages(format="html")
    with pytest.raises(ValueError):
        TextPages(pages=3)


@pytest.mark.corpus
@pytest.mark.skipif(not (CORPUS / "longctx" / "niah_paul_graham_essays").is_dir(), reason="needs ../shared/corpus")
def test_real_essays_keep_every_word() -> None:
    files = sorted((CORPUS / "longctx" / "niah_paul_graham_essays").glob("*.txt"))[:8]
    out = TextPages().run(_sources(*((f.name, f.read_bytes()) for f in files)))
    for i, f in enumerate(files):
        pages = [r for r in out.to_pylist() if r["doc_id"] == f"id-{i}"]
        assert pages and all(r["error"] is None and len(r["text"]) <= 3000 for r in pages)
        words = re.findall(r"\S+", f.read_bytes().decode("utf-8").replace("\f", " "))
        assert [w for r in pages for w in r["text"].split()] == words
        assert sum(r["n_words"] for r in pages) == len(words)
