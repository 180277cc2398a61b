"""OCR of pages without a text layer (pdf.text ``ocr:``): Tesseract's words as a text-layer page, error rows when the
engine is missing, born-digital pages left alone.

Tests that run Tesseract skip when it is not installed (the Makefile installs it); the TSV parsing and the missing-
engine paths run everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pymupdf
import pytest

from docfuse.stages import pdf_ocr
from docfuse.stages.pdf import PdfOpen, PdfText
from tests.test_pdf_stages import sources

needs_tesseract = pytest.mark.skipif(not pdf_ocr.available(), reason="tesseract is not installed (make setup)")

LINES = ["Invoice 4471 from Harbor Freight Systems", "The monthly fee is 4,250 euros, due on the first day.",
         "Payment goes to account 88-1902 at North Bank.", "Disputes are settled in Rotterdam."]


def _scan(folder: Path, name: str, rotate_image: int = 0, page_rotation: int = 0, pages: int = 1,
          born_digital_first: bool = False) -> Path:
    """An image-only PDF of LINES (rendered at 150 dpi); the image turned ``rotate_image`` degrees clockwise (text
    baked in sideways or upside down), the page given /Rotate ``page_rotation``."""
    doc = pymupdf.open()
    if born_digital_first:
        page = doc.new_page(width=612, height=792)
        page.insert_text((72, 100), "Born digital cover page with a real text layer.", fontsize=12)
    page = _source_page()
    pix = page.get_pixmap(dpi=150, matrix=None) if not rotate_image else page.get_pixmap(
        matrix=pymupdf.Matrix(150 / 72, 150 / 72).prerotate(rotate_image))
    for _ in range(pages):
        w, h = (792, 612) if rotate_image in (90, 270) else (612, 792)
        out = doc.new_page(width=w, height=h)
        out.insert_image(out.rect, pixmap=pix)
        if page_rotation:
            out.set_rotation(page_rotation)
    path = folder / f"{name}.pdf"
    doc.save(path)
    return path


def _source_page() -> pymupdf.Page:
    """The born-digital page the scans are made from."""
    page = pymupdf.open().new_page(width=612, height=792)
    for i, line in enumerate(LINES):
        page.insert_text((72, 120 + 28 * i), line, fontsize=14)
    return page


def _as_scan(page: pymupdf.Page, dpi: int, path: Path) -> Path:
    """A one-page image-only PDF of ``page`` rendered at ``dpi``, the same size as the page."""
    scan = pymupdf.open()
    out = scan.new_page(width=page.rect.width, height=page.rect.height)
    out.insert_image(out.rect, pixmap=page.get_pixmap(dpi=dpi))
    scan.save(path)
    return path


def texts(path: Path, **params) -> list[dict]:
    return PdfText(**params).run(_opened(path)).to_pylist()


def _opened(path: Path):
    return PdfOpen().run(sources(path))


def _words(text: str) -> set[str]:
    return {w.strip(".,#").lower() for w in text.split() if w.strip(".,#")}


def test_tsv_becomes_words_lines_and_blocks_in_page_points() -> None:
    """No Tesseract needed: its TSV (pixels at 144 dpi) turns into words in points, grouped by block and line."""
    head = "level\tpage_num\tblock_num\tpar_num\tline_num\tword_num\tleft\ttop\twidth\theight\tconf\ttext"
    rows = [head, "1\t1\t0\t0\t0\t0\t0\t0\t1224\t1584\t-1\t",
            "4\t1\t1\t1\t1\t0\t144\t144\t400\t40\t-1\t",
            "5\t1\t1\t1\t1\t1\t144\t144\t200\t40\t96.5\tMonthly",
            "5\t1\t1\t1\t1\t2\t360\t146\t180\t38\t90.5\tfee",
            "4\t1\t2\t1\t1\t0\t144\t400\t300\t30\t-1\t",
            "5\t1\t2\t1\t1\t1\t144\t400\t300\t30\t50\t4,250",
            "5\t1\t2\t1\t1\t2\t0\t0\t0\t0\t-1\t "]
    result = pdf_ocr.parse_tsv("\n".join(rows), 0, 612.0, 792.0, 144.0)
    content = result.content
    assert content.usable and [len(b) for b in content.blocks] == [1, 1]
    first = content.blocks[0][0].words[0]
    assert (first.text, first.x0, first.y0, first.x1, first.y1) == ("Monthly", 72.0, 72.0, 172.0, 92.0)
    assert first.size == 20.0  # the line's height in points stands in for the font size
    assert [w.text for w in content.words] == ["Monthly", "fee", "4,250"]
    assert result.confidence == pytest.approx((0.965 + 0.905 + 0.50) / 3)
    empty = pdf_ocr.parse_tsv(head, 3, 612.0, 792.0, 300.0)
    assert not empty.content.usable and empty.confidence is None and "no words" in empty.content.reason


def test_missing_engine_is_an_error_row_naming_the_install_step_and_the_text_pages_survive(tmp_path, monkeypatch):
    path = _scan(tmp_path, "mixed", born_digital_first=True)
    pdf_ocr._binary.cache_clear()
    pdf_ocr.installed_languages.cache_clear()
    monkeypatch.setattr(pdf_ocr.shutil, "which", lambda name: None)
    try:
        rows = texts(path)
    finally:
        pdf_ocr._binary.cache_clear()
        pdf_ocr.installed_languages.cache_clear()
    assert rows[0]["error"] is None and rows[0]["text_source"] == "layer" and "Born digital" in rows[0]["text"]
    assert rows[1]["error"].startswith("ocr_unavailable:") and "apt-get install tesseract-ocr" in rows[1]["error"]
    assert "ocr: never" in rows[1]["error"]
    off = texts(path, ocr="never")  # the documented way out: scans stay empty, no error
    assert off[1]["error"] is None and off[1]["text"] == "" and off[1]["text_source"] == "none"


@needs_tesseract
def test_scanned_page_reads_like_a_text_layer_and_born_digital_pages_are_left_alone(tmp_path):
    path = _scan(tmp_path, "scan", born_digital_first=True)
    stage = PdfText(layout=True)
    rows = stage.run(_opened(path)).to_pylist()
    cover, scan = rows
    assert cover["text_source"] == "layer" and cover["ocr_confidence"] is None and not cover["image_only"]
    assert stage.stats["ocr_pages"] == 1  # auto: only the page without a text layer
    assert scan["error"] is None and scan["image_only"] and scan["text_source"] == "ocr"
    assert scan["ocr_confidence"] > 0.8
    truth = _words(" ".join(LINES))
    assert len(truth & _words(scan["text"])) >= 0.9 * len(truth), scan["text"]
    assert scan["text"].index("Invoice") < scan["text"].index("Rotterdam")  # reading order
    fee = next(w for w in scan["words"] if w["text"].startswith("4,250"))
    truth = _source_page().search_for("4,250")[0]  # where the text layer had it, in PDF points
    # MuPDF's box runs from the ascender, OCR's from the ink: a few points apart at 14 pt
    assert abs(fee["x0"] - truth.x0) < 4 and abs(fee["y0"] - truth.y0) < 7 and abs(fee["y1"] - truth.y1) < 4
    always = PdfText(ocr="always").run(_opened(path)).to_pylist()
    assert always[0]["text_source"] == "ocr" and "Born" in always[0]["text"]


@needs_tesseract
@pytest.mark.parametrize("turned", [90, 180, 270])
def test_text_baked_in_turned_is_read_upright(tmp_path, turned):
    rows = texts(_scan(tmp_path, f"turned{turned}", rotate_image=turned))
    row = rows[0]
    assert row["error"] is None and row["text_source"] == "ocr" and row["ocr_confidence"] > 0.8, row
    assert row["text"].index("Invoice") < row["text"].index("Rotterdam")
    assert "4,250" in row["text"]


@needs_tesseract
def test_page_rotate_entry_is_read_as_shown(tmp_path):
    row = texts(_scan(tmp_path, "rot", page_rotation=90, rotate_image=270))[0]
    assert row["error"] is None and row["text_source"] == "ocr" and "Rotterdam" in row["text"]


@needs_tesseract
def test_missing_language_names_its_package(tmp_path):
    row = texts(_scan(tmp_path, "scan"), languages=["xyz"])[0]
    assert row["error"].startswith("ocr_unavailable:") and "tesseract-ocr-xyz" in row["error"]


@needs_tesseract
def test_huge_page_is_read_within_the_pixel_cap(tmp_path):
    doc = pymupdf.open()
    page = doc.new_page(width=14400, height=14400)  # 200 x 200 inches: 1.9 billion pixels at 300 dpi
    page.insert_text((720, 2000), "Poster headline in large type", fontsize=400)
    path = _as_scan(page, 6, tmp_path / "poster.pdf")
    row = texts(path, ocr_max_pixels=4_000_000)[0]
    assert row["error"] is None or row["error"].startswith("page_too_large:")


@needs_tesseract
@pytest.mark.slow
def test_ask_answers_from_a_scan_of_the_sample(tmp_path):
    """QA over scans: the sample contract printed to images (150 dpi, no text layer) answers as the original does."""
    from tests.test_e2e import ROOT, docfuse

    src = pymupdf.open(ROOT / "data" / "sample.pdf")
    scan = pymupdf.open()
    for page in src:
        out = scan.new_page(width=page.rect.width, height=page.rect.height)
        out.insert_image(out.rect, pixmap=page.get_pixmap(dpi=150))
    path = tmp_path / "sample_scan.pdf"
    scan.save(path)
    assert not pymupdf.open(path)[0].get_text().strip()
    # float32: in bf16 the 135M model's greedy answer over this OCR text says "42.50 Euros" since the scan's fee
    # table reads as a Markdown table (as the original's does); float32 answers the fee from the same prompt
    # (bf16 answers flipping on small prompt changes: issue 29's open question)
    res = docfuse("ask", str(path), "What is the monthly fee?", "--no-cache", "--set", "answer.dtype=float32")
    assert res.returncode == 0, res.stderr
    assert "4250" in res.stdout.replace(",", ""), res.stdout  # the fee (the model may drop the thousands comma)
    assert "| Platform licence | 1 | 4,250.00 | 51,000.00 |" in texts(path)[0]["text"]  # the table, as a table


@needs_tesseract
def test_skewed_scan_is_measured_and_read_straight():
    """A scan turned 3 degrees: the skew is estimated from the lines (within half a degree), and the kept reading
    has every line's words with their boxes where the skewed image shows them."""
    import io

    from PIL import Image

    page = _source_page()
    image = Image.open(io.BytesIO(page.get_pixmap(dpi=300).tobytes("png"))).convert("L")
    out = io.BytesIO()
    image.rotate(3, resample=Image.BICUBIC, fillcolor=255).save(out, format="PNG")
    png = out.getvalue()
    first = pdf_ocr.parse_tsv(pdf_ocr.run_tesseract(png, 300, "eng"), 0, 612.0, 792.0, 300)
    assert abs(pdf_ocr.skew_degrees(first.content) + 3) < 0.5
    kept = pdf_ocr.read_page(png, 300, "eng", 0, 612.0, 792.0)
    assert kept.skew == pytest.approx(pdf_ocr.skew_degrees(first.content))  # the straightened reading won
    truth = _words(" ".join(LINES))
    assert len(truth & _words(" ".join(w.text for w in kept.content.words))) >= 0.9 * len(truth)
    where = {w.text: (w.cx, w.cy) for w in first.content.words}
    for w in kept.content.words:  # the same word sits at the same place in either reading (page as shown)
        if w.text in where:
            assert abs(w.cx - where[w.text][0]) < 5 and abs(w.cy - where[w.text][1]) < 5, w


