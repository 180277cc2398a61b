"""OCR through pdf_extract (issue 25): accuracy where the truth is known, speed, and the corpus's real scans.

    python bench/bench_ocr.py [--out ocr] [--rapidocr]

* Accuracy: born-digital pages of ../shared/corpus rendered to images (150 and 300 dpi; at 300 dpi also with noise
  and blur, a skew of +-3 degrees, and JPEG artefacts), each rebuilt as an image-only PDF and run through
  ``pdf_extract`` as a user runs it (``ocr: auto``); the truth is the same page's text layer through ``pdf_extract``.
  Word error rate (word-level edit distance over the truth's words), an order-free word error (the share of the
  truth's words missing from the OCR's, as multisets: tables read row by row instead of column by column do not
  count), and a character error (the share of the truth's characters outside difflib's matching blocks).
* Speed: pages per second of ``pdf_extract`` over the clean 300-dpi scans on this machine's cores, and
  ``pdf_extract`` on the born-digital originals with ``ocr: auto`` against ``ocr: never`` in the same run (auto must
  leave pages with a text layer alone).
* The corpus's scanned PDFs: pages with text, OCR confidence, and the French scan's accented letters with
  ``languages: [fra]`` against English.
* ``--rapidocr``: the same clean 300-dpi images through RapidOCR (``rapidocr_onnxruntime``, when importable), for
  the engine comparison: order-free word error and seconds a page.
"""

from __future__ import annotations

import argparse
import difflib
import io
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import pymupdf  # noqa: E402

from bench.common import save  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"
#: (file under CORPUS, pages): prose, a report, a 10-K, forms and tables; none of them was tuned on.
PAGES = [("pdf/born_digital/crazyones.pdf", [0]),
         ("docqa/mmlongbench_doc/documents/Independents-Report.pdf", [1, 2, 3]),
         ("docqa/mmlongbench_doc/documents/NETFLIX_2015_10K.pdf", [2, 3, 30]),
         ("docqa/mmlongbench_doc/documents/watch_d.pdf", [0, 1]),
         ("pdf/figures_tables/senate-expenditures.pdf", [0]),
         ("pdf/figures_tables/nics-background-checks-2015-11.pdf", [0])]
CONDITIONS = ["clean150", "clean300", "noise_blur300", "skew300", "jpeg300"]


def words(text: str) -> list[str]:
    return re.findall(r"\w+", (text or "").lower())


def wer(truth: list[str], hyp: list[str]) -> float:
    """Word-level edit distance / truth length."""
    previous = list(range(len(hyp) + 1))
    for i, t in enumerate(truth, 1):
        current = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (t != h))
        previous = current
    return previous[-1] / max(1, len(truth))


def bag_error(truth: list[str], hyp: list[str]) -> float:
    t, h = Counter(truth), Counter(hyp)
    return 1 - sum((t & h).values()) / max(1, sum(t.values()))


def char_error(truth: str, hyp: str) -> float:
    a, b = " ".join(truth.split()), " ".join((hyp or "").split())
    matched = sum(m.size for m in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks())
    return 1 - matched / max(1, len(a))


def degrade(png: bytes, condition: str, rng: random.Random) -> bytes:
    """The page image under ``condition`` (PIL): noise and blur, a skew, or JPEG artefacts."""
    from PIL import Image, ImageFilter

    image = Image.open(io.BytesIO(png)).convert("L")
    if condition.startswith("noise_blur"):
        image = image.filter(ImageFilter.GaussianBlur(1.2))
        noise = Image.effect_noise(image.size, 40)
        image = Image.blend(image, noise, 0.15)
    elif condition.startswith("skew"):
        image = image.rotate(rng.choice([-3, -2, 2, 3]), resample=Image.BICUBIC, expand=True, fillcolor=255)
    elif condition.startswith("jpeg"):
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=25)
        image = Image.open(io.BytesIO(out.getvalue()))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def scan_pdf(page: pymupdf.Page, dpi: int, condition: str, path: Path, rng: random.Random) -> bytes:
    """Write ``page`` as an image-only PDF at ``path``; returns the page image."""
    png = page.get_pixmap(dpi=dpi).tobytes("png")
    if not condition.startswith("clean"):
        png = degrade(png, condition, rng)
    doc = pymupdf.open()
    out = doc.new_page(width=page.rect.width, height=page.rect.height)
    out.insert_image(out.rect, stream=png)
    doc.save(path, deflate=True)  # a scan is stored compressed (lossless here: the same pixels)
    return png


def _default_ocr_dpi() -> float:
    from docfuse.stages.pdf import PdfTextParams

    return PdfTextParams.model_fields["ocr_dpi"].default


