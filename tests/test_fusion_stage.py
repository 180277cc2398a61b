"""fusion.gate and its wiring: vision.patches with a fusion checkpoint, the fused Arrow column, decode from it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from docfuse.fusion import checkpoint
from docfuse.fusion.checkpoint import VisionSpec
from docfuse.pipelines.registry import find_stage
from docfuse.stages.decode import DecodeGenerate, fused_pages
from docfuse.stages.fuse import FusionGate, fused_rows
from docfuse.stages.models import shared_model
from docfuse.stages.pdf import PdfOpen, PdfRender, PdfText
from docfuse.stages.vision import VisionPatches
from tests.pdf_fixtures import write_figures_doc

SPEC = VisionSpec("vit_tiny_patch16_224", {"depth": 1, "embed_dim": 64, "num_heads": 1}, (128, 96))
SAMPLE = Path(__file__).resolve().parent.parent / "data" / "sample.pdf"


@pytest.fixture(scope="module")
def model():
    return shared_model("default", "auto", "auto")  # the copy fusion.gate and decode.generate share


def make_checkpoint(path: Path, model, gates: float = 0.0, held_out: dict | None = None) -> Path:
    vit, fusion = checkpoint.untrained(SPEC, model[0].config.hidden_size, seed=0)
    with torch.no_grad():
        for g in (fusion.cross.attn_gate, fusion.cross.mlp_gate, fusion.visual_gate):
            g.fill_(gates)
    extra = {"held_out": json.dumps(held_out)} if held_out else {}
    return checkpoint.save(path, vit, fusion, SPEC, checkpoint.decoder_fingerprint(model[0].config), **extra)


def upstream(pdf: Path, ckpt: Path) -> tuple[pa.Table, pa.Table]:
    """pdf.text (layout) and vision.patches tables of one PDF, as pdf_qa builds them."""
    sources = pa.table({"doc_id": ["d"], "source": [str(pdf)], "data": [pdf.read_bytes()], "error": pa.array([None], pa.string())})
    opened = PdfOpen().run(sources)
    text = PdfText(layout=True).run(opened)
    images = PdfRender(dpi=96).run(opened)
    patches = VisionPatches(checkpoint=str(ckpt), model=SPEC.model, model_args=SPEC.args,
                            image_size=list(SPEC.image_size), device="cpu").run(images)
    return text, patches


def test_registered_and_pdf_qa_wires_it():
    from docfuse.pipelines import Pipeline

    assert find_stage("fusion.gate") is FusionGate
    qa = Pipeline.from_yaml("pdf_qa")
    assert qa.stages["fused"].stage == "fusion.gate" and qa.stages["answer"].inputs == ["fused"]


def test_pdf_qa_plans_from_the_checkpoints_verdict(caplog):
    """apply: auto with the shipped checkpoint (below text-only on its held-out pages): no render, no ViT, and a
    warning with what to set and what it costs; always: both run; never or no checkpoint: skipped, no warning."""
    from docfuse.pipelines import Pipeline
    from docfuse.pipelines.executor import LocalExecutor

    auto = LocalExecutor(Pipeline.from_yaml("pdf_qa"))
    assert auto.order == ["pages", "text", "fused", "answer"] and set(auto.plan.skipped) == {"render", "patches"}
    [warning] = auto.plan.warnings
    assert warning.startswith("stage 'fused' (fusion.gate) will not read its input 'patches': the checkpoint's "
                              "held-out masked recovery without its read path 0.296 is below text-only's 0.301")
    assert "Stage(s) render, patches do not run. To read it anyway, --set fused.apply=always: every page is then " \
           "rendered at 96.0 dpi and read by the checkpoint's ViT (samvit_base_patch16 at 1024x768)" in warning
    assert warning in caplog.text
    for apply, order in [("always", ["pages", "text", "render", "patches", "fused", "answer"]),
                         ("never", ["pages", "text", "fused", "answer"])]:
        qa = Pipeline.from_yaml("pdf_qa")
        qa.set("fused.apply", apply)
        planned = LocalExecutor(qa)
        assert planned.order == order and planned.plan.warnings == []
    qa = Pipeline.from_yaml("pdf_qa")
    qa.stages["fused"].params["checkpoint"] = None  # (--set ...=null would remove the key: the default)
    assert "no fusion checkpoint" in LocalExecutor(qa).plan.skipped["patches"]


@pytest.mark.slow
def test_vision_patches_reads_a_fusion_checkpoint_and_measures_ink(tmp_path, model):
    ckpt = make_checkpoint(tmp_path / "f.safetensors", model)
    _, patches = upstream(SAMPLE, ckpt)
    assert patches.column("error").null_count == patches.num_rows
    ink = np.concatenate([c.to_numpy_ndarray() for c in patches.column("patch_ink").chunks])
    assert ink.shape == (patches.num_rows, 8 * 6) and 0 < ink.max() <= 1 and ink.min() >= 0


@pytest.mark.slow
def test_gate_zero_rows_are_the_decoders_own_embeddings_bit_for_bit(tmp_path, model):
    ckpt = make_checkpoint(tmp_path / "f.safetensors", model)
    text, patches = upstream(SAMPLE, ckpt)
    out = FusionGate(checkpoint=str(ckpt), apply="always").run(text, patches)
    assert isinstance(out.schema.field("fused").type.value_type, pa.FixedShapeTensorType)
    embed = model[0].get_input_embeddings()
    for i, ids in enumerate(out.column("token_ids").to_pylist()):
        with torch.no_grad():
            expected = embed(torch.tensor(ids)).float().numpy()  # the stream is float32
        assert np.array_equal(fused_rows(out.column("fused"), i), expected)
    assert out.column("visual_tokens").to_pylist() == [0] * out.num_rows
    # the column survives Parquet as a tensor column
    pq.write_table(out, tmp_path / "f.parquet")
    back = pq.read_table(tmp_path / "f.parquet")
    assert np.array_equal(fused_rows(back.column("fused"), 0), fused_rows(out.column("fused"), 0))


@pytest.mark.slow
def test_open_gates_change_boxed_tokens_and_add_visual_tokens_for_figures(tmp_path, model):
    ckpt = make_checkpoint(tmp_path / "f.safetensors", model, gates=0.5)
    text, patches = upstream(write_figures_doc(tmp_path), ckpt)
    out = FusionGate(checkpoint=str(ckpt), apply="always").run(text, patches)
    assert set(out.column("fusion").to_pylist()) == {"fused"}
    visual = out.column("visual_tokens").to_pylist()
    assert sum(visual) > 0
    embed = model[0].get_input_embeddings()
    for i, ids in enumerate(out.column("token_ids").to_pylist()):
        assert ids.count(-1) == visual[i]
        rows = fused_rows(out.column("fused"), i)
        text_rows = rows[np.array(ids) >= 0]
        with torch.no_grad():
            plain = embed(torch.tensor([t for t in ids if t >= 0])).float().numpy()
        assert not np.array_equal(text_rows, plain)


@pytest.mark.slow
def test_auto_refuses_a_checkpoint_that_lost_to_text_only(tmp_path, model):
    ckpt = make_checkpoint(tmp_path / "f.safetensors", model, gates=0.5,
                           held_out={"masked_recovery_fused": 0.2, "masked_recovery_text_only": 0.3})
    text, patches = upstream(SAMPLE, ckpt)
    gate = FusionGate(checkpoint=str(ckpt), apply="auto")
    assert gate.unread_inputs()["patches"].enable == {"apply": "always"}  # the engine's warning names it
    out = gate.run(text, patches)
    assert all(w.startswith("text_only: the checkpoint's held-out masked recovery 0.200 is below") for w in
               out.column("fusion").to_pylist())
    assert out.column("fused").null_count == out.num_rows  # text-only pages carry no embedding rows
    assert fused_pages(out) == {}  # decode then takes the plain text path


@pytest.mark.slow
def test_auto_judges_a_read_path_checkpoint_without_its_read_path(tmp_path, model):
    """A stage's text hides nothing, so a read path never acts there: the figure that counts is the fusion's
    without it, however far the read path lifts masked recovery."""
    held = {"masked_recovery_fused": 0.7, "masked_recovery_text_only": 0.3, "masked_recovery_without_reads": 0.29}
    ckpt = make_checkpoint(tmp_path / "f.safetensors", model, gates=0.5, held_out=held)
    text, patches = upstream(SAMPLE, ckpt)
    out = FusionGate(checkpoint=str(ckpt), apply="auto").run(text, patches)
    assert all(w.startswith("text_only: the checkpoint's held-out masked recovery without its read path 0.290")
               for w in out.column("fusion").to_pylist())
    held["masked_recovery_without_reads"] = 0.31
    ckpt = make_checkpoint(tmp_path / "g.safetensors", model, gates=0.5, held_out=held)
    out = FusionGate(checkpoint=str(ckpt), apply="auto").run(*upstream(SAMPLE, ckpt))
    assert not any((w or "").startswith("text_only: the checkpoint") for w in out.column("fusion").to_pylist())


@pytest.mark.slow
def test_a_page_without_patches_stays_text_only_and_a_missing_checkpoint_is_named(tmp_path, model):
    ckpt = make_checkpoint(tmp_path / "f.safetensors", model, gates=0.5)
    text, patches = upstream(SAMPLE, ckpt)
    out = FusionGate(checkpoint=str(ckpt), apply="always").run(text, patches.filter(pa.compute.equal(patches["page"], 0)))
    assert out.column("fusion").to_pylist()[1:] == ["text_only: no patches for this page"] * (out.num_rows - 1)
    with pytest.raises(ValueError, match="not found; make one with `docfuse train-fusion`"):
        FusionGate(checkpoint=str(tmp_path / "nope.safetensors"), apply="always").setup()


@pytest.mark.slow
def test_decode_from_a_gate_zero_fused_stream_equals_the_text_path(tmp_path, model):
    """The fused prefix (head + page markers + page rows) is the text path's prompt, token for token."""
    ckpt = make_checkpoint(tmp_path / "f.safetensors", model)
    text, patches = upstream(SAMPLE, ckpt)
    out = FusionGate(checkpoint=str(ckpt), apply="always").run(text, patches)
    question = {"question": "What is the monthly fee?"}
    fused = DecodeGenerate(context=question, max_new_tokens=12).run(out)
    plain = DecodeGenerate(context=question, max_new_tokens=12).run(text)
    assert fused.column("prompt_tokens").to_pylist() == plain.column("prompt_tokens").to_pylist()
    assert fused.column("answer").to_pylist() == plain.column("answer").to_pylist()
    d = DecodeGenerate(context=question)
    d.setup()
    from docfuse.runtime.prompt import document_text
    from docfuse.stages.decode import group_pages

    ids, _, cut = d._fused_prefix(fused_pages_all(out)["d"], ["What is the monthly fee?"])
    assert not cut
    assert ids == list(d.session.prompt.prefix(document_text(group_pages(text)["d"]["pages"])).ids)


