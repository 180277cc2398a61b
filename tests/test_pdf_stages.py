"""pdf.open, pdf.text and pdf.render on PDFs that PyMuPDF writes here (tests/pdf_fixtures.py), on the shipped
sample (data/make_sample_pdf.py) and, when it is there, on the shared corpus of real files."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pyarrow as pa
import pymupdf
import pytest
from pydantic import ValidationError

from docfuse.stages import schemas
from docfuse.stages.pdf import MAX_SIDE_PX, PdfOpen, PdfRender, PdfText, fit_dpi
from docfuse.stages.pdf_open import PdfOpenError, open_pdf
from docfuse.stages.pdf_tables import table_gate_report, to_markdown
from tests import pdf_fixtures as F

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "corpus" / "pdf"


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> dict[str, Path]:
    return F.write_all(tmp_path_factory.mktemp("pdfs"))


def sources(*paths: Path | tuple[str, bytes]) -> pa.Table:
    """A SOURCE table, as the engine would read it: one row per file."""
    rows = []
    for item in paths:
        name, data = (item.name, item.read_bytes()) if isinstance(item, Path) else item
        rows.append({"doc_id": f"id-{name}", "source": f"/in/{name}", "data": data})
    return pa.Table.from_pylist(rows, schema=schemas.SOURCE)


def opened(*paths, password: str | None = None) -> pa.Table:
    return PdfOpen(password=password).run(sources(*paths))


def by_doc(table: pa.Table) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in table.to_pylist():
        out.setdefault(row["doc_id"], []).append(row)
    return out


def kind(error: str | None) -> str | None:
    return error.split(":", 1)[0] if error else None


def good(table: pa.Table) -> pa.Table:
    return table.filter(pa.compute.is_null(table["error"]))


def page_texts(path: Path, **params) -> list[dict]:
    return PdfText(**params).run(opened(path)).to_pylist()


# --- pdf.open ---------------------------------------------------------------------------------------------

def test_open_bad_inputs_become_error_rows_and_the_good_document_survives(fx):
    names = ["born_digital", "empty", "header_only", "text_named_pdf", "corrupt", "encrypted", "broken_xref"]
    out = opened(*(fx[n] for n in names))
    assert out.schema == schemas.PDF_DOC
    rows = out.to_pylist()
    assert [kind(r["error"]) for r in rows] == [None, "empty_file", "no_pages", "not_pdf", "corrupt", "encrypted", None]
    assert rows[0]["n_pages"] == 3 and rows[6]["n_pages"] == 3
    assert pymupdf.open(stream=rows[0]["pdf"], filetype="pdf").page_count == 3
    for r in rows[1:6]:
        assert r["pdf"] is None and r["n_pages"] is None
    messages = {kind(r["error"]): r["error"] for r in rows if r["error"]}
    assert "text_qa" in messages["not_pdf"]
    assert "--set pages.password=" in messages["encrypted"]
    assert "re-download" in messages["empty_file"]


def test_encrypted_opens_with_the_user_or_owner_password_and_comes_out_decrypted(fx):
    for password in (F.USER_PASSWORD, F.OWNER_PASSWORD):
        row = opened(fx["encrypted"], password=password).to_pylist()[0]
        assert row["error"] is None and row["n_pages"] == 2
        doc = pymupdf.open(stream=row["pdf"], filetype="pdf")
        assert not doc.needs_pass and not doc.is_encrypted and doc.page_count == 2
        assert "Chapter 2" in doc[1].get_text()
    wrong = opened(fx["encrypted"], password="nope").to_pylist()[0]
    assert kind(wrong["error"]) == "wrong_password"


def test_password_is_ignored_for_unencrypted_documents(fx):
    assert opened(fx["born_digital"], password="whatever").to_pylist()[0]["error"] is None


def test_broken_xref_is_repaired_and_rewritten(fx):
    data = fx["broken_xref"].read_bytes()
    result = open_pdf(data)
    assert result.repaired and result.n_pages == 3 and result.pdf != data
    doc = pymupdf.open(stream=result.pdf, filetype="pdf")
    assert not doc.is_repaired
    rows = PdfText().run(opened(fx["broken_xref"])).to_pylist()
    assert [r["page"] for r in rows] == [0, 1, 2] and all(r["error"] is None for r in rows)
    assert "# Chapter 3" in rows[2]["text"]


def test_clean_documents_pass_through_unchanged(fx):
    data = fx["born_digital"].read_bytes()
    assert open_pdf(data).pdf == data


@pytest.mark.parametrize("data, words", [
    (b"\x89PNG\r\n\x1a\n" + bytes(64), "PNG image"),
    (b"PK\x03\x04" + bytes(64), "ZIP archive"),
    (b"<!DOCTYPE html><html><body>login</body></html>", "HTML page"),
    (bytes(range(256)) * 8, "not a known format"),
])
def test_non_pdf_bytes_are_described(data, words):
    with pytest.raises(PdfOpenError) as info:
        open_pdf(data)
    assert info.value.kind == "not_pdf" and words in info.value.message


def test_pdf_with_objects_but_no_pages_is_no_pages():
    data = F._raw_pdf([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [] /Count 0 >>"])
    with pytest.raises(PdfOpenError) as info:
        open_pdf(data)
    assert info.value.kind == "no_pages"


# --- pdf.text: text layer -----------------------------------------------------------------------------

def test_text_rows_follow_the_contract(fx):
    out = PdfText().run(opened(fx["born_digital"]))
    assert out.schema == schemas.PAGE_TEXT
    rows = out.to_pylist()
    assert [r["page"] for r in rows] == [0, 1, 2]
    for i, r in enumerate(rows):
        assert r["doc_id"] == "id-born_digital.pdf" and r["source"] == "/in/born_digital.pdf"
        assert r["error"] is None and r["image_only"] is False
        assert F.PLAIN_SENTENCE.format(i=i + 1) in r["text"]
        assert r["n_words"] == len(r["text"].replace("#", " ").split())


def test_image_only_pages_are_flagged_with_empty_text_when_ocr_is_off(fx):
    scan = page_texts(fx["image_only"], ocr="never")[0]
    assert scan["image_only"] is True and scan["text"] == "" and scan["n_words"] == 0 and scan["error"] is None
    assert scan["text_source"] == "none" and scan["ocr_confidence"] is None
    mixed = page_texts(fx["mixed_scan"], ocr="never")
    assert [r["image_only"] for r in mixed] == [False, True]
    assert [r["text_source"] for r in mixed] == ["layer", "none"]
    assert "Chapter 1" in mixed[0]["text"] and mixed[1]["text"] == ""


def test_font_without_tounicode_counts_as_no_text_layer(fx):
    page = pymupdf.open(fx["type3_no_tounicode"])[0]
    assert page.get_text().strip(), "the fixture must have a (garbage) text layer"
    row = page_texts(fx["type3_no_tounicode"], ocr="never")[0]
    assert row["image_only"] is True and row["text"] == "" and row["error"] is None


def test_two_column_page_reads_column_by_column_with_footnote_last(fx):
    text = page_texts(fx["two_column"])[0]["text"]
    order = [F.TITLE, F.INTRO, F.SECTION, F.LEFT_HEADING, *F.LEFT_SENTENCES, F.RIGHT_HEADING,
             *F.RIGHT_SENTENCES, F.OUTRO, F.SIDE_NOTE, F.FOOTNOTE]
    positions = [text.find(s) for s in order]
    assert -1 not in positions, [s for s, p in zip(order, positions) if p == -1]
    assert positions == sorted(positions)
    assert text.endswith(F.FOOTNOTE)


def test_heading_levels_come_from_font_sizes(fx):
    lines = page_texts(fx["two_column"])[0]["text"].split("\n")
    assert f"# {F.TITLE}" in lines
    assert f"## {F.SECTION}" in lines
    assert f"### {F.LEFT_HEADING}" in lines and f"### {F.RIGHT_HEADING}" in lines
    assert not any(line.startswith("#") and "Alpha" in line for line in lines)


def test_page_number_is_dropped_and_kept_as_a_footer_block(fx):
    row = page_texts(fx["two_column"], layout=True)[0]
    assert not re.search(r"(^|\n)3(\n|$)", row["text"])
    footers = [b for b in row["blocks"] if b["kind"] == "footer"]
    assert [b["text"] for b in footers] == ["3"] and footers[0]["order"] == -1
    assert all(w["text"] != "3" for w in row["words"])


def test_layout_columns_describe_words_and_blocks(fx):
    stage = PdfText(layout=True)
    schema = stage.output()
    assert schema.names[-1] == "error"
    assert [f.name for f in schemas.PAGE_LAYOUT_FIELDS] == schema.names[len(schemas.PAGE_TEXT) - 1:-1]
    out = stage.run(opened(fx["two_column"]))
    assert out.schema == schema
    row = out.to_pylist()[0]
    assert (row["page_width"], row["page_height"]) == (612.0, 792.0)
    assert row["n_words"] == len(row["words"])
    blocks = row["blocks"]
    in_text = [b for b in blocks if b["order"] >= 0]
    assert [b["order"] for b in in_text] == list(range(len(in_text)))
    assert [b["kind"] for b in in_text][-1] == "footnote"
    assert {(b["kind"], b["level"]) for b in in_text if b["kind"] == "heading"} == {("heading", 1), ("heading", 2),
                                                                                      ("heading", 3)}
    alpha = next(w for w in row["words"] if w["text"] == "Alpha:")
    assert blocks[alpha["block"]]["text"].startswith("Alpha:")
    assert 72 <= alpha["x0"] < alpha["x1"] < 306 and alpha["y0"] < alpha["y1"]
    for w in row["words"]:
        b = blocks[w["block"]]
        assert b["x0"] - 0.5 <= w["x0"] and w["x1"] <= b["x1"] + 0.5


def test_rotated_page_reads_upright_in_the_rendered_frame(fx):
    row = page_texts(fx["rotated"], layout=True)[0]
    assert row["text"] == "\n\n".join(F.ROTATED_LINES)
    assert (row["page_width"], row["page_height"]) == (792.0, 612.0)
    for w in row["words"]:
        assert 0 <= w["x0"] < w["x1"] <= 792 and 0 <= w["y0"] < w["y1"] <= 612
        if len(w["text"]) >= 4:
            assert w["x1"] - w["x0"] > w["y1"] - w["y0"]       # upright: a long word is wider than tall
    image = PdfRender(dpi=36).run(opened(fx["rotated"])).to_pylist()[0]
    assert (image["width_px"], image["height_px"]) == (396, 306)


def test_join_lines_dehyphenates_and_keeps_list_items():
    from docfuse.stages.pdf_layout import join_lines

    assert join_lines(["an exam-", "ple of re-", "Flow", "• first item", "• second", "1. numbered"]) == (
        "an example of re- Flow\n• first item\n• second\n1. numbered")


def test_upstream_error_rows_pass_through_unchanged(fx):
    src = pa.Table.from_pylist([{"doc_id": "gone", "source": "/in/gone.pdf", "data": None,
                                 "error": "unreadable: the engine could not read it"}], schema=schemas.SOURCE)
    assert PdfOpen().run(src).to_pylist()[0]["error"] == "unreadable: the engine could not read it"
    docs = pa.Table.from_pylist([{"doc_id": "gone", "source": "/in/gone.pdf", "error": "encrypted: upstream"}],
                                schema=schemas.PDF_DOC)
    for stage in (PdfText(), PdfRender()):
        assert stage.run(docs).to_pylist()[0]["error"] == "encrypted: upstream"


# --- pdf.text: tables ---------------------------------------------------------------------------------

def _table_lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.startswith("|")]


@pytest.mark.parametrize("name", ["ruled_table", "unruled_table"])
def test_tables_become_markdown_in_place_without_duplicate_words(fx, name):
    row = page_texts(fx[name], layout=True)[0]
    text = row["text"]
    assert _table_lines(text) == to_markdown(F.TABLE_ROWS).split("\n")
    assert "| Northwind | 1,200 | 1,350 | 2,550 |" in text
    assert text.count("Northwind") == 1 and text.count("1,505") == 1
    assert text.index(F.TABLE_BEFORE) < text.index("| Region |") < text.index(F.TABLE_AFTER)
    tables = [b for b in row["blocks"] if b["kind"] == "table"]
    assert len(tables) == 1
    table_words = [w["text"] for w in row["words"] if row["blocks"][w["block"]]["kind"] == "table"]
    assert sorted(table_words) == sorted(c for r in F.TABLE_ROWS for c in r)
    assert sum(w["text"] == "Northwind" for w in row["words"]) == 1


def test_auto_gate_runs_find_tables_only_where_rules_form_a_grid(fx):
    stage = PdfText(tables="auto")
    rows = stage.run(opened(fx["ruled_table"], fx["two_column"], fx["born_digital"])).to_pylist()
    assert len(rows) == 2 + 1 + 3
    assert stage.stats == {"pages": 6, "find_tables_pages": 1, "tables": 1, "ocr_pages": 0}
    always = PdfText(tables="always")
    always.run(opened(fx["ruled_table"], fx["two_column"]))
    assert always.stats["find_tables_pages"] == 3 and always.stats["tables"] == 1


def test_grid_gate_counts_rules_and_stroked_boxes_but_not_shading():
    from docfuse.stages.pdf_tables import grid_signal

    doc = pymupdf.open()
    shaded = doc.new_page(width=612, height=792)
    for r in range(6):                                   # zebra rows: filled, unstroked boxes
        for c in range(4):
            shaded.draw_rect(pymupdf.Rect(72 + 100 * c, 100 + 40 * r, 170 + 100 * c, 120 + 40 * r),
                             color=None, fill=(0.8, 0.9, 1.0))
    boxed = doc.new_page(width=612, height=792)
    for r in range(2):                                   # a 2x2 grid of stroked cells
        for c in range(2):
            boxed.draw_rect(pymupdf.Rect(72 + 100 * c, 100 + 20 * r, 172 + 100 * c, 120 + 20 * r))
    framed = doc.new_page(width=612, height=792)
    framed.draw_rect(pymupdf.Rect(36, 36, 576, 756))     # a page frame alone is no grid
    assert [grid_signal(p) for p in doc] == [False, True, False]


def test_tables_never_leaves_the_cells_as_plain_text(fx):
    text = page_texts(fx["ruled_table"], tables="never")[0]["text"]
    assert not _table_lines(text)
    assert "Northwind" in text and "2,935" in text


def test_gate_report_counts_pages(fx):
    ruled = table_gate_report(fx["ruled_table"].read_bytes(), "auto")
    assert (ruled.pages, ruled.find_tables_pages, ruled.ruled_tables, ruled.unruled_tables) == (2, 1, 1, 0)
    assert table_gate_report(fx["ruled_table"].read_bytes(), "always").find_tables_pages == 2
    unruled = table_gate_report(fx["unruled_table"].read_bytes(), "auto")
    assert (unruled.find_tables_pages, unruled.ruled_tables, unruled.unruled_tables) == (0, 0, 1)
    prose = table_gate_report(fx["two_column"].read_bytes(), "auto")
    assert (prose.find_tables_pages, prose.ruled_tables, prose.unruled_tables) == (0, 0, 0)


def _tables_in(text: str) -> list[str]:
    """The Markdown tables of a page's text, each as one string."""
    return [block for block in text.split("\n\n") if block.startswith("|")]


