"""Write data/sample.pdf: a short, made-up service contract that exercises every part of pdf.text.

It has headings of three sizes, a two-column section, a footnote, a ruled table of fees, running headers and
page numbers, and plain facts to ask about ("What is the monthly fee?" -> EUR 4,250.00; "How long is the
notice period?" -> 90 days; "What uptime is guaranteed?" -> 99.5%). Every name, number and clause is invented.

    python data/make_sample_pdf.py                           # data/sample.pdf, 3 pages
    python data/make_sample_pdf.py --pages 10 --out X.pdf    # a 10-page variant for benchmarks

The variant adds schedules (service credits, data processing, change requests, ...) until it fills the page
count, cycling through clause templates with varying figures; it is deterministic.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pymupdf

WIDTH, HEIGHT = 612.0, 792.0
LEFT, RIGHT, TOP, BOTTOM = 72.0, 540.0, 80.0, 700.0
BODY, H1, H2, H3, SMALL = 10.0, 20.0, 14.0, 11.5, 7.5

PROVIDER = "Harbor Light Analytics GmbH"
CLIENT = "Calder & Finch Logistics Ltd."
TITLE = "Master Services Agreement"

FEES = [
    ["Item", "Quantity", "Monthly fee (EUR)", "Annual total (EUR)"],
    ["Platform licence", "1", "4,250.00", "51,000.00"],
    ["Premium support", "1", "1,100.00", "13,200.00"],
    ["Additional storage (per TB)", "6", "510.00", "6,120.00"],
    ["Dedicated training days", "2", "300.00", "3,600.00"],
    ["Total", "", "6,160.00", "73,920.00"],
]


class Writer:
    """Flows headings, paragraphs, tables and column sections down pages, starting a new page when needed."""

    def __init__(self, max_pages: int | None = None) -> None:
        self.doc = pymupdf.open()
        self.scratch = pymupdf.open()
        self.max_pages = max_pages
        self.page: pymupdf.Page | None = None
        self.y = TOP
        self.new_page()

    def new_page(self) -> None:
        self.page = self.doc.new_page(width=WIDTH, height=HEIGHT)
        self.y = TOP

    def height(self, text: str, width: float, size: float, font: str) -> float:
        page = self.scratch.new_page(width=WIDTH, height=HEIGHT * 4)
        rect = pymupdf.Rect(0, 0, width, HEIGHT * 4)
        left = page.insert_textbox(rect, text, fontsize=size, fontname=font)
        self.scratch.delete_page(-1)
        return rect.height - left

    def fits(self, h: float) -> bool:
        return self.y + h <= BOTTOM

    def ensure(self, h: float) -> bool:
        """Make room for ``h`` points, on a new page if need be; False when that page would exceed max_pages."""
        if self.fits(h):
            return True
        if self.max_pages is not None and self.doc.page_count >= self.max_pages:
            return False
        self.new_page()
        return True

    def text(self, text: str, size: float = BODY, font: str = "helv", before: float = 6.0,
             x0: float = LEFT, x1: float = RIGHT, keep_with: float = 0.0) -> bool:
        h = self.height(text, x1 - x0, size, font)
        if not self.ensure(before + h + keep_with):
            return False
        self.y += before
        self.page.insert_textbox(pymupdf.Rect(x0, self.y, x1, self.y + h + 1), text, fontsize=size, fontname=font)
        self.y += h
        return True

    def heading(self, text: str, level: int) -> bool:
        size = {1: H1, 2: H2, 3: H3}[level]
        return self.text(text, size=size, font="hebo", before=14.0 if level < 3 else 8.0, keep_with=40.0)

    def table(self, rows: list[list[str]], widths: list[float]) -> bool:
        row_h = 18.0
        h = row_h * len(rows) + 12
        if not self.ensure(h):
            return False
        self.y += 10
        xs = [LEFT]
        for w in widths:
            xs.append(xs[-1] + w)
        for r, row in enumerate(rows):
            top = self.y + r * row_h
            bold = r == 0 or row[0] == "Total"
            for c, cell in enumerate(row):
                font = "hebo" if bold else "helv"
                x = xs[c] + 4 if c == 0 else xs[c + 1] - 4 - pymupdf.get_text_length(cell, font, 9)
                self.page.insert_text((x, top + 13), cell, fontsize=9, fontname=font)
        bottom = self.y + row_h * len(rows)
        for r in range(len(rows) + 1):
            self.page.draw_line((xs[0], self.y + r * row_h), (xs[-1], self.y + r * row_h), width=0.6)
        for x in xs:
            self.page.draw_line((x, self.y), (x, bottom), width=0.6)
        self.y = bottom + 2
        return True

    def columns(self, left: list[tuple[str, str]], right: list[tuple[str, str]], gap: float = 24.0) -> bool:
        """Two columns of (sub-heading, paragraph) pairs, side by side from the current y."""
        mid = (LEFT + RIGHT) / 2
        spans = [(LEFT, mid - gap / 2), (mid + gap / 2, RIGHT)]
        heights = []
        for items, (x0, x1) in zip((left, right), spans):
            heights.append(sum(8 + self.height(h, x1 - x0, H3, "hebo") + 4 + self.height(p, x1 - x0, BODY, "helv")
                               for h, p in items))
        if not self.ensure(max(heights) + 6):
            return False
        top = self.y + 6
        for items, (x0, x1) in zip((left, right), spans):
            y = top
            for head, para in items:
                for text, size, font, before in ((head, H3, "hebo", 8.0), (para, BODY, "helv", 4.0)):
                    y += before
                    h = self.height(text, x1 - x0, size, font)
                    self.page.insert_textbox(pymupdf.Rect(x0, y, x1, y + h + 1), text, fontsize=size, fontname=font)
                    y += h
        self.y = top + max(heights)
        return True

    def footnote(self, text: str) -> None:
        """A note at the foot of the current page, under a short rule."""
        h = self.height(text, RIGHT - LEFT, SMALL, "helv")
        self.page.draw_line((LEFT, BOTTOM + 8), (LEFT + 120, BOTTOM + 8), width=0.5)
        self.page.insert_textbox(pymupdf.Rect(LEFT, BOTTOM + 12, RIGHT, BOTTOM + 14 + h), text,
                                 fontsize=SMALL, fontname="helv")

    def finish(self) -> bytes:
        """Running header and "Page N of M" on every page, then the PDF's bytes."""
        n = self.doc.page_count
        for i, page in enumerate(self.doc):
            page.insert_text((LEFT, 44), f"{TITLE} | {PROVIDER} and {CLIENT}", fontsize=8, fontname="helv")
            page.insert_text((WIDTH / 2 - 22, 760), f"Page {i + 1} of {n}", fontsize=8, fontname="helv")
        stamp = "D:20250203090000+00'00'"      # fixed dates and no random /ID: the same bytes on every run
        self.doc.set_metadata({"title": TITLE, "author": PROVIDER, "subject": "Sample document for docfuse",
                               "creator": "docfuse data/make_sample_pdf.py", "producer": "PyMuPDF",
                               "creationDate": stamp, "modDate": stamp})
        data = self.doc.tobytes(garbage=3, deflate=True, no_new_id=True)
        self.scratch.close()
        self.doc.close()
        return data