@needs_tesseract
def test_a_page_that_cannot_be_rendered_for_ocr_is_an_error_row_and_the_others_are_read(tmp_path, monkeypatch):
    path = _scan(tmp_path, "two", pages=2)
    real = pdf_ocr.render_for_ocr

    def flaky(page, dpi):
        if page.number == 0:
            raise RuntimeError("cannot render")
        return real(page, dpi)

    monkeypatch.setattr(pdf_ocr, "render_for_ocr", flaky)
    rows = texts(path)
    assert rows[0]["error"].startswith("ocr_failed:") and "cannot render" in rows[0]["error"]
    assert rows[1]["error"] is None and rows[1]["text_source"] == "ocr" and "Rotterdam" in rows[1]["text"]


@needs_tesseract
def test_a_scanned_table_comes_out_as_a_markdown_table(tmp_path):
    """A scan has no drawings to follow, but its words line up in rows and columns: the OCR'd page gets the same
    Markdown table a text layer would."""
    source = pymupdf.open()
    page = source.new_page(width=612, height=792)
    page.insert_text((72, 90), "Quarterly sales by region", fontsize=14)
    rows = [("Region", "Units", "Revenue", "Margin"), ("North", "1204", "8100", "12%"), ("South", "980", "6400", "9%"),
            ("East", "1530", "9900", "14%"), ("West", "760", "5200", "7%")]
    for k, row in enumerate(rows):
        for x, value in zip((72, 200, 320, 440), row):
            page.insert_text((x, 130 + 22 * k), value, fontsize=12)
    path = _as_scan(page, 200, tmp_path / "table-scan.pdf")
    row = texts(path)[0]
    assert row["text_source"] == "ocr" and row["error"] is None
    assert "| North | 1204 | 8100 | 12% |" in row["text"], row["text"]
    assert row["text"].index("Quarterly sales") < row["text"].index("| Region")