def test_unruled_statement_of_figures_becomes_markdown_with_its_headers(fx):
    row = page_texts(fx["figures"], layout=True)[0]
    text = row["text"]
    statement, short = _tables_in(text)
    assert statement == to_markdown(F.FIN_HEADER + F.FIN_ROWS)
    assert short == to_markdown([F.SHORT_HEADER] + F.SHORT_ROWS)
    # In place, between the paragraphs around it, and every word once: the prose keeps its own figures.
    assert text.index(F.FIN_BEFORE) < text.index(statement) < text.index(F.FIN_AFTER) \
        < text.index(F.SHORT_CAPTION) < text.index(short)
    assert text.count("7,090,112") == 1 and text.count("402,118") == 2 and text.count("(in thousands)") == 1
    table_words = [w["text"] for w in row["words"] if row["blocks"][w["block"]]["kind"] == "table"]
    cells = F.FIN_HEADER + F.FIN_ROWS + [F.SHORT_HEADER] + F.SHORT_ROWS
    assert sorted(table_words) == sorted(word for r in cells for c in r for word in c.split())


def test_contents_page_becomes_a_table_of_titles_and_page_numbers(fx):
    text = page_texts(fx["figures"])[1]["text"]
    assert text.startswith("# Contents")
    assert _tables_in(text) == [to_markdown([list(entry) for entry in F.CONTENTS])]


