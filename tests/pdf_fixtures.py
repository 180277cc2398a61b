"""Fixture PDFs for the pdf stages, written by PyMuPDF (or by hand, byte for byte) into a temporary folder.

Each ``write_*`` function takes a folder and returns the path it wrote. The sentences placed on the pages are
module constants so that tests can assert where they end up (reading order, footnotes, tables) without
repeating them.
"""

from __future__ import annotations

from pathlib import Path

import pymupdf

BODY = 10.0
HEADING_SIZES = (20.0, 15.0, 12.5)   # levels 1, 2, 3
FOOTNOTE_SIZE = 7.0

TITLE = "Quarterly Operations Review"
INTRO = ("This review summarises the operating results of the third quarter. "
         "The intro sentence spans the full width of the page above both columns.")
SECTION = "Regional Results"
LEFT_HEADING = "Northern Region"
RIGHT_HEADING = "Southern Region"
LEFT_SENTENCES = [
    "Alpha: the northern warehouses shipped eleven thousand orders in July.",
    "Bravo: the northern returns rate fell to two percent after the new packaging.",
    "Charlie: the northern team hired four drivers for the winter season.",
]
RIGHT_SENTENCES = [
    "Delta: the southern depot opened a second loading dock in August.",
    "Echo: the southern fuel costs rose by six percent over the quarter.",
    "Foxtrot: the southern office moved to a larger building downtown.",
]
OUTRO = "Golf: this closing paragraph spans the full width again and ends the body of the page."
SIDE_NOTE = "Hotel: the southern team also answers calls at weekends."
FOOTNOTE = "1 Footnote: all figures are unaudited and rounded."

TABLE_ROWS = [
    ["Region", "Q1", "Q2", "Total"],
    ["Northwind", "1,200", "1,350", "2,550"],
    ["Southport", "980", "1,010", "1,990"],
    ["Eastvale", "1,430", "1,505", "2,935"],
    ["Westmarch", "760", "820", "1,580"],
]
TABLE_BEFORE = "Revenue by region is shown in the table below, in thousands of euros."
TABLE_AFTER = "Westmarch remains the smallest region but grew steadily across both quarters."

PLAIN_SENTENCE = "Plain page {i}: the quick brown fox jumps over the lazy dog near the river bank."

USER_PASSWORD = "s3cret-user"
OWNER_PASSWORD = "s3cret-owner"


def _box(page: pymupdf.Page, x0: float, y0: float, x1: float, text: str, size: float = BODY,
         font: str = "helv") -> float:
    """Write wrapped ``text`` into a box starting at ``y0``; return the y just below it."""
    rect = pymupdf.Rect(x0, y0, x1, y0 + 400)
    left = page.insert_textbox(rect, text, fontsize=size, fontname=font)
    if left < 0:
        raise ValueError(f"text does not fit: {text[:40]}")
    return rect.y1 - left


def _save(doc: pymupdf.Document, path: Path, **kwargs) -> Path:
    path.write_bytes(doc.tobytes(**kwargs))
    doc.close()
    return path


def plain_pages(n: int) -> pymupdf.Document:
    """``n`` born-digital pages, each with a heading and a few lines of body text."""
    doc = pymupdf.open()
    for i in range(n):
        page = doc.new_page(width=612, height=792)
        y = _box(page, 72, 72, 540, f"Chapter {i + 1}", size=HEADING_SIZES[0], font="hebo")
        for k in range(4):
            y = _box(page, 72, y + 8, 540, PLAIN_SENTENCE.format(i=i + 1) + f" Line {k + 1}.")
    return doc


def write_born_digital(folder: Path, n_pages: int = 3) -> Path:
    return _save(plain_pages(n_pages), folder / "born_digital.pdf", garbage=1)