def extract(paths: list[Path], **text_params) -> tuple[list[dict], float]:
    from docfuse import Pipeline

    pipeline = Pipeline.from_yaml("pdf_extract")
    for key, value in text_params.items():
        pipeline.set(f"text.{key}", value)
    t0 = time.perf_counter()
    rows = pipeline.run([str(p) for p in paths]).tables["text"].to_pylist()
    return rows, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="name under bench/results/ (without .json)")
    parser.add_argument("--rapidocr", action="store_true", help="also time RapidOCR on the clean 300-dpi images")
    parser.add_argument("--ocr-dpi", type=int, default=None, help="pdf.text's ocr_dpi for the scans (default: "
                        "the stage's own)")
    args = parser.parse_args()
    ocr = {} if args.ocr_dpi is None else {"ocr_dpi": args.ocr_dpi}
    if not CORPUS.exists():
        raise SystemExit(f"needs the corpus at {CORPUS}")
    rng = random.Random(0)
    work = Path(tempfile.mkdtemp(prefix="docfuse-ocr-"))
    originals, scans, images = [], {c: [] for c in CONDITIONS}, []
    for name, numbers in PAGES:
        src = pymupdf.open(CORPUS / name)
        for n in numbers:
            single = pymupdf.open()
            single.insert_pdf(src, from_page=n, to_page=n)
            original = work / f"{Path(name).stem}_p{n}.pdf"
            single.save(original)
            originals.append(original)
            for condition in CONDITIONS:
                dpi = int(re.search(r"\d+$", condition).group())
                path = work / f"{original.stem}__{condition}.pdf"
                png = scan_pdf(single[0], dpi, condition, path, rng)
                scans[condition].append(path)
                if condition == "clean300":
                    images.append(png)
    truth_rows, never_s = extract(originals, ocr="never")
    auto_rows, auto_s = extract(originals, ocr="auto")
    truth = {Path(r["source"]).stem: r["text"] for r in truth_rows}
    result: dict = {"pages": len(originals), "files": [f"{n} p{p}" for n, ps in PAGES for p in ps],
                    "born_digital": {"seconds_ocr_never": never_s, "seconds_ocr_auto": auto_s,
                                     "auto_over_never": auto_s / never_s,
                                     "ocr_pages_with_auto": sum(r["text_source"] == "ocr" for r in auto_rows)},
                    "ocr_dpi": ocr.get("ocr_dpi", _default_ocr_dpi()), "conditions": {}}
    for condition, paths in scans.items():
        rows, seconds = extract(paths, **ocr)
        per = []
        for r in rows:
            stem = Path(r["source"]).stem.rsplit("__", 1)[0]
            t = truth[stem]
            per.append({"page": stem, "wer": wer(words(t), words(r["text"])), "bag": bag_error(words(t), words(r["text"])),
                        "cer": char_error(t, r["text"]), "confidence": r["ocr_confidence"], "error": r["error"],
                        "source": r["text_source"], "truth_words": len(words(t))})
        total = sum(p["truth_words"] for p in per)
        result["conditions"][condition] = {
            "wer": sum(p["wer"] * p["truth_words"] for p in per) / total,
            "order_free_word_error": sum(p["bag"] * p["truth_words"] for p in per) / total,
            "char_error": statistics.mean(p["cer"] for p in per),
            "pages_per_s": len(paths) / seconds, "seconds": seconds,
            "errors": sum(p["error"] is not None for p in per), "pages": per}
        c = result["conditions"][condition]
        print(f"{condition}: WER {c['wer']:.3f}, order-free {c['order_free_word_error']:.3f}, char {c['char_error']:.3f}, "
              f"{c['pages_per_s']:.2f} pages/s", flush=True)
    scanned = sorted((CORPUS / "pdf" / "scanned").glob("*.pdf"))
    rows, seconds = extract(scanned, **ocr)
    result["corpus_scans"] = [{"file": Path(r["source"]).name, "page": r["page"], "words": r["n_words"],
                               "source": r["text_source"], "confidence": r["ocr_confidence"], "error": r["error"]}
                              for r in rows]
    french = CORPUS / "pdf" / "scanned" / "francais.pdf"
    accents = {}
    for langs in (["eng"], ["fra"]):
        text = extract([french], languages=langs)[0][0]["text"]
        accents["+".join(langs)] = {"accented_letters": sum(c in "àâçéèêëîïôûùüÿœæ" for c in text.lower()),
                                    "text": text[:300]}
    result["french"] = accents
    print(f"corpus scans: {sum(r['words'] > 0 for r in result['corpus_scans'])} of {len(rows)} pages with text; "
          f"French accents eng {accents['eng']['accented_letters']}, fra {accents['fra']['accented_letters']}")
    print(f"born-digital pdf_extract, ocr auto / never: {auto_s:.2f} / {never_s:.2f} s "
          f"({result['born_digital']['auto_over_never']:.2f}x)")
    if args.rapidocr:
        from rapidocr_onnxruntime import RapidOCR

        engine = RapidOCR()
        errors, t0 = [], time.perf_counter()
        for original, png in zip(originals, images):
            found, _ = engine(png)
            hyp = " ".join(item[1] for item in (found or []))
            errors.append((bag_error(words(truth[original.stem]), words(hyp)), len(words(truth[original.stem]))))
        seconds = time.perf_counter() - t0
        tess = result["conditions"]["clean300"]
        result["rapidocr_clean300"] = {"order_free_word_error": sum(e * n for e, n in errors) / sum(n for _, n in errors),
                                       "seconds_per_page": seconds / len(images),
                                       "tesseract_seconds_per_page_same_run": 1 / tess["pages_per_s"]}
        print(f"RapidOCR clean300: order-free {result['rapidocr_clean300']['order_free_word_error']:.3f}, "
              f"{seconds / len(images):.2f} s a page (Tesseract through pdf_extract {1 / tess['pages_per_s']:.2f})")
    if args.out:
        print("saved", save(args.out, result))


if __name__ == "__main__":
    main()