def test_prose_full_of_figures_stays_prose(fx):
    from docfuse.stages.pdf_extract import extract_page
    from docfuse.stages.pdf_tables import figure_tables, unruled_tables

    text = page_texts(fx["figures"])[2]["text"]
    assert not _table_lines(text)
    assert "8,412,305 units, up 18% from 7,090,112 in 2015" in text and "40,000 items an hour" in text
    with pymupdf.open(fx["figures"]) as doc:
        words = extract_page(doc[2]).words
    assert figure_tables(words) == [] and unruled_tables(words) == []


def test_figures_gate_report_counts_unruled_tables_without_find_tables(fx):
    report = table_gate_report(fx["figures"].read_bytes(), "auto")
    assert (report.pages, report.find_tables_pages, report.ruled_tables, report.unruled_tables) == (3, 0, 0, 3)


@pytest.mark.parametrize("text, figure", [
    ("1,234", True), ("(1,234)", True), ("$6,779", True), ("0.29", True), ("12%", True), ("(1)%", True),
    ("—", True), ("-", True), ("4.1†", True), ("2015", True),
    ("2016,", False), ("31,", False), ("1,23", False), ("10-Q", False), ("2015-16", False), ("Net", False),
    ("1.", False),
])
def test_is_figure(text, figure):
    from docfuse.stages.pdf_tables import is_figure

    assert is_figure(text) is figure