def fused_pages_all(table: pa.Table) -> dict:
    """fused_pages, with every page counted as fused (gate 0 says 'fused' too)."""
    return fused_pages(table)


# ---------------------------------------------------------------- the CLI

def _cli(*args: str):
    from typer.testing import CliRunner

    from docfuse.pipelines.cli import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.slow
def test_eval_fusion_prints_the_json_the_issue_names(tmp_path):
    from docfuse.fusion.synth import make_pdf

    pdf = make_pdf(tmp_path / "held.pdf", seed=11, pages=1)["path"]
    result = _cli("eval-fusion", pdf, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert {"masked_recovery_fused", "masked_recovery_text_only", "pages"} <= set(report)
    assert report["pages"] == 1 and 0 <= report["masked_recovery_fused"] <= 1


@pytest.mark.parametrize("args, message", [
    (["train-fusion", "--out", "x.safetensors", "--synthetic", "0"], "nothing to train on"),
    (["train-fusion", "--out", "x.pt"], "written as safetensors"),
    (["train-fusion", "--out", "x.safetensors", "--read-share", "1.5"], "--read-share 1.5: give a share in"),
    (["train-fusion", "--out", "x.safetensors", "--corpus", "no/such/dir"], "no PDF found"),
    (["eval-fusion", "no/such.pdf"], "no PDF found"),
    (["train-fusion-read", "--out", "x.pt"], "written as safetensors"),
    (["train-fusion-read", "--out", "x.safetensors", "--init", "none.safetensors"], "--init none.safetensors: not found"),
    (["train-fusion-read", "--out", "x.safetensors", "--reader-from", "none.safetensors"], "--reader-from none"),
    (["train-fusion-read", "--out", "x.safetensors", "--synthetic", "0"], "nothing to train the read path on"),
    (["train-fusion-read", "--out", "x.safetensors", "--steer-minutes", "0"], "must be positive"),
    (["eval-fusion", "data/sample.pdf", "--checkpoint", "none.safetensors"], "not found; make one"),
])
def test_fusion_commands_refuse_bad_input_with_the_fix(args, message):
    result = _cli(*args)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.slow
def test_pdf_qa_answers_a_document_whose_pages_are_too_large_to_render_text_only(tmp_path):
    """A render error concerns the picture only: one answer row per question, no error row."""
    from docfuse.pipelines import Pipeline

    qa = Pipeline.from_yaml("pdf_qa")
    qa.set("params.question", "What is the monthly fee?")
    qa.set("fused.apply", "always")  # else the plan renders nothing
    qa.set("render.max_pixels", 1000)
    qa.set("render.min_dpi", 50)
    qa.set("answer.max_new_tokens", 12)
    rows = qa.run([str(SAMPLE)]).tables["answer"].to_pylist()
    assert len(rows) == 1 and rows[0]["error"] is None and rows[0]["answer"]


@pytest.mark.slow
def test_pdf_qa_with_its_rejected_checkpoint_answers_exactly_as_pdf_qa_text(monkeypatch):
    """The shipped checkpoint under apply: auto: the run never renders or runs the ViT, and answers as pdf_qa_text;
    under apply: always both run."""
    from docfuse.pipelines import Pipeline

    calls: list[str] = []
    for cls in (PdfRender, VisionPatches):
        monkeypatch.setattr(cls, "run", lambda self, *t, _run=cls.run: calls.append(self.kind) or _run(self, *t))
        monkeypatch.setattr(cls, "setup", lambda self, _setup=cls.setup: calls.append("setup") or _setup(self))
    answers = []
    for name, apply in (("pdf_qa", "auto"), ("pdf_qa_text", None), ("pdf_qa", "always")):
        qa = Pipeline.from_yaml(name)
        qa.set("params.question", "What is the monthly fee?")
        qa.set("answer.max_new_tokens", 16 if apply != "always" else 2)
        if apply:
            qa.set("fused.apply", apply)
        report = qa.run([str(SAMPLE)])
        answers.append([(r["answer"], r["prompt_tokens"], r["error"]) for r in report.tables["answer"].to_pylist()])
        if apply == "auto":
            assert calls == [] and set(report.skipped) == {"render", "patches"}
    assert answers[0] == answers[1] and answers[0][0][2] is None
    assert calls == ["setup", "pdf.render", "setup", "vision.patches"]
