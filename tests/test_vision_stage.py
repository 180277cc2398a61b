"""vision.patches on real rendered PDF pages with a real (untrained, locally written) ViT checkpoint."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pymupdf
import pytest
import torch
from PIL import Image

from docfuse.pipelines.registry import find_stage
from docfuse.stages import schemas
from docfuse.stages.vision import VisionPatches, init_checkpoint

LETTER = (612.0, 792.0)
A4_LANDSCAPE = (842.0, 595.0)


def _render(pages: list[tuple[tuple[float, float], str, bool]], dpi: int = 96) -> list[tuple[float, float, bytes]]:
    """Write a PDF with PyMuPDF (size, text, draw a filled box) and render each page to PNG, as pdf.render does."""
    doc = pymupdf.open()
    for (width, height), text, box in pages:
        page = doc.new_page(width=width, height=height)
        if text:
            page.insert_textbox(pymupdf.Rect(50, 50, width - 50, height - 50), text, fontsize=18)
        if box:
            page.draw_rect(pymupdf.Rect(width * 0.5, height * 0.5, width * 0.9, height * 0.9), color=(0, 0, 0), fill=(0.1, 0.3, 0.8))
    pdf = pymupdf.open("pdf", doc.tobytes())
    return [(p.rect.width, p.rect.height, p.get_pixmap(dpi=dpi).tobytes("png")) for p in pdf]


def _table(pages: list[tuple[float, float, bytes | None]], source: str = "doc.pdf", dpi: float = 96.0) -> pa.Table:
    rows = [
        schemas.empty_row(schemas.PAGE_IMAGE, doc_id="doc-1", source=source, page=i, page_width=w, page_height=h, dpi=dpi,
                          width_px=int(round(w * dpi / 72)), height_px=int(round(h * dpi / 72)), image=png)
        for i, (w, h, png) in enumerate(pages)
    ]
    return pa.Table.from_pylist(rows, schema=schemas.PAGE_IMAGE)


def _features(table: pa.Table) -> np.ndarray:
    return table.column("patch_features").combine_chunks().to_numpy_ndarray()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(init_checkpoint(tmp_path_factory.mktemp("vit") / "vit_tiny.safetensors", seed=0))


@pytest.fixture(scope="module")
def stage(checkpoint) -> VisionPatches:
    s = VisionPatches(checkpoint=checkpoint)
    s.setup()
    return s


@pytest.fixture(scope="module")
def pages() -> list[tuple[float, float, bytes]]:
    return _render([
        (LETTER, "Quarterly report\n\nRevenue grew by twelve percent in the third quarter.", False),
        (LETTER, "Figures", True),
        (A4_LANDSCAPE, "A landscape page with a chart", True),
    ])


def test_registered_under_its_kind() -> None:
    assert find_stage("vision.patches") is VisionPatches


def test_output_schema_follows_params() -> None:
    default = VisionPatches(checkpoint="unused.safetensors").output()
    assert default == VisionPatches.output_schema
    assert default.names == ["doc_id", "source", "page", "patch_features", "patch_boxes", "patch_grid", "patch_ink", "error"]
    features, boxes, grid = (default.field(n).type for n in ("patch_features", "patch_boxes", "patch_grid"))
    assert isinstance(features, pa.FixedShapeTensorType) and features.shape == [196, 192]
    assert features.value_type == pa.float32()
    assert boxes.shape == [196, 4] and boxes.value_type == pa.float32()
    assert grid.shape == [196, 4] and grid.value_type == pa.int16()
    wide = VisionPatches(checkpoint="unused", image_size=[224, 320]).output()
    assert wide.field("patch_features").type.shape == [14 * 20, 192]
    small = VisionPatches(checkpoint="unused", model="vit_small_patch16_224").output()
    assert small.field("patch_features").type.shape == [196, 384]


SHIPPED = "data/fusion/smollm2-135m-instruct.safetensors"


def test_a_fusion_checkpoint_names_its_vit_and_pdf_qa_names_only_the_checkpoint() -> None:
    """One source of truth: the ViT's shape comes from the checkpoint's metadata, not from the YAML."""
    from docfuse.fusion.checkpoint import read_meta, vision_spec
    from docfuse.pipelines import Pipeline
    from docfuse.stages.vision_model import resolve_checkpoint

    recorded = vision_spec(read_meta(resolve_checkpoint(SHIPPED)))
    vit = VisionPatches(checkpoint=SHIPPED).vit
    assert (vit.model, vit.model_args, vit.image_size) == (recorded.model, recorded.args, recorded.image_size)
    assert VisionPatches(checkpoint=SHIPPED).output().field("patch_features").type.shape == [64 * 48, 128]
    assert set(Pipeline.from_yaml("pdf_qa").stages["patches"].params) == {"checkpoint", "batch_size"}
    # the same values written out agree, so they are accepted (lists and tuples alike)
    same = VisionPatches(checkpoint=SHIPPED, model=recorded.model, model_args=recorded.args,
                         image_size=list(recorded.image_size))
    assert same.vit == vit


def test_a_vit_shape_that_disagrees_with_the_checkpoint_is_invalid_naming_both() -> None:
    from docfuse.pipelines import Pipeline

    qa = Pipeline.from_yaml("pdf_qa")
    qa.set("patches.model_args", {"depth": 2})
    qa.set("patches.image_size", [224, 224])
    problems = qa.validate()
    assert len(problems) == 1, problems
    assert problems[0].startswith("stage 'patches' (vision.patches): model_args {'depth': 2} disagrees with "
                                  "{'depth': 3, ")
    assert f"image_size [224, 224] disagrees with [1024, 768] in the fusion checkpoint '{SHIPPED}'" in problems[0]
    assert "leave model_args and image_size out of this stage's `with:`" in problems[0]
    qa.set("patches.model_args", None)
    qa.set("patches.image_size", None)
    qa.set("patches.model", "vit_tiny_patch16_224")
    assert "model 'vit_tiny_patch16_224' disagrees with 'samvit_base_patch16'" in qa.validate()[0]


def test_bad_params_are_refused() -> None:
    with pytest.raises(ValueError, match="multiples"):
        VisionPatches(checkpoint="x", image_size=[200, 224]).output()
    with pytest.raises(ValueError, match="unknown timm model"):
        VisionPatches(checkpoint="x", model="vit_does_not_exist").output()
    with pytest.raises(ValueError):
        VisionPatches(checkpoint="x", image_size=[224, 224, 3])
    with pytest.raises(ValueError):
        VisionPatches()  # checkpoint is required


def test_features_shape_dtype_and_numpy_round_trip(stage, pages) -> None:
    out = stage.run(_table(pages))
    assert out.schema == stage.output()
    assert out.column("error").to_pylist() == [None, None, None]
    assert out.column("page").to_pylist() == [0, 1, 2]
    assert out.column("doc_id").to_pylist() == ["doc-1"] * 3
    feats = _features(out)
    assert feats.shape == (3, 196, 192) and feats.dtype == np.float32
    assert np.isfinite(feats).all() and np.abs(feats).max() > 0
    assert out.column("patch_boxes").combine_chunks().to_numpy_ndarray().shape == (3, 196, 4)
    grid = out.column("patch_grid").combine_chunks().to_numpy_ndarray()
    assert grid.shape == (3, 196, 4) and grid.dtype == np.int16


@pytest.mark.parametrize(("model", "prefix", "mean", "std", "n", "dim"), [
    ("vit_tiny_patch16_224", 1, (0.5,) * 3, (0.5,) * 3, 196, 192),  # one class token
    ("vit_small_patch14_reg4_dinov2", 5, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 256, 384),  # + 4 registers
])
def test_features_are_the_models_patch_tokens(tmp_path, pages, model, prefix, mean, std, n, dim) -> None:
    """Independent reference: the checkpoint through timm directly, class and register tokens dropped."""
    import timm
    from safetensors.torch import load_file

    ckpt = init_checkpoint(tmp_path / f"{model}.safetensors", model=model)
    net = timm.create_model(model, pretrained=False, num_classes=0, img_size=224)
    net.load_state_dict(load_file(ckpt))
    net.eval()
    img = Image.open(io.BytesIO(pages[0][2])).convert("RGB").resize((224, 224), Image.Resampling.BICUBIC, reducing_gap=3.0)
    pixels = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    x = (pixels - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    with torch.inference_mode():
        tokens = net.forward_features(x[None])
    assert tokens.shape == (1, prefix + n, dim)
    stage = VisionPatches(model=model, checkpoint=str(ckpt))
    stage.setup()
    out = stage.run(_table(pages[:1]))
    assert out.schema == stage.output() and out.schema.field("patch_features").type.shape == [n, dim]
    np.testing.assert_allclose(_features(out)[0], tokens[0, prefix:].numpy(), rtol=1e-4, atol=1e-4)


def test_boxes_tile_each_page_exactly(stage, pages) -> None:
    out = stage.run(_table(pages))
    boxes = out.column("patch_boxes").combine_chunks().to_numpy_ndarray()
    grid = out.column("patch_grid").combine_chunks().to_numpy_ndarray()
    for row, (width, height, _) in enumerate(pages):
        b = boxes[row].reshape(14, 14, 4)
        np.testing.assert_allclose(b[0, 0], [0, 0, width / 14, height / 14], rtol=1e-6)
        assert b[-1, -1, 2] == np.float32(width) and b[-1, -1, 3] == np.float32(height)
        assert (b[:, :-1, 2] == b[:, 1:, 0]).all() and (b[:-1, :, 3] == b[1:, :, 1]).all()  # shared edges, no gaps
        assert (b[:, 0, 0] == 0).all() and (b[0, :, 1] == 0).all()
        assert (b[..., 2] > b[..., 0]).all() and (b[..., 3] > b[..., 1]).all()
        area = ((b[..., 2] - b[..., 0]).astype(np.float64) * (b[..., 3] - b[..., 1])).sum()
        assert area == pytest.approx(width * height, rel=1e-5)
        scale = np.array([width, height, width, height]) / 1000.0
        np.testing.assert_array_equal(grid[row], np.rint(boxes[row] / scale).astype(np.int16))
        g = grid[row].reshape(14, 14, 4)
        assert g[0, 0].tolist() == [0, 0, 71, 71] and g[-1, -1, 2:].tolist() == [1000, 1000]
    # Patches are row-major: the second patch sits right of the first, the 15th below it.
    assert boxes[0, 1, 0] == boxes[0, 0, 2] and boxes[0, 14, 1] == boxes[0, 0, 3]


def test_features_deterministic_across_instances_and_batches(stage, checkpoint, pages) -> None:
    table = _table(pages)
    first = _features(stage.run(table))
    one_at_a_time = VisionPatches(checkpoint=checkpoint, batch_size=1)
    one_at_a_time.setup()
    np.testing.assert_allclose(_features(one_at_a_time.run(table)), first, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(_features(stage.run(table)), first)


def test_features_differ_by_image(stage, pages) -> None:
    feats = _features(stage.run(_table(pages)))
    assert np.abs(feats[0] - feats[1]).max() > 1e-2
    assert np.abs(feats[1] - feats[2]).max() > 1e-2


def test_weights_come_from_the_checkpoint(tmp_path, stage, pages) -> None:
    """Same seed, same features (init is reproducible); another seed, other features (the file is really loaded)."""
    table = _table(pages[:1])
    again = VisionPatches(checkpoint=str(init_checkpoint(tmp_path / "again.safetensors", seed=0)))
    other = VisionPatches(checkpoint=str(init_checkpoint(tmp_path / "other.safetensors", seed=1)))
    again.setup()
    other.setup()
    base = _features(stage.run(table))
    np.testing.assert_array_equal(_features(again.run(table)), base)
    assert np.abs(_features(other.run(table)) - base).max() > 1e-2


def test_torch_state_dict_checkpoint_loads_the_same(tmp_path, stage, checkpoint, pages) -> None:
    from safetensors.torch import load_file

    pt = tmp_path / "vit_tiny.pt"
    torch.save({"state_dict": load_file(checkpoint)}, pt)
    from_pt = VisionPatches(checkpoint=str(pt))
    from_pt.setup()
    table = _table(pages[:1])
    np.testing.assert_array_equal(_features(from_pt.run(table)), _features(stage.run(table)))


def test_missing_checkpoint_names_the_path_and_the_fix(tmp_path) -> None:
    missing = tmp_path / "nowhere" / "vit.safetensors"
    with pytest.raises(ValueError) as err:
        VisionPatches(checkpoint=str(missing)).setup()
    message = str(err.value)
    assert str(missing) in message and "not found" in message
    assert "init_checkpoint" in message and "train-fusion" in message


def test_checkpoint_must_match_the_model_strictly(tmp_path, checkpoint) -> None:
    from safetensors.torch import load_file

    state = load_file(checkpoint)
    dropped = dict(state)
    dropped.pop("blocks.0.attn.qkv.weight")
    torch.save(dropped, tmp_path / "missing_key.pt")
    with pytest.raises(ValueError, match=r"1 missing keys \['blocks.0.attn.qkv.weight'\]"):
        VisionPatches(checkpoint=str(tmp_path / "missing_key.pt")).setup()

    torch.save({**state, "head.weight": torch.zeros(1000, 192)}, tmp_path / "extra_key.pt")
    with pytest.raises(ValueError, match=r"1 unexpected keys \['head.weight'\]"):
        VisionPatches(checkpoint=str(tmp_path / "extra_key.pt")).setup()

    small = init_checkpoint(tmp_path / "vit_small.safetensors", model="vit_small_patch16_224")
    with pytest.raises(ValueError, match="made for vit_small_patch16_224") as err:
        VisionPatches(checkpoint=str(small)).setup()
    assert "shapes differ" in str(err.value)

    (tmp_path / "junk.bin").write_bytes(b"this is not a checkpoint")
    with pytest.raises(ValueError, match="neither a safetensors file nor a torch state dict"):
        VisionPatches(checkpoint=str(tmp_path / "junk.bin")).setup()


def test_other_image_size_needs_a_checkpoint_made_at_it(tmp_path, checkpoint, pages) -> None:
    with pytest.raises(ValueError, match=r"image_size \[224, 320\].*probably \[224, 224\]"):
        VisionPatches(checkpoint=checkpoint, image_size=[224, 320]).setup()
    wide_ckpt = init_checkpoint(tmp_path / "wide.safetensors", image_size=[224, 320])
    wide = VisionPatches(checkpoint=str(wide_ckpt), image_size=[224, 320])
    wide.setup()
    out = wide.run(_table(pages[2:]))
    assert out.schema == wide.output()
    assert _features(out).shape == (1, 280, 192)
    b = out.column("patch_boxes").combine_chunks().to_numpy_ndarray()[0].reshape(14, 20, 4)
    np.testing.assert_allclose(b[0, 0], [0, 0, A4_LANDSCAPE[0] / 20, A4_LANDSCAPE[1] / 14], rtol=1e-6)
    assert b[-1, -1, 2] == np.float32(A4_LANDSCAPE[0]) and b[-1, -1, 3] == np.float32(A4_LANDSCAPE[1])


def test_corrupt_png_becomes_an_error_row_and_others_succeed(stage, pages) -> None:
    good = pages[0]
    truncated = good[2][: len(good[2]) // 2]
    table = _table([good, (612.0, 792.0, truncated), (612.0, 792.0, b"not a png at all"), (612.0, 792.0, b""), pages[1]])
    out = stage.run(table)
    errors = out.column("error").to_pylist()
    assert errors[0] is None and errors[4] is None
    for i in (1, 2, 3):
        assert errors[i].startswith("bad_image: page %d of 'doc.pdf'" % i) and "pdf.render" in errors[i]
    features = out.column("patch_features").combine_chunks()
    assert features.is_null().to_pylist() == [False, True, True, True, False]
    assert out.column("patch_boxes").combine_chunks().is_null().to_pylist() == [False, True, True, True, False]
    alone = _features(stage.run(_table([good, pages[1]])))
    full = features.storage.values.to_numpy().reshape(5, 196, 192)  # null rows keep zero placeholders
    np.testing.assert_allclose(full[[0, 4]], alone, rtol=1e-4, atol=1e-4)


def test_unusable_page_size_becomes_an_error_row(stage, pages) -> None:
    w, h, png = pages[0]
    out = stage.run(_table([(0.0, h, png), (w, h, png)]))
    errors = out.column("error").to_pylist()
    assert errors[0].startswith("bad_page_size:") and errors[1] is None


def test_transparent_png_is_read_as_white_paper(stage) -> None:
    def png(image: Image.Image) -> bytes:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()

    clear = png(Image.new("RGBA", (816, 1056), (0, 0, 0, 0)))
    white = png(Image.new("RGB", (816, 1056), (255, 255, 255)))
    black = png(Image.new("RGB", (816, 1056), (0, 0, 0)))
    feats = _features(stage.run(_table([(612.0, 792.0, clear), (612.0, 792.0, white), (612.0, 792.0, black)])))
    np.testing.assert_allclose(feats[0], feats[1], rtol=1e-5, atol=1e-5)
    assert np.abs(feats[0] - feats[2]).max() > 1e-2


def test_empty_batch(stage) -> None:
    out = stage.run(_table([]))
    assert out.num_rows == 0 and out.schema == stage.output()


def test_bfloat16_compute_still_returns_float32_features(stage, checkpoint, pages) -> None:
    table = _table(pages[:2])
    half = VisionPatches(checkpoint=checkpoint, dtype="bfloat16", device="cpu")
    half.setup()
    out = half.run(table)
    assert out.schema == stage.output()
    low, full = _features(out), _features(stage.run(table))
    assert low.dtype == np.float32
    assert np.corrcoef(low.ravel(), full.ravel())[0, 1] > 0.99


def test_relative_checkpoint_is_found_from_cwd_then_package_data(tmp_path, monkeypatch, checkpoint) -> None:
    """``data/...`` in a YAML means the shipped package data (docfuse.data) wherever docfuse runs from."""
    from docfuse.stages import vision_model

    packaged, elsewhere = tmp_path / "packaged", tmp_path / "elsewhere"
    (packaged / "vision").mkdir(parents=True)
    elsewhere.mkdir()
    target = packaged / "vision" / "vit.safetensors"
    target.write_bytes(Path(checkpoint).read_bytes())
    monkeypatch.setattr(vision_model, "shipped", lambda relative="": packaged / relative)
    monkeypatch.chdir(elsewhere)
    assert vision_model.resolve_checkpoint("data/vision/vit.safetensors") == target
    VisionPatches(checkpoint="data/vision/vit.safetensors").setup()
    monkeypatch.chdir(packaged)
    assert vision_model.resolve_checkpoint("vision/vit.safetensors") == Path("vision/vit.safetensors")
    with pytest.raises(ValueError, match="'nowhere.safetensors' not found"):
        VisionPatches(checkpoint="nowhere.safetensors").setup()


def test_page_preparation_tables_give_the_plain_float32_arithmetic_bit_for_bit() -> None:
    from docfuse.fusion.encoder import INK_LEVEL, normalise, patch_ink

    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(96, 64, 3), dtype=np.uint8)
    img[:8] = 255  # white paper
    img[8:16] = rng.integers(200, 210, size=(8, 64, 3))  # around the ink level (0.8 * 255 = 204)
    for mean, std in (((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))):
        x = img.astype(np.float32) / 255.0
        x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
        assert np.array_equal(normalise(img, mean, std), np.ascontiguousarray(x.transpose(2, 0, 1)))
    gray = img.astype(np.float32).mean(-1) / 255.0
    plain = (gray < INK_LEVEL).astype(np.float32).reshape(8, 12, 4, 16).mean(axis=(1, 3)).reshape(-1)
    got = patch_ink(img, 8, 4)
    assert got.dtype == np.float32 and np.array_equal(got, plain) and ((got > 0) & (got < 1)).any()


def test_pages_prepared_in_threads_come_out_in_row_order(stage, pages) -> None:
    # a batch bigger than the preparation pool: every row must get its own page's features and boxes
    table = _table(pages * 3)
    one_by_one = [stage.run(table.slice(i, 1)) for i in range(table.num_rows)]
    together = stage.run(table)
    for i, alone in enumerate(one_by_one):
        for column in ("patch_features", "patch_boxes", "patch_ink"):
            assert together.column(column)[i].equals(alone.column(column)[0]), (i, column)


def test_vit_geometry_is_remembered_on_disk_and_a_later_process_needs_no_timm(tmp_path, monkeypatch) -> None:
    """A pipeline's schema needs the ViT's patch grid even when its vision stages do not run; measuring it imports
    timm (and torchvision), ~2.5 s of a cached `docfuse ask`. The memo answers later processes without them, and a
    damaged memo is measured again, never trusted."""
    import json
    import subprocess
    import sys

    from docfuse.stages import vision_model

    monkeypatch.setenv("DOCFUSE_HOME", str(tmp_path))
    vision_model.geometry.cache_clear()
    args = vision_model.as_args({"depth": 1, "embed_dim": 32, "num_heads": 2})
    measured = vision_model.geometry("vit_tiny_patch16_224", (64, 96), args)
    assert (measured.rows, measured.cols, measured.dim) == (4, 6, 32)
    memo_file = tmp_path / vision_model.GEOMETRY_MEMO
    assert len(json.loads(memo_file.read_text())) == 1

    probe = ("import sys\nfrom docfuse.stages import vision_model as v\n"
             "g = v.geometry('vit_tiny_patch16_224', (64, 96), v.as_args({'depth': 1, 'embed_dim': 32, 'num_heads': 2}))\n"
             "print(g.rows, g.cols, g.dim, g.prefix_tokens, 'timm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "DOCFUSE_HOME": str(tmp_path)}).stdout.split()
    assert out == ["4", "6", "32", str(measured.prefix_tokens), "False"]

    memo = json.loads(memo_file.read_text())
    memo[next(iter(memo))]["rows"] = "not a number"
    memo_file.write_text(json.dumps(memo))
    vision_model.geometry.cache_clear()
    assert vision_model.geometry("vit_tiny_patch16_224", (64, 96), args) == measured
    assert json.loads(memo_file.read_text())[next(iter(memo))]["rows"] == 4
    memo_file.write_text("{ torn")
    vision_model.geometry.cache_clear()
    assert vision_model.geometry("vit_tiny_patch16_224", (64, 96), args) == measured
    with pytest.raises(ValueError, match="multiples"):  # a size the memo never saw is still checked
        vision_model.geometry("vit_tiny_patch16_224", (65, 96), args)
    vision_model.geometry.cache_clear()