def test_markdown_escapes_pipes_and_pads_rows():
    assert to_markdown([["a|b", "c"], ["d"]]) == "| a\\|b | c |\n| --- | --- |\n| d |  |"


def test_params_are_validated():
    with pytest.raises(ValidationError):
        PdfText(tables="sometimes")
    with pytest.raises(ValidationError):
        PdfText(colour=True)
    with pytest.raises(ValidationError):
        PdfRender(max_pixels=10**12)


# --- batches and failures -------------------------------------------------------------------------------

def test_text_and_render_turn_bad_documents_into_error_rows(fx):
    docs = opened(fx["born_digital"])
    bad = pa.Table.from_pylist([
        {"doc_id": "junk", "source": "junk.pdf", "pdf": b"not a pdf at all", "n_pages": 1},
        {"doc_id": "none", "source": "none.pdf", "pdf": None, "n_pages": None},
        {"doc_id": "locked", "source": "locked.pdf", "pdf": fx["encrypted"].read_bytes(), "n_pages": 2},
    ], schema=schemas.PDF_DOC)
    batch = pa.concat_tables([bad, docs])
    for stage in (PdfText(), PdfRender(dpi=20)):
        rows = by_doc(stage.run(batch))
        assert kind(rows["junk"][0]["error"]) == "corrupt"
        assert kind(rows["none"][0]["error"]) == "empty_file"
        assert kind(rows["locked"][0]["error"]) == "encrypted"
        assert [r["error"] for r in rows["id-born_digital.pdf"]] == [None, None, None]