def contract(w: Writer) -> None:
    """The three pages of the contract itself."""
    w.heading(TITLE, 1)
    w.text(f"This Master Services Agreement (the \"Agreement\") is made on 3 February 2025 between {PROVIDER}, "
           f"Speicherstrasse 14, 20457 Hamburg, Germany (the \"Provider\"), and {CLIENT}, 42 Quayside Road, "
           "Bristol BS1 4RN, United Kingdom (the \"Client\"). It takes effect on 1 March 2025 (the \"Effective "
           "Date\").")
    w.heading("1. Definitions", 2)
    w.text("\"Services\" means the route-analytics platform, the support and the training described in this "
           "Agreement. \"Business Day\" means a day other than a Saturday, a Sunday or a public holiday in "
           "Hamburg. \"Client Data\" means all data that the Client or its users upload to the platform.")
    w.text("Headings are for convenience only. Words in the singular include the plural and the other way "
           "round. A reference to a clause is a reference to a clause of this Agreement.")
    w.heading("2. Services", 2)
    w.text("The Provider shall make the platform available to up to 250 named users of the Client, host it in "
           "data centres located in the European Union, and keep Client Data logically separated from the data "
           "of other customers. The Provider shall deliver two training days per year at the Client's Bristol "
           "office, on dates agreed in writing at least 15 Business Days in advance.")
    w.text("The Client shall appoint a contract manager, currently Ms Priya Raman, who is the Provider's main "
           "point of contact for all matters under this Agreement.")
    w.heading("3. Fees and Payment", 2)
    w.text("In return for the Services the Client shall pay the Provider a monthly fee of EUR 4,250.00 for the "
           "platform licence, together with the other charges set out in the table below.\u00b9 Invoices are "
           "issued on the first Business Day of each month and are payable within 30 days of the invoice date.")
    w.table(FEES, [180, 70, 109, 109])
    w.text("Late payments bear interest at 4 percentage points above the base rate of the European Central "
           "Bank. Fees are fixed for the first 12 months and may then rise by no more than 3% a year.")
    w.footnote("\u00b9 All fees exclude value added tax, which the Provider charges at the rate in force on the "
               "invoice date.")
    w.new_page()
    w.heading("4. Service Levels", 2)
    w.text("The service levels below apply from the Effective Date. Each is measured over a calendar month.")
    w.columns(
        [("4.1 Availability", "The Provider guarantees a monthly uptime of 99.5% for the platform, excluding "
          "planned maintenance announced at least five Business Days ahead and carried out on Sundays between "
          "02:00 and 06:00 CET."),
         ("4.2 Backups", "Client Data is backed up every 24 hours and kept for 35 days. A restore is started "
          "within 8 hours of the Client's written request.")],
        [("4.3 Support", "Support is available on Business Days from 08:00 to 18:00 CET by telephone and e-mail. "
          "The Provider responds to critical incidents within 4 business hours and to all others within one "
          "Business Day."),
         ("4.4 Service credits", "If uptime falls below 99.5% in a month, the Client receives a credit of 5% "
          "of that month's fees for each started 0.5% below the target, capped at 25%.")])
    w.heading("5. Data Protection", 2)
    w.text("The Provider processes personal data only on the Client's documented instructions and under the "
           "data processing terms in Schedule B. It notifies the Client of a personal data breach without undue "
           "delay and in any case within 48 hours of becoming aware of it.")
    w.heading("6. Term and Termination", 2)
    w.text("This Agreement runs for an initial term of 24 months from the Effective Date and then renews "
           "automatically for successive periods of 12 months. Either party may terminate it at the end of the "
           "initial term or of any renewal period by giving at least 90 days' written notice.")
    w.text("Either party may terminate this Agreement with immediate effect if the other commits a material "
           "breach that it fails to remedy within 30 days of being asked in writing to do so.")
    w.new_page()
    w.heading("7. Liability", 2)
    w.text("Each party's total liability under this Agreement in any contract year is limited to the fees paid "
           "or payable in the 12 months before the event giving rise to the claim. Neither party is liable for "
           "loss of profit, loss of revenue or indirect loss. Nothing limits liability for death, personal "
           "injury or fraud.")
    w.heading("8. Confidentiality", 2)
    w.text("Each party keeps the other's confidential information secret during this Agreement and for five "
           "years after it ends, and uses it only to perform this Agreement.")
    w.heading("9. Governing Law", 2)
    w.text("This Agreement is governed by the laws of Ireland. The courts of Dublin have exclusive jurisdiction "
           "over any dispute arising out of or in connection with it.")
    w.heading("10. Signatures", 2)
    w.text(f"Signed for {PROVIDER} by Jonas Albrecht, Managing Director, on 3 February 2025.")
    w.text(f"Signed for {CLIENT} by Eleanor Finch, Chief Operating Officer, on 3 February 2025.")