def draw_two_column_page(page: pymupdf.Page) -> None:
    """Title, a full-width intro, a section heading, two columns with sub-headings, a closing paragraph,
    a footnote and a page number. The pieces are laid out first and then written in a scrambled order
    (footnote first, right column before left, title last), so the content stream's order is no help: a
    reader must use the geometry."""
    scratch = pymupdf.open()
    sp = scratch.new_page(width=page.rect.width, height=page.rect.height)
    ops: list[tuple[float, float, float, str, float, str]] = []

    def box(x0: float, y0: float, x1: float, text: str, size: float = BODY, font: str = "helv") -> float:
        ops.append((x0, y0, x1, text, size, font))
        return _box(sp, x0, y0, x1, text, size, font)

    left, right, gutter = 72.0, 540.0, 24.0
    mid = (left + right) / 2
    y = box(left, 60, right, TITLE, size=HEADING_SIZES[0], font="hebo")
    y = box(left, y + 10, right, INTRO)
    y = box(left, y + 14, right, SECTION, size=HEADING_SIZES[1], font="hebo")
    top = y + 10
    ly = box(left, top, mid - gutter / 2, LEFT_HEADING, size=HEADING_SIZES[2], font="hebo")
    for s in LEFT_SENTENCES:
        ly = box(left, ly + 8, mid - gutter / 2, s)
    ry = box(mid + gutter / 2, top, right, RIGHT_HEADING, size=HEADING_SIZES[2], font="hebo")
    for s in RIGHT_SENTENCES:
        ry = box(mid + gutter / 2, ry + 8, right, s)
    box(left, max(ly, ry) + 16, right, OUTRO)
    # The footnote sits at the foot of the left column, level with a body paragraph in the right one: read
    # column by column it would come before that paragraph; as a footnote it must come last.
    box(left, 706, mid - gutter / 2, FOOTNOTE, size=FOOTNOTE_SIZE)
    box(mid + gutter / 2, 700, right, SIDE_NOTE)
    box(290, 750, 330, "3", size=9)
    scratch.close()
    n_left = 1 + len(LEFT_SENTENCES)
    title, intro, section = ops[:3]
    lefts, rights = ops[3:3 + n_left], ops[3 + n_left:3 + 2 * n_left]
    outro, footnote, side, number = ops[-4:]
    interleaved = [op for pair in zip(reversed(rights), lefts) for op in pair]
    for op in [footnote, number, side, outro, *interleaved, section, intro, title]:
        _box(page, *op)
    page.draw_line((left, 700), (left + 140, 700), width=0.5)


def write_two_column(folder: Path) -> Path:
    doc = pymupdf.open()
    draw_two_column_page(doc.new_page(width=612, height=792))
    return _save(doc, folder / "two_column.pdf", garbage=1)


def draw_table_page(page: pymupdf.Page, ruled: bool = True) -> pymupdf.Rect:
    """A paragraph, a 4x5 table of numbers (with cell borders when ``ruled``), a paragraph; returns the table box."""
    y = _box(page, 72, 72, 540, "Revenue Table", size=HEADING_SIZES[1], font="hebo")
    y = _box(page, 72, y + 10, 540, TABLE_BEFORE)
    col_x = [72.0, 200.0, 300.0, 400.0, 500.0]
    row_h = 20.0
    top = y + 16
    for r, row in enumerate(TABLE_ROWS):
        for c, cell in enumerate(row):
            font = "hebo" if r == 0 else "helv"
            page.insert_text((col_x[c] + 4, top + r * row_h + 14), cell, fontsize=BODY, fontname=font)
    bottom = top + len(TABLE_ROWS) * row_h
    if ruled:
        for r in range(len(TABLE_ROWS) + 1):
            page.draw_line((col_x[0], top + r * row_h), (col_x[-1], top + r * row_h), width=0.6)
        for x in col_x:
            page.draw_line((x, top), (x, bottom), width=0.6)
    _box(page, 72, bottom + 16, 540, TABLE_AFTER)
    return pymupdf.Rect(col_x[0], top, col_x[-1], bottom)


def write_table_doc(folder: Path, ruled: bool = True) -> Path:
    """Page 0: a ruled (or unruled) table; page 1: plain text with no table, to check the gate skips it."""
    doc = pymupdf.open()
    draw_table_page(doc.new_page(width=612, height=792), ruled=ruled)
    page = doc.new_page(width=612, height=792)
    y = 72.0
    for k in range(6):
        y = _box(page, 72, y + 8, 540, PLAIN_SENTENCE.format(i=k + 1))
    return _save(doc, folder / ("ruled_table.pdf" if ruled else "unruled_table.pdf"), garbage=1)


#: An unruled statement of figures: header rows over the value columns, a label column, right-aligned figures
#: with currency signs set apart, a negative in parentheses, a dash, and a label-only row. The invented numbers
#: are this project's own. Each row is (label, values); "" leaves a cell empty.
FIN_HEADER = [["", "", "Year ended December 31,", ""], ["", "2016", "2015", "2014"],
              ["", "", "(in thousands)", ""]]