def test_a_failing_page_is_an_error_row_and_the_other_pages_are_fine(fx, monkeypatch):
    import docfuse.stages.pdf as pdf_stage

    real = pdf_stage.extract_page

    def flaky(page, *args, **kwargs):
        if page.number == 1:
            raise RuntimeError("synthetic MuPDF failure")
        return real(page, *args, **kwargs)

    monkeypatch.setattr(pdf_stage, "extract_page", flaky)
    rows = PdfText().run(opened(fx["born_digital"])).to_pylist()
    assert [r["page"] for r in rows] == [0, 1, 2]
    assert [kind(r["error"]) for r in rows] == [None, "page_unreadable", None]
    assert "synthetic MuPDF failure" in rows[1]["error"] and rows[1]["text"] is None
    assert "Chapter 3" in rows[2]["text"]


# --- pdf.render ---------------------------------------------------------------------------------------

def test_render_at_the_requested_dpi(fx):
    out = PdfRender(dpi=36).run(opened(fx["born_digital"]))
    assert out.schema == schemas.PAGE_IMAGE
    rows = out.to_pylist()
    assert [r["page"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["error"] is None and r["dpi"] == 36
        assert (r["width_px"], r["height_px"]) == (306, 396)
        assert r["image"][:8] == b"\x89PNG\r\n\x1a\n"
        pix = pymupdf.Pixmap(r["image"])
        assert (pix.width, pix.height) == (306, 396)


def test_render_lowers_dpi_to_fit_the_pixel_budget(fx):
    row = PdfRender(dpi=96, max_pixels=50_000).run(opened(fx["two_column"])).to_pylist()[0]
    assert row["error"] is None
    assert 9 <= row["dpi"] < 96
    assert row["width_px"] * row["height_px"] <= 50_000
    assert row["width_px"] * row["height_px"] > 0.9 * 50_000      # it uses the budget, not a crude fraction
    pix = pymupdf.Pixmap(row["image"])
    assert (pix.width, pix.height) == (row["width_px"], row["height_px"])


def test_page_too_large_is_an_error_row_for_that_page_only(fx):
    rows = PdfRender(dpi=20).run(opened(fx["huge_page"])).to_pylist()
    assert rows[0]["error"] is None and rows[0]["image"]
    assert kind(rows[1]["error"]) == "page_too_large"
    assert rows[1]["page"] == 1 and rows[1]["image"] is None
    assert (rows[1]["page_width"], rows[1]["page_height"]) == (18000.0, 36000.0)
    assert "max_pixels" in rows[1]["error"] and "10,125,000" in rows[1]["error"]


def test_fit_dpi_budget_and_absolute_side_guard():
    assert fit_dpi(612, 792, 96, 4_000_000) == 96
    dpi = fit_dpi(18000, 36000, 96, 4_000_000)
    assert dpi < 9                                       # so the stage refuses it at min_dpi 9
    side = fit_dpi(100, 50_000, 96, 200_000_000)         # a long strip: the side guard binds, not the budget
    assert side < 96 and 50_000 * side / 72 <= MAX_SIDE_PX


# --- the shipped sample -------------------------------------------------------------------------------

def _sample_module():
    spec = importlib.util.spec_from_file_location("make_sample_pdf", ROOT / "data" / "make_sample_pdf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sample_pdf_has_the_facts_layout_and_table(tmp_path):
    path = tmp_path / "sample.pdf"
    path.write_bytes(_sample_module().make_pdf(3))
    rows = page_texts(path, layout=True)
    assert len(rows) == 3 and all(r["error"] is None and not r["image_only"] for r in rows)
    first, second = rows[0]["text"], rows[1]["text"]
    assert "monthly fee of EUR 4,250.00" in first
    assert "| Platform licence | 1 | 4,250.00 | 51,000.00 |" in first
    assert first.count("Platform licence") == 1
    assert first.rstrip().endswith("invoice date.") and first.rindex("¹ All fees") > first.index("| Total |")
    assert "Page 1 of 3" not in first and "Harbor Light Analytics GmbH and Calder" not in first
    assert {b["kind"] for b in rows[0]["blocks"] if b["order"] == -1} == {"header", "footer"}
    order = ["## 4. Service Levels", "### 4.1 Availability", "### 4.2 Backups", "### 4.3 Support",
             "### 4.4 Service credits", "## 5. Data Protection", "## 6. Term and Termination"]
    assert [second.index(h) for h in order] == sorted(second.index(h) for h in order)
    assert "90 days' written notice" in second and "99.5%" in second


def test_sample_variant_has_the_requested_page_count():
    doc = pymupdf.open(stream=_sample_module().make_pdf(10), filetype="pdf")
    assert doc.page_count == 10
    assert all(len(page.get_text("words")) > 100 for page in doc)


def test_committed_sample_is_what_the_script_writes():
    committed = pymupdf.open(ROOT / "data" / "sample.pdf")
    fresh = pymupdf.open(stream=_sample_module().make_pdf(3), filetype="pdf")
    assert committed.page_count == 3 and "EUR 4,250.00" in committed[0].get_text()
    assert [p.get_text() for p in committed] == [p.get_text() for p in fresh]


# --- the shared corpus (skipped when absent) ------------------------------------------------------------

corpus = pytest.mark.skipif(not CORPUS.is_dir(), reason="../shared/corpus is not here")

#: Passwords from the corpus README; "asdfzxcv" unless noted.
PASSWORDS = {"r6-both-passwords.pdf": "foo", "libreoffice-writer-password.pdf": "openpassword",
             "password-example.pdf": "test"}


@corpus
@pytest.mark.corpus
def test_every_corpus_pdf_gives_rows_never_an_exception():
    paths = sorted(CORPUS.glob("*/*.pdf"))
    docs = PdfOpen(password="asdfzxcv").run(sources(*paths))
    assert docs.num_rows == len(paths)
    fine = good(docs)
    text = PdfText().run(fine)
    image = PdfRender(dpi=24).run(fine)
    n_pages = sum(fine["n_pages"].to_pylist())
    assert text.num_rows == n_pages and image.num_rows == n_pages
    errors = {r["doc_id"].removeprefix("id-"): kind(r["error"]) for r in docs.to_pylist() if r["error"]}
    assert errors.get("empty.pdf") == "empty_file"
    assert errors.get("invalid.pdf") == "no_pages"
    assert set(errors) - {"empty.pdf", "invalid.pdf"} <= set(PASSWORDS)


@corpus
@pytest.mark.corpus
def test_corpus_encrypted_files_open_with_their_passwords():
    for path in sorted((CORPUS / "encrypted").glob("*.pdf")):
        row = PdfOpen(password=PASSWORDS.get(path.name, "asdfzxcv")).run(sources(path)).to_pylist()[0]
        assert row["error"] is None, (path.name, row["error"])
        doc = pymupdf.open(stream=row["pdf"], filetype="pdf")
        assert not doc.needs_pass and doc.page_count == row["n_pages"]


@corpus
@pytest.mark.corpus
def test_corpus_born_digital_matches_the_expected_extraction():
    expected = (CORPUS / "born_digital" / "crazyones.txt").read_text()
    got = page_texts(CORPUS / "born_digital" / "crazyones.pdf")[0]["text"]

    def words(s: str) -> list[str]:
        s = s.replace("\ufb01", "fi").replace("\ufb00", "ff").replace("#", " ")
        return re.findall(r"\w+", s.lower())

    want, have = words(expected), words(got)
    assert have[:4] == ["the", "crazy", "ones", "october"]
    common = sum(min(want.count(w), have.count(w)) for w in set(want))
    assert common / len(want) >= 0.97 and len(have) <= 1.03 * len(want)


DOCQA = ROOT.parent / "shared" / "corpus" / "docqa" / "mmlongbench_doc" / "documents"


@pytest.mark.skipif(not DOCQA.is_dir(), reason="../shared/corpus/docqa is not here")
@pytest.mark.corpus
def test_corpus_statements_become_tables_and_prose_does_not():
    def tables_per_page(path: Path) -> list[int]:
        return [len(_tables_in(r["text"] or "")) for r in page_texts(path)]

    report = tables_per_page(DOCQA / "Independents-Report.pdf")      # a survey report: prose and charts
    assert [n for n, k in enumerate(report) if k] == [21]
    for path in sorted((CORPUS / "born_digital").glob("*.pdf")):
        if "lorem" not in path.name:                                    # the lorem-ipsum file holds tables
            assert sum(tables_per_page(path)) == 0, path.name
    tenk = tables_per_page(DOCQA / "NETFLIX_2015_10K.pdf")             # a 10-K: unruled statements
    assert tenk[16] == 3 and tenk[23] == 2 and tenk[60] == 4 and sum(k > 0 for k in tenk) >= 35


@corpus
@pytest.mark.corpus
def test_corpus_scans_and_unmapped_fonts_are_image_only_and_the_poster_too_large():
    scans = sorted((CORPUS / "scanned").glob("*.pdf"))
    unmapped = [CORPUS / "malformed" / n for n in ("truetype_font_nomapping.pdf", "type3_font_nomapping.pdf")]
    rows = PdfText(ocr="never").run(opened(*scans, *unmapped)).to_pylist()
    assert rows and all(r["image_only"] and r["text"] == "" and r["error"] is None for r in rows)
    poster = PdfRender().run(opened(CORPUS / "malformed" / "poster.pdf")).to_pylist()[0]
    assert kind(poster["error"]) == "page_too_large"