SCHEDULE_TOPICS = [
    ("Service Credits", "service credit", "uptime"),
    ("Data Processing Terms", "processing activity", "sub-processor"),
    ("Change Requests", "change request", "impact assessment"),
    ("Security Measures", "security control", "penetration test"),
    ("Exit Assistance", "exit task", "data export"),
    ("Reporting", "monthly report", "key performance indicator"),
]


def schedules(w: Writer) -> None:
    """Schedules A, B, ... with numbered clauses and, in some, a table, until the page budget is used up."""
    n = 0
    while True:
        title, thing, other = SCHEDULE_TOPICS[n % len(SCHEDULE_TOPICS)]
        letter = chr(ord("A") + n)
        if not w.heading(f"Schedule {letter}: {title}", 2):
            return
        for k in range(1, 7):
            days = 5 + (n * 7 + k * 3) % 25
            pct = 1 + (n + k) % 9
            if k == 1:
                ok = w.heading(f"{letter}.{k} Scope", 3)
            else:
                ok = True
            ok = ok and w.text(
                f"{letter}.{k} Each {thing} under this Schedule is recorded in the shared register within {days} "
                f"Business Days. The Provider reviews every {other} at least once per quarter and reports any "
                f"deviation above {pct}% to the Client's contract manager, together with a remediation plan and "
                f"a target date agreed with the Client.")
            if not ok:
                return
        if n % 2 == 0:
            rows = [["Level", "Threshold", "Credit (%)", "Review (days)"]]
            rows += [[f"Level {i}", f"{99.9 - i * 0.2:.1f}%", f"{i * 5}", f"{10 + i * 5}"] for i in range(1, 5)]
            if not w.table(rows, [150, 110, 104, 104]):
                return
        n += 1


def make_pdf(pages: int = 3) -> bytes:
    if pages < 3:
        raise ValueError("the sample needs at least 3 pages")
    w = Writer(max_pages=pages)
    contract(w)
    if pages > 3:
        w.new_page()
        schedules(w)
    return w.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=3, help="page count (at least 3)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("sample.pdf"))
    args = parser.parse_args()
    data = make_pdf(args.pages)
    args.out.write_bytes(data)
    print(f"wrote {args.out} ({len(data):,} bytes, {args.pages} pages)")


if __name__ == "__main__":
    main()
