"""fusion.reader, fusion.read_train and the fusion's read path: word crops, CTC decoding, words back to token ids,
a reader that learns to read, the read path's gate-0 identity, its steering training, and checkpoints with a reader.

The decoder is the embedded SmolLM2-135M (its tokenizer decides what a token is); pages are the project's own
synthetic PDFs and word sheets, rendered at the default vision's size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from docfuse.fusion import checkpoint
from docfuse.fusion.checkpoint import VisionSpec, untrained
from docfuse.fusion.evaluate import masked_recovery, text_only
from docfuse.fusion.objective import batch_streams, choose_mask
from docfuse.fusion.prepare import patch_grid_boxes
from docfuse.fusion.read_train import (ReaderTrainConfig, SteerTrainConfig, page_words, reader_accuracy, train_reader,
                               train_steer, with_read_path)
from docfuse.fusion.reader import (CHARSET, UNKNOWN, ReaderConfig, WordReader, decode, encode_text, group_boxes,
                           group_texts, ink_image, place_words, read_tokens, word_crops, word_groups)

HIDDEN = 576
SPEC = VisionSpec("vit_tiny_patch16_224", {"depth": 1, "embed_dim": 64, "num_heads": 1}, (1024, 768))
SMALL = ReaderConfig(height=20, width=128, patch_width=2, dim=48, depth=1, heads=2, stem=8)


@pytest.fixture(scope="module")
def decoder(smollm2):
    model, tok = smollm2
    return model.eval(), tok


@pytest.fixture(scope="module")
def read(decoder, tmp_path_factory: pytest.TempPathFactory):
    """Text pages of a synthetic PDF at the real page size (1024x768), 256 tokens each, with their samples."""
    from docfuse.fusion.prepare import prepare
    from docfuse.fusion.synth import make_pdf
    from docfuse.stages.training_pages import read_pages

    _, tok = decoder
    made = make_pdf(tmp_path_factory.mktemp("reader") / "doc.pdf", seed=3, pages=3)
    samples = read_pages([made["path"]], SPEC.image_size, SPEC.grid)
    out = [(s, p) for s in samples if (p := prepare(s, tok, 256)) is not None and not p.tokens.caption]
    assert out
    return out


@pytest.fixture(scope="module")
def pages(read):
    return [p for _, p in read]


def test_decode_collapses_repeats_and_drops_blanks() -> None:
    a, b = encode_text("a")[0], encode_text("b")[0]
    path = [0, a, a, 0, a, b, b, 0]  # "a", blank, "a", "b"
    logp = torch.full((1, len(path), UNKNOWN + 1), -20.0)
    logp[0, torch.arange(len(path)), torch.tensor(path)] = 0.0
    (word, prob), = decode(logp)
    assert word == "aab" and prob == pytest.approx(1.0)
    assert encode_text("\u4e2d")[0] == UNKNOWN and len(CHARSET) + 1 == UNKNOWN


@pytest.mark.slow
def test_word_groups_are_the_words_of_the_text_layer(decoder, read) -> None:
    _, tok = decoder
    sample, page = read[0]
    boxes, ids = page.tokens.boxes.numpy(), page.tokens.ids.numpy()
    group = word_groups(boxes)
    assert (group[boxes[:, 2] < 0] == -1).all() and (group[boxes[:, 2] >= 0] >= 0).all()
    texts = group_texts(tok, ids, group)
    assert all(t and " " not in t for t in texts)
    gb = group_boxes(boxes, group)
    assert gb.shape == (len(texts), 4) and (gb[:, 2] > gb[:, 0]).all()
    # the groups are the page's words, in order; the Markdown that pdf.text adds (a heading's "##", a table's "|")
    # has no box and forms no group. Next to a table's "|" a word's last token can split off into a group of its own
    # ("$13,535.8" + "2"), so a group is a piece of the next word and almost every group is a whole word.
    words, w, whole = [x.text for x in sample.words], 0, 0
    for text in texts:
        while w < len(words) and text not in words[w]:
            w += 1
        assert w < len(words), f"group {text!r} is no word of the page, in order"
        whole += text == words[w]
    assert whole >= 0.95 * len(texts)


@pytest.mark.slow
def test_place_words_turns_right_words_into_the_hidden_tokens_without_looking_at_them(decoder, pages) -> None:
    _, tok = decoder
    right = total = 0
    for page in pages:
        ids, boxes = page.tokens.ids, page.tokens.boxes
        group = word_groups(boxes.numpy())
        words = dict(enumerate(group_texts(tok, ids.numpy(), group)))
        want = choose_mask(boxes, 0.3, torch.Generator().manual_seed(0))
        got = place_words(tok, ids, boxes, want, words)
        scrambled = ids.clone()
        scrambled[want] = 7  # the hidden ids themselves must not matter
        assert torch.equal(place_words(tok, scrambled, boxes, want, words), got)
        assert (got[~want] == -1).all()
        right += int((got[want] == ids[want]).sum())
        total += int(want.sum())
    assert total > 50 and right / total > 0.97, (right, total)


@pytest.mark.slow
def test_word_crops_keep_the_word_and_blank_the_rest(pages) -> None:
    page = pages[0]
    ink = ink_image(page.pixels)
    gb = torch.from_numpy(group_boxes(page.tokens.boxes.numpy(), word_groups(page.tokens.boxes.numpy())))
    crops = word_crops(ink, gb[:8], SMALL)
    assert crops.shape == (8, 1, SMALL.height, SMALL.width)
    assert (crops.sum(dim=(1, 2, 3)) > 1.0).all(), "every word crop has ink"
    assert not torch.allclose(crops[0], crops[1])
    short = int(torch.argmin(gb[:8, 2] - gb[:8, 0]))
    assert crops[short, :, :, -8:].abs().max() == 0.0, "right of a short word stays blank"
    blank = word_crops(torch.zeros_like(ink), gb[:2], SMALL)
    assert blank.abs().max() == 0.0 and word_crops(ink, gb[:0], SMALL).shape[0] == 0


@pytest.mark.slow
def test_a_reader_learns_to_read_words_it_is_shown(decoder, pages) -> None:
    """A small reader trained for a few hundred steps on one page's words reads most of them back: the crops,
    the CTC loss and the decoding fit together (a broken crop or label alignment keeps accuracy near zero)."""
    _, tok = decoder
    words = page_words(pages[:1], tok)
    words[0].boxes, words[0].texts = words[0].boxes[:24], words[0].texts[:24]
    before = reader_accuracy(WordReader(SMALL), words)
    reader, history = train_reader(words, ReaderTrainConfig(steps=300, batch_words=24, pages_per_step=1, lr=3e-3,
                                                            warmup=20, jitter=0.0), reader_config=SMALL,
                                   log=lambda _: None)
    after = reader_accuracy(reader, words)
    assert before["word_acc"] == 0.0 and after["word_acc"] >= 0.5, (before, after, history[-1])
    assert after["char_error"] < before["char_error"]


@pytest.mark.slow
def test_read_path_is_identity_at_gate_zero_and_acts_before_read_tokens_only(decoder, pages) -> None:
    model, _ = decoder
    embed = model.get_input_embeddings()
    vit, fusion = untrained(SPEC, hidden=HIDDEN)
    fused = with_read_path(fusion.eval(), 64)
    assert fused.read_gate is not None and fused.read_gate.item() == 0.0 and fused.is_identity
    page = pages[0]
    mask = choose_mask(page.tokens.boxes, 0.3, torch.Generator().manual_seed(1))
    reads = torch.where(mask, page.tokens.ids, torch.full_like(page.tokens.ids, -1))
    feats = torch.randn(1, SPEC.grid[0] * SPEC.grid[1], 64)
    boxes = patch_grid_boxes(*SPEC.grid)
    ink = torch.zeros(1, SPEC.grid[0] * SPEC.grid[1])
    plain = batch_streams(fusion.eval(), embed, [page.tokens], feats, boxes, ink, [mask])[0].stream.embeds
    with torch.no_grad():
        same = batch_streams(fused, embed, [page.tokens], feats, boxes, ink, [mask], reads=[reads])[0].stream.embeds
        assert torch.equal(plain, same), "gate 0: the stream is unchanged bit for bit"
        fused.read_gate.fill_(0.5)
        moved = batch_streams(fused, embed, [page.tokens], feats, boxes, ink, [mask], reads=[reads])[0].stream.embeds
    changed = (moved != plain).any(-1)
    before_read = torch.zeros_like(mask)
    before_read[:-1] = mask[1:]
    assert torch.equal(changed, before_read), "only the rows before read (hidden) tokens move"
    assert "read" in fused.gates() and "read" not in fusion.gates()
    assert text_only(fused).read_gate.item() == 0.0


@pytest.mark.slow
def test_steer_training_moves_only_the_read_path_and_checkpoints_keep_the_reader(decoder, pages,
                                                                                 tmp_path: Path) -> None:
    model, tok = decoder
    vit, fusion = untrained(SPEC, hidden=HIDDEN)
    reader = WordReader(SMALL).eval()
    fused = with_read_path(fusion.eval(), 64)
    frozen = {k: v.clone() for k, v in fused.state_dict().items() if not k.startswith("read_")}
    steered, history = train_steer(model, tok, vit.eval(), fused, reader, pages,
                                   SteerTrainConfig(steps=2, batch_pages=2, warmup=1), log=lambda _: None)
    assert history and np.isfinite(history[0]["loss"]) and not steered.training
    assert steered.read_gate.item() != 0.0, "the read gate opened"
    assert all(torch.equal(v, steered.state_dict()[k]) for k, v in frozen.items()), "nothing else changed"

    path = checkpoint.save(tmp_path / "f.safetensors", vit, steered, SPEC, "llama:test", reader=reader)
    _, loaded, _, meta = checkpoint.load(path)
    again = checkpoint.load_reader(path)
    assert loaded.config.read_hidden == 64 and "reader_config" in meta and again.config == SMALL
    crops = torch.rand(2, 1, SMALL.height, SMALL.width)
    assert torch.allclose(again(crops), reader(crops.half().float()), atol=2e-2)
    plain = checkpoint.save(tmp_path / "g.safetensors", vit, fusion, SPEC, "llama:test")
    assert checkpoint.load_reader(plain) is None and checkpoint.load(plain)[1].read_gate is None


@pytest.mark.slow
def test_masked_recovery_with_a_reader_reports_its_reads(decoder, pages) -> None:
    model, tok = decoder
    vit, fusion = untrained(SPEC, hidden=HIDDEN)
    fused = with_read_path(fusion.eval(), 64).eval()
    report = masked_recovery(model, vit.eval(), fused, pages[:1], reader=WordReader(SMALL).eval(), tokenizer=tok)
    assert 0.0 <= report["read_top1"] <= 1.0 and report["masked_tokens"] > 0
    # gate 0: fused is text-only whatever the reader read
    assert report["masked_recovery_fused"] == report["masked_recovery_text_only"]
    reads = read_tokens(WordReader(SMALL).eval(), tok, pages[0].pixels, pages[0].tokens.ids, pages[0].tokens.boxes,
                        torch.zeros(len(pages[0].tokens.ids), dtype=torch.bool))
    assert (reads == -1).all(), "nothing wanted, nothing read"


def test_word_sheets_are_dense_reproducible_and_read_back(tmp_path: Path) -> None:
    import pymupdf

    from docfuse.fusion.synth_words import fonts, make_sheet

    a = make_sheet(tmp_path / "a.pdf", seed=5, pages=1)
    b = make_sheet(tmp_path / "b.pdf", seed=5, pages=1)
    assert Path(a).read_bytes() == Path(b).read_bytes(), "one seed, one file"
    assert {"helv", "tiro", "cour"} <= {name for name, _ in fonts()}
    with pymupdf.open(a) as doc:
        words = doc[0].get_text("words")
        assert len(words) > 200, "a sheet is dense with words"
        assert all(w[2] - w[0] > 0 and w[3] - w[1] > 0 for w in words)