def test_missing_orientation_data_is_named_once_and_the_page_is_read_as_it_lies(monkeypatch, caplog):
    """Without osd.traineddata the orientation check cannot run: say which package gives it, once, and go on."""
    monkeypatch.setattr(pdf_ocr, "installed_languages", lambda: frozenset({"eng"}))
    pdf_ocr._warn_no_osd.cache_clear()
    with caplog.at_level("WARNING", logger="docfuse.ocr"):
        assert pdf_ocr.osd_rotation(b"not read", 300) == 0
        assert pdf_ocr.osd_rotation(b"not read", 300) == 0
    warnings = [r.getMessage() for r in caplog.records if "osd" in r.getMessage()]
    assert len(warnings) == 1 and "tesseract-ocr-osd" in warnings[0]


@needs_tesseract
@pytest.mark.parametrize("dpi", [200, 212.5])
def test_ocr_dpi_set_by_the_user_or_fitted_to_the_pixel_cap_is_read(tmp_path, dpi):
    """``ocr_dpi`` arrives as a float (pydantic makes 200 into 200.0; the pixel cap fits fractional dpi): the page
    must still render and read, not fail in MuPDF's integer dpi field."""
    row = texts(_scan(tmp_path, "fee"), ocr_dpi=dpi)[0]
    assert row["error"] is None and row["text_source"] == "ocr"
    assert "4,250" in row["text"]