FIN_ROWS = [
    ["Net sales", "$ 8,412,305", "$ 7,090,112", "$ 5,873,640"],
    ["Operating income (loss)", "(12,840)", "402,118", "-"],
    ["Earnings per share:", "", "", ""],
    ["Basic", "$ 0.31", "$ 0.58", "$ 0.12"],
]
FIN_BEFORE = ("The statement below sums up three years of trading. Net sales grew by 18% in 2016, to $8.4 million "
              "in all, while 2015 brought 402,118 of operating income.")
FIN_AFTER = "Figures for 2014 were restated after the merger of the two trading subsidiaries."
#: A short table under a centred caption (a sentence: it stays text): two data rows, a percentage column.
SHORT_CAPTION = "Table 2. Research costs against net sales."
SHORT_HEADER = ["", "2016", "2015", "Change"]
SHORT_ROWS = [["Research costs", "$ 61,250", "$ 48,900", "25%"], ["As a share of net sales", "9%", "8%", ""]]
CONTENTS = [("Introduction", "1"), ("Scope of the review", "3"), ("Findings by region", "7"),
            ("Recommendations", "12"), ("Appendix: method and sources", "19")]
#: Prose that a table detector could mistake for figures: numbers, years and money inside sentences, a
#: numbered list, and a narrow justified column whose stretched spaces isolate words.
PROSE_WITH_FIGURES = [
    "In 2016 the group sold 8,412,305 units, up 18% from 7,090,112 in 2015; margins held at 9% and the "
    "board proposed a dividend of $0.31 per share, payable on 12 May 2017 to holders of record.",
    "1. Revenue rose in 2016 by 1,250 contracts.   2. Costs fell by (3,400) to 52,100.   3. Staff grew to 1,020.",
]
#: Three narrow justified columns of prose under short headings, with figures in them: stretched spaces set
#: the first line's figure apart, level with the figures of the other columns.
COLUMN_HEADINGS = ["Our people", "Our network", "Our sites"]
JUSTIFIED = [
    "Approximately 2,000 employees work in our ten countries, in 312 depots, and we run 1,480 vans that "
    "met 98.5% of the planned routes in 2016.",
    "Nearly 7,090,112 parcels went through the depots in the year, which is more than the old record set "
    "in 2014, when the network was half of its size.",
    "About 40,000 items an hour can be sorted at the new hub, and the staff of the three sites that closed "
    "in the autumn all moved there.",
]


def _right(page: pymupdf.Page, x1: float, y: float, text: str, size: float = BODY, font: str = "helv") -> None:
    """Write ``text`` with its right edge at ``x1`` (figures in statements are right-aligned)."""
    page.insert_text((x1 - pymupdf.get_text_length(text, fontname=font, fontsize=size), y), text,
                     fontsize=size, fontname=font)


def _figure_row(page: pymupdf.Page, y: float, cells: list[str], ends: list[float], size: float = BODY) -> None:
    """A label at the left margin and figures right-aligned at ``ends``, a currency sign 60 pt left of them."""
    if cells[0]:
        page.insert_text((72, y), cells[0], fontsize=size, fontname="helv")
    for text, x1 in zip(cells[1:], ends):
        if text.startswith("$ "):
            page.insert_text((x1 - 60, y), "$", fontsize=size, fontname="helv")
            text = text[2:]
        if text:
            _right(page, x1, y, text, size)


def draw_financial_page(page: pymupdf.Page) -> None:
    """A paragraph, an unruled statement (FIN_HEADER over FIN_ROWS), a paragraph, a caption and a short
    two-row table."""
    ends = [380.0, 460.0, 540.0]
    y = _box(page, 72, 72, 540, FIN_BEFORE) + 14
    page.insert_text((pymupdf.get_text_length(FIN_HEADER[0][2], "helv", 8) / -2 + 420, y),
                     FIN_HEADER[0][2], fontsize=8, fontname="helv")
    y += 12
    for text, x1 in zip(FIN_HEADER[1][1:], ends):
        _right(page, x1 - 8, y, text, 8, "hebo")
    y += 11
    page.insert_text((420 - pymupdf.get_text_length(FIN_HEADER[2][2], "helv", 8) / 2, y), FIN_HEADER[2][2],
                     fontsize=8, fontname="helv")
    for cells in FIN_ROWS:
        y += 13.5
        _figure_row(page, y, cells, ends)
    y = _box(page, 72, y + 16, 540, FIN_AFTER) + 20
    page.insert_text((420 - pymupdf.get_text_length(SHORT_CAPTION, "helv", 9) / 2, y), SHORT_CAPTION,
                     fontsize=9, fontname="helv")
    y += 13
    for text, x1 in zip(SHORT_HEADER[1:], ends):
        _right(page, x1, y, text, 8, "hebo")
    for cells in SHORT_ROWS:
        y += 13.5
        _figure_row(page, y, cells, ends)


