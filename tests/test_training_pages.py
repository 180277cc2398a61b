"""Fusion training reads pages through the pipeline's own stages (issue 27): the text, words and image a training
page carries are those pdf_qa serves, in reading order, and a bad PDF costs only its own pages."""

from __future__ import annotations

import numpy as np
import pymupdf
import pytest

from docfuse.pipelines import Pipeline
from docfuse.stages.training_pages import read_pages, reading_pipeline

TOP = "Opening paragraph of the page, which a reader meets first."
BOTTOM = "Closing paragraph at the foot of the page, written into the file before the opening one."


@pytest.fixture
def reversed_pdf(tmp_path) -> str:
    """One page whose text layer holds the bottom paragraph first: raw order and reading order disagree."""
    doc = pymupdf.open()
    page = doc.new_page(width=612, height=792)
    page.insert_text((72, 600), BOTTOM, fontsize=11)
    page.insert_text((72, 100), TOP, fontsize=11)
    path = tmp_path / "reversed.pdf"
    doc.save(path)
    assert page.get_text("text", sort=False).index("Closing") < page.get_text("text", sort=False).index("Opening")
    return str(path)


def test_training_pages_are_the_pages_pdf_qa_serves(reversed_pdf) -> None:
    (sample,) = read_pages([reversed_pdf], (224, 224), (16, 16))
    assert sample.text.index("Opening") < sample.text.index("Closing"), "training must read in reading order"
    served = Pipeline.from_yaml("pdf_qa")
    served.outputs = ["text"]
    for name in ("patches", "fused", "answer"):
        served.stages.pop(name)
    (row,) = served.run([reversed_pdf]).tables["text"].to_pylist()
    assert sample.text == row["text"]
    assert [(w.text, w.x0, w.y1) for w in sample.words] == [(w["text"], w["x0"], w["y1"]) for w in row["words"]]
    assert sample.pixels.shape == (224, 224, 3) and sample.pixels.dtype == np.uint8
    assert sample.ink.shape == (256,) and sample.ink.max() > 0


def test_the_reading_stages_take_pdf_qa_parameters() -> None:
    qa, reading = Pipeline.from_yaml("pdf_qa"), reading_pipeline(dpi=72)
    assert reading.stages["text"] == qa.stages["text"] and reading.stages["pages"] == qa.stages["pages"]
    assert reading.stages["render"].params["dpi"] == 72 and qa.stages["render"].params["dpi"] == 96


def test_a_corrupt_pdf_costs_only_its_own_pages(reversed_pdf, tmp_path) -> None:
    bad = tmp_path / "bad.pdf"
    bad.write_bytes(b"%PDF-1.4 not really")
    samples = read_pages([str(bad), reversed_pdf], (224, 224), (16, 16))
    assert [s.source.endswith("reversed.pdf") for s in samples] == [True]