def draw_contents_page(page: pymupdf.Page) -> None:
    _box(page, 72, 72, 540, "Contents", size=HEADING_SIZES[0], font="hebo")
    for k, (title, number) in enumerate(CONTENTS):
        page.insert_text((90, 130 + 20 * k), title, fontsize=BODY, fontname="helv")
        _right(page, 540, 130 + 20 * k, number)


def draw_figure_prose_page(page: pymupdf.Page) -> None:
    """Prose full of figures that must stay prose: see PROSE_WITH_FIGURES and JUSTIFIED."""
    y = 72.0
    for text in PROSE_WITH_FIGURES:
        y = _box(page, 72, y + 8, 540, text)
    for k, (heading, text) in enumerate(zip(COLUMN_HEADINGS, JUSTIFIED)):   # three narrow justified columns
        page.insert_text((72 + 150 * k, y + 28), heading, fontsize=BODY, fontname="hebo")
        rect = pymupdf.Rect(72 + 150 * k, y + 34, 72 + 150 * k + 105, y + 240)
        page.insert_textbox(rect, text, fontsize=BODY, fontname="helv", align=pymupdf.TEXT_ALIGN_JUSTIFY)
    for k, year in enumerate(("2014", "2015", "2016")):   # lines that start with a year in a second column
        page.insert_text((72, y + 270 + 14 * k), f"Notes on the period under review, part {k + 1}.",
                         fontsize=BODY, fontname="helv")
        page.insert_text((320, y + 270 + 14 * k), f"{year} was a year of steady growth for us.",
                         fontsize=BODY, fontname="helv")
    page.insert_text((300, 760), "4", fontsize=9, fontname="helv")


def write_figures_doc(folder: Path) -> Path:
    """Page 0: the unruled statements (draw_financial_page); 1: a contents page; 2: prose full of figures."""
    doc = pymupdf.open()
    draw_financial_page(doc.new_page(width=612, height=792))
    draw_contents_page(doc.new_page(width=612, height=792))
    draw_figure_prose_page(doc.new_page(width=612, height=792))
    return _save(doc, folder / "figures.pdf", garbage=1)


def write_image_only(folder: Path) -> Path:
    """A scan: a text page rendered to pixels and placed as the only content of a page (no text layer)."""
    src = plain_pages(1)
    pix = src[0].get_pixmap(dpi=72)
    src.close()
    doc = pymupdf.open()
    page = doc.new_page(width=612, height=792)
    page.insert_image(page.rect, pixmap=pix)
    return _save(doc, folder / "image_only.pdf", garbage=1, deflate=True)


def write_mixed_scan(folder: Path) -> Path:
    """Page 0 born-digital, page 1 a scan: the text-layer check is per page."""
    doc = plain_pages(1)
    src = plain_pages(1)
    pix = src[0].get_pixmap(dpi=72)
    src.close()
    page = doc.new_page(width=612, height=792)
    page.insert_image(page.rect, pixmap=pix)
    return _save(doc, folder / "mixed_scan.pdf", garbage=1, deflate=True)


def write_encrypted(folder: Path) -> Path:
    """AES-256 with a user password (and a different owner password)."""
    return _save(plain_pages(2), folder / "encrypted.pdf", encryption=pymupdf.PDF_ENCRYPT_AES_256,
                 user_pw=USER_PASSWORD, owner_pw=OWNER_PASSWORD)


def write_empty(folder: Path) -> Path:
    path = folder / "empty.pdf"
    path.write_bytes(b"")
    return path


def write_header_only(folder: Path) -> Path:
    path = folder / "header_only.pdf"
    path.write_bytes(b"%PDF-1.7\n")
    return path


def write_broken_xref(folder: Path) -> Path:
    """A 3-page PDF whose xref table and trailer were cut off: MuPDF rebuilds them by scanning the objects."""
    data = plain_pages(3).tobytes(garbage=1)
    path = folder / "broken_xref.pdf"
    path.write_bytes(data[: data.rfind(b"xref")])
    return path


def write_corrupt(folder: Path) -> Path:
    """Objects whose page tree points back at itself: opens, but no page can be loaded or repaired."""
    path = folder / "corrupt.pdf"
    path.write_bytes(
        b"%PDF-1.7\n1 0 obj\n<< /Type /Catalog /Pages 2 0 R >>\nendobj\n"
        b"2 0 obj\n<< /Type /Pages /Kids [2 0 R] /Count 1 >>\nendobj\ntrailer\n<< /Root 1 0 R >>\n%%EOF\n")
    return path


def write_text_named_pdf(folder: Path) -> Path:
    path = folder / "notes.pdf"
    path.write_text("Meeting notes\n\nThese are plain text notes that someone saved with a .pdf name.\n")
    return path


def write_huge_page(folder: Path) -> Path:
    """Page 0 normal, page 1 18000 x 36000 pt (a poster): too large to render even at 9 dpi under 4 Mpx."""
    doc = pymupdf.open()
    doc.new_page(width=612, height=792).insert_text((72, 72), "A normal first page.", fontsize=BODY)
    big = doc.new_page(width=18000, height=36000)
    big.insert_text((1000, 1000), "A poster page.", fontsize=400)
    return _save(doc, folder / "huge_page.pdf", garbage=1)


def _raw_pdf(objects: list[bytes]) -> bytes:
    """A well-formed PDF from numbered object bodies (object 1 is the catalog), with a correct xref."""
    out = bytearray(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for num, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % num + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for off in offsets:
        out += b"%010d 00000 n \n" % off
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def _stream(content: bytes, extra: bytes = b"") -> bytes:
    return b"<< /Length %d %s>>\nstream\n" % (len(content), extra) + content + b"\nendstream"


def write_type3_no_tounicode(folder: Path) -> Path:
    """A page whose only text uses a Type3 font with made-up glyph names, no /ToUnicode and codes below 32:
    the glyphs draw boxes, but the text layer cannot be mapped to Unicode (what old TeX and some scanners make)."""
    glyph = b"600 0 0 0 500 700 d1\n0 0 500 700 re f"
    words = b"".join(b"BT /F1 18 Tf %d 120 Td (\\001\\002\\003\\004\\002) Tj ET\n" % x for x in (20, 150))
    words += b"".join(b"BT /F1 18 Tf %d 80 Td (\\003\\001\\004\\004) Tj ET\n" % x for x in (20, 150))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 300 200] /Resources << /Font << /F1 4 0 R >> >>"
        b" /Contents 5 0 R >>",
        b"<< /Type /Font /Subtype /Type3 /FontBBox [0 0 600 700] /FontMatrix [0.001 0 0 0.001 0 0]"
        b" /CharProcs 6 0 R /Encoding << /Type /Encoding /Differences [1 /g1 /g2 /g3 /g4] >>"
        b" /FirstChar 1 /LastChar 4 /Widths [600 600 600 600] /Resources << >> >>",
        _stream(words),
        b"<< /g1 7 0 R /g2 7 0 R /g3 7 0 R /g4 7 0 R >>",
        _stream(glyph),
    ]
    path = folder / "type3_no_tounicode.pdf"
    path.write_bytes(_raw_pdf(objects))
    return path


ROTATED_LINES = ["Landscape line one is printed sideways and shown upright.",
                 "Landscape line two follows it on the rotated page."]


def write_rotated(folder: Path) -> Path:
    """A page with /Rotate 90 whose text is drawn sideways, so that viewers (and renders) show it upright in
    landscape, as scanners and spreadsheet exports do."""
    doc = pymupdf.open()
    page = doc.new_page(width=612, height=792)
    for k, line in enumerate(ROTATED_LINES):
        page.insert_text((100 + 20 * k, 700), line, fontsize=BODY, rotate=90)
    page.set_rotation(90)
    return _save(doc, folder / "rotated.pdf", garbage=1)


def write_all(folder: Path) -> dict[str, Path]:
    """Every fixture, by name."""
    return {
        "born_digital": write_born_digital(folder),
        "two_column": write_two_column(folder),
        "ruled_table": write_table_doc(folder, ruled=True),
        "unruled_table": write_table_doc(folder, ruled=False),
        "figures": write_figures_doc(folder),
        "image_only": write_image_only(folder),
        "mixed_scan": write_mixed_scan(folder),
        "encrypted": write_encrypted(folder),
        "empty": write_empty(folder),
        "header_only": write_header_only(folder),
        "broken_xref": write_broken_xref(folder),
        "corrupt": write_corrupt(folder),
        "text_named_pdf": write_text_named_pdf(folder),
        "huge_page": write_huge_page(folder),
        "type3_no_tounicode": write_type3_no_tounicode(folder),
        "rotated": write_rotated(folder),
    }
