"""fusion/: token boxes, gate-0 identity, visual tokens, checkpoints, the objective and a tiny train/eval round.

Everything is tiny (a 64-wide one-layer ViT on a 128x96 page, an 8x6 patch grid) except the decoder, the embedded
SmolLM2-135M, loaded once per module (~5 s once converted into $DOCFUSE_HOME).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from docfuse.fusion import checkpoint
from docfuse.fusion.checkpoint import VisionSpec, decoder_fingerprint, untrained
from docfuse.fusion.evaluate import masked_recovery, text_only
from docfuse.fusion.model import Fusion, FusionConfig, interleave
from docfuse.fusion.objective import PageTensors, batch_streams, choose_mask
from docfuse.fusion.prepare import patch_grid_boxes
from docfuse.fusion.tokens import NO_BOX, Word, align_words, tokenize_page
from docfuse.fusion.visual import uncovered, windows

HIDDEN = 576  # SmolLM2-135M
ROWS, COLS = 8, 6
SPEC = VisionSpec("vit_tiny_patch16_224", {"depth": 1, "embed_dim": 64, "num_heads": 1}, (128, 96))

PAGE_W, PAGE_H = 600.0, 800.0  # points
TEXT = "Total: $4,218.07 due\nINV-20931 paid"
WORDS = [  # boxes in points, origin top left; both lines in the top half of the page
    Word("Total:", 72.0, 100.0, 102.0, 112.0),
    Word("$4,218.07", 106.0, 100.0, 160.0, 112.0),
    Word("due", 164.0, 100.0, 182.0, 112.0),
    Word("INV-20931", 72.0, 120.0, 130.0, 132.0),
    Word("paid", 134.0, 120.0, 156.0, 132.0),
]
# the same page with a footer line at the very bottom (below the figure in the bottom half)
FOOTER_TEXT = TEXT + "\nPage 1"
FOOTER_WORDS = WORDS + [Word("Page", 280.0, 760.0, 300.0, 772.0), Word("1", 304.0, 760.0, 310.0, 772.0)]


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def decoder(smollm2):
    model, tok = smollm2
    return model.eval(), tok


def tiny_fusion(seed: int = 0, **overrides) -> Fusion:
    torch.manual_seed(seed)
    return Fusion(FusionConfig(hidden=HIDDEN, vision_dim=64, grid_rows=ROWS, grid_cols=COLS, **overrides)).eval()


def grid_box(word: Word) -> np.ndarray:
    sx, sy = 1000.0 / PAGE_W, 1000.0 / PAGE_H
    return np.array([word.x0 * sx, word.y0 * sy, word.x1 * sx, word.y1 * sy])


def page_tensors(tok, text: str = TEXT, words=WORDS) -> tuple[torch.Tensor, torch.Tensor]:
    page = tokenize_page(tok, text, words, PAGE_W, PAGE_H)
    return torch.from_numpy(page.ids), torch.from_numpy(page.boxes)


def patch_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ViT features [P, 64] and the patch grid's boxes [P, 4]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS * COLS, 64, generator=gen), patch_grid_boxes(ROWS, COLS)


def bottom_ink() -> torch.Tensor:
    """Ink only in the bottom half of the patch grid (rows 4..7): a figure under the text."""
    ink = torch.zeros(ROWS, COLS)
    ink[ROWS // 2:] = 0.3
    return ink.reshape(-1)


def no_box(boxes: torch.Tensor) -> torch.Tensor:
    return (boxes == torch.tensor(NO_BOX)).all(-1)


# ---------------------------------------------------------------- 1. gate 0 is exactly text-only

@pytest.mark.slow
def test_gate_zero_fusion_is_the_text_stream_bit_for_bit(decoder) -> None:
    model, tok = decoder
    ids, boxes = page_tensors(tok)
    assert (~no_box(boxes)).sum() >= 10 and no_box(boxes).any()  # boxed tokens and the newline
    feats, patch_boxes = patch_inputs()
    ink = torch.ones(ROWS * COLS)  # ink everywhere: a visual token would be possible anywhere
    fusion = tiny_fusion()
    assert fusion.is_identity and not fusion.training
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        out = fusion.fuse_page(embeds, boxes, feats, patch_boxes, ink)
        assert torch.equal(out.embeds, embeds)
        assert out.embeds.shape[0] == len(ids) and not out.visual.any()
        assert torch.equal(out.text_index, torch.arange(len(ids)))

        by_ids = model(input_ids=ids[None]).logits
        by_embeds = model(inputs_embeds=model.get_input_embeddings()(ids[None])).logits
        fused = model(inputs_embeds=out.embeds[None]).logits
    assert torch.equal(by_embeds, by_ids)
    assert torch.equal(fused, by_ids)


@pytest.mark.slow
def test_open_gate_changes_boxed_tokens_only(decoder) -> None:
    model, tok = decoder
    ids, boxes = page_tensors(tok)
    feats, patch_boxes = patch_inputs()
    boxed = ~no_box(boxes)
    fusion = tiny_fusion()
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        for gate in (fusion.cross.attn_gate, fusion.cross.mlp_gate):
            gate.data.fill_(0.5)
            out = fusion.fuse_page(embeds, boxes, feats, patch_boxes, torch.ones(ROWS * COLS))
            assert not out.visual.any()  # the visual gate is still 0
            rows_equal = torch.tensor([torch.equal(out.embeds[i], embeds[i]) for i in range(len(ids))])
            assert not rows_equal[boxed].any(), "every token with a box reads the image"
            assert rows_equal[~boxed].all(), "tokens without a box (NO_BOX) stay exactly as they were"
            gate.data.zero_()


# ---------------------------------------------------------------- 2. text_only

@pytest.mark.slow
def test_text_only_zeroes_every_gate_and_leaves_the_original(decoder) -> None:
    model, tok = decoder
    fusion = tiny_fusion()
    fusion.train()
    with torch.no_grad():
        fusion.cross.attn_gate.fill_(0.3)
        fusion.cross.mlp_gate.fill_(-0.2)
        fusion.visual_gate.fill_(0.7)
    before = {k: v.clone() for k, v in fusion.state_dict().items()}
    off = text_only(fusion)

    assert off is not fusion and not off.training and off.is_identity
    assert off.gates() == {"attention": 0.0, "mlp": 0.0, "visual_tokens": 0.0}
    after = fusion.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), "the original's weights and gates are untouched"
    assert fusion.training and not fusion.is_identity
    gates = {"cross.attn_gate", "cross.mlp_gate", "visual_gate"}
    copied = off.state_dict()
    assert all(torch.equal(copied[k], before[k]) for k in before if k not in gates)
    with torch.no_grad():  # a copy, not shared storage
        off.projector.fc1.weight.add_(1.0)
    assert torch.equal(fusion.projector.fc1.weight, before["projector.fc1.weight"])

    ids, boxes = page_tensors(tok)
    feats, patch_boxes = patch_inputs()
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        out = off.fuse_page(embeds, boxes, feats, patch_boxes, torch.ones(ROWS * COLS))
    assert torch.equal(out.embeds, embeds)


# ---------------------------------------------------------------- 3. token boxes

@pytest.mark.slow
def test_token_boxes_split_their_words(decoder) -> None:
    _, tok = decoder
    page = tokenize_page(tok, TEXT, WORDS, PAGE_W, PAGE_H)
    enc = tok(TEXT, add_special_tokens=False, return_offsets_mapping=True)
    assert page.ids.tolist() == list(enc.input_ids) and page.boxes.shape == (len(page), 4)
    spans = align_words(TEXT, WORDS)
    assert [i for _, _, i in spans] == list(range(len(WORDS)))

    per_word: dict[int, list[tuple[int, int, np.ndarray]]] = {}
    for t, (start, end) in enumerate(enc.offset_mapping):
        piece = TEXT[start:end]
        if not piece.strip():
            assert piece == "\n"
            assert tuple(page.boxes[t]) == NO_BOX, "the newline token has no box"
            continue
        lead = len(piece) - len(piece.lstrip())
        first, last = start + lead, start + len(piece.rstrip())
        [(ws, we, w)] = [(s, e, i) for s, e, i in spans if s <= first and last <= e]
        box, word = page.boxes[t].astype(np.float64), grid_box(WORDS[w])
        # inside its word's box on the 0-1000 grid, on its word's line
        assert word[0] - 1e-3 <= box[0] < box[2] <= word[2] + 1e-3, (piece, box, word)
        np.testing.assert_allclose(box[[1, 3]], word[[1, 3]], atol=1e-3)
        # its share of the word's width is its share of the word's characters
        np.testing.assert_allclose(box[2] - box[0], (word[2] - word[0]) * (last - first) / (we - ws), atol=1e-3)
        per_word.setdefault(w, []).append((first, last, box))
    assert sorted(per_word) == list(range(len(WORDS)))
    for w, parts in per_word.items():  # the tokens of one word tile its x-range left to right
        word = grid_box(WORDS[w])
        assert abs(parts[0][2][0] - word[0]) < 1e-3 and abs(parts[-1][2][2] - word[2]) < 1e-3
        for (_, _, a), (_, _, b) in zip(parts, parts[1:]):
            assert abs(a[2] - b[0]) < 1e-3
    assert len(per_word[1]) > 1  # "$4,218.07" is several tokens, so the partition is really checked


@pytest.mark.slow
def test_align_words_skips_words_not_in_the_text(decoder) -> None:
    _, tok = decoder
    words = [WORDS[0], Word("MISSING", 0, 0, 10, 10), Word("   ", 0, 0, 1, 1), WORDS[2], WORDS[4]]
    assert align_words(TEXT, words) == [(0, 6, 0), (17, 20, 3), (31, 35, 4)]
    # a word's position is searched after the previous word's: "paid" before "Total:" is not found out of order
    assert align_words(TEXT, [WORDS[4], WORDS[0]]) == [(31, 35, 0)]
    # a repeated word is found twice, each occurrence once
    assert align_words("due due", [Word("due", 0, 0, 1, 1), Word("due", 2, 0, 3, 1)]) == [(0, 3, 0), (4, 7, 1)]

    full = tokenize_page(tok, TEXT, WORDS, PAGE_W, PAGE_H)
    partial = tokenize_page(tok, TEXT, [w for w in WORDS if w.text != "due"], PAGE_W, PAGE_H)
    enc = tok(TEXT, add_special_tokens=False, return_offsets_mapping=True)
    for t, (start, end) in enumerate(enc.offset_mapping):
        if TEXT[start:end].strip() == "due":
            assert tuple(partial.boxes[t]) == NO_BOX
        else:
            assert np.array_equal(partial.boxes[t], full.boxes[t])


# ---------------------------------------------------------------- 4. visual tokens

def _visual_page(model, tok, text, words, fusion):
    ids, boxes = page_tensors(tok, text, words)
    feats, patch_boxes = patch_inputs()
    ink = bottom_ink()
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        out = fusion.fuse_page(embeds, boxes, feats, patch_boxes, ink)
        patches = fusion.project(feats)
        tokens, where = fusion.visual_tokens(boxes, patches, patch_boxes, ink)
        win = windows(ROWS, COLS, patches, uncovered(patch_boxes, boxes), ink, fusion.config.pool,
                      fusion.config.max_visual_tokens, fusion.config.min_ink)
    return embeds, boxes, out, tokens, where, win


def _check_consistent(out, embeds, tokens) -> None:
    t, v = embeds.shape[0], tokens.shape[0]
    assert out.embeds.shape == (t + v, embeds.shape[1]) and out.visual.shape == (t + v,)
    assert int(out.visual.sum()) == v and out.text_index.shape == (t,)
    assert bool((out.text_index[1:] > out.text_index[:-1]).all())
    assert not out.visual[out.text_index].any()
    assert torch.equal(out.embeds[out.text_index], embeds), "the text rows, in order"
    assert torch.equal(out.embeds[out.visual], tokens), "the visual rows, in order"


@pytest.mark.slow
def test_visual_tokens_cover_the_figure_below_the_text(decoder) -> None:
    model, tok = decoder
    fusion = tiny_fusion()
    fusion.visual_gate.data.fill_(0.5)
    embeds, boxes, out, tokens, where, win = _visual_page(model, tok, TEXT, WORDS, fusion)
    assert float(boxes[~no_box(boxes)][:, 3].max()) < 500  # the words are in the top half
    # 4x4-patch windows of the 8x6 grid: the two bottom ones hold the ink
    assert tokens.shape[0] == 2 and win.pool == 4
    assert bool((win.boxes[:, 1] >= 500).all()) and bool((win.boxes[:, 3] <= 1000).all())
    np.testing.assert_allclose(win.boxes.numpy(), [[0, 500, 4000 / 6, 1000], [4000 / 6, 500, 1000, 1000]],
                               atol=1e-3)
    assert where.tolist() == [len(embeds)] * 2  # below every text token: after all of them
    _check_consistent(out, embeds, tokens)
    assert out.visual.tolist() == [False] * len(embeds) + [True, True]
    # the tokens carry the gated content, not just the marker
    assert not torch.allclose(tokens, fusion.visual_marker.expand_as(tokens))


@pytest.mark.slow
def test_visual_tokens_go_before_text_below_them(decoder) -> None:
    model, tok = decoder
    fusion = tiny_fusion()
    fusion.visual_gate.data.fill_(0.5)
    embeds, boxes, out, tokens, where, _ = _visual_page(model, tok, FOOTER_TEXT, FOOTER_WORDS, fusion)
    assert tokens.shape[0] == 2  # the footer's words cover few enough of the bottom patches
    footer = int(torch.nonzero(boxes[:, 1] > 900)[0])  # first token of "Page 1"
    assert where.tolist() == [footer, footer]
    _check_consistent(out, embeds, tokens)
    assert torch.nonzero(out.visual).flatten().tolist() == [footer, footer + 1]
    assert int(out.text_index[footer]) == footer + 2 and int(out.text_index[footer - 1]) == footer - 1


@pytest.mark.slow
def test_visual_gate_zero_adds_no_visual_tokens_in_eval(decoder) -> None:
    model, tok = decoder
    fusion = tiny_fusion()
    with torch.no_grad():
        fusion.cross.attn_gate.fill_(0.5)  # not the identity, but the visual branch is still closed
    embeds, _, out, _, _, _ = _visual_page(model, tok, TEXT, WORDS, fusion)
    assert out.embeds.shape[0] == len(embeds) and not out.visual.any()


def test_visual_token_budget_pools_coarser() -> None:
    feats, patch_boxes = patch_inputs()
    ink = torch.ones(ROWS * COLS)
    words = torch.full((5, 4), -1.0)  # no word anywhere: every window is a candidate
    with torch.no_grad():
        wide = tiny_fusion()
        wide.visual_gate.data.fill_(0.5)
        all_tokens, _ = wide.visual_tokens(words, wide.project(feats), patch_boxes, ink)
        assert all_tokens.shape[0] == 4  # 2x2 windows of 4x4 patches
        small = tiny_fusion(max_visual_tokens=2)
        small.visual_gate.data.fill_(0.5)
        patches = small.project(feats)
        tokens, where = small.visual_tokens(words, patches, patch_boxes, ink)
        assert 1 <= tokens.shape[0] <= 2 and where.shape[0] == tokens.shape[0]
        win = windows(ROWS, COLS, patches, uncovered(patch_boxes, words), ink, 4, 2)
        assert win.pool == 8 and win.boxes.tolist() == [[0.0, 0.0, 1000.0, 1000.0]]
        assert windows(ROWS, COLS, patches, uncovered(patch_boxes, words), ink, 1, 2).pool == 8
        assert windows(ROWS, COLS, patches, uncovered(patch_boxes, words), ink, 1, 12).pool == 2
        assert windows(ROWS, COLS, patches, uncovered(patch_boxes, words), ink, 1, 12).boxes.shape[0] == 12
        out = small.fuse_page(torch.zeros(5, HIDDEN), words, feats, patch_boxes, ink)
        assert int(out.visual.sum()) <= 2
        # a window mostly covered by words is text, not a visual token, however much ink it holds
        top = torch.tensor([[0.0, 0.0, 1000.0, 490.0]])
        tokens, where = wide.visual_tokens(top, wide.project(feats), patch_boxes, ink)
        assert tokens.shape[0] == 2 and where.tolist() == [1, 1]


def test_interleave_places_visual_rows() -> None:
    text = torch.tensor([[10.0], [11.0], [12.0]])
    visual = torch.tensor([[100.0], [101.0], [102.0], [103.0]])
    where = torch.tensor([2, 0, 3, 2])  # before text 2, before text 0, at the end, before text 2 (after v0)
    out = interleave(text, visual, where)
    assert out.embeds.flatten().tolist() == [101.0, 10.0, 11.0, 100.0, 103.0, 12.0, 102.0]
    assert out.visual.tolist() == [True, False, False, True, True, False, True]
    assert out.text_index.tolist() == [1, 2, 5]
    none = interleave(text, visual[:0], where[:0])
    assert torch.equal(none.embeds, text) and not none.visual.any() and none.text_index.tolist() == [0, 1, 2]


# ---------------------------------------------------------------- 5. checkpoints

@pytest.mark.slow
def test_checkpoint_round_trip_and_refusals(decoder, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model, _ = decoder
    vit, fusion = untrained(SPEC, hidden=HIDDEN)
    assert fusion.config == FusionConfig(hidden=HIDDEN, vision_dim=64, grid_rows=ROWS, grid_cols=COLS)
    with torch.no_grad():  # not all-default values: gates open, a weight moved
        fusion.cross.attn_gate.fill_(0.25)
        fusion.visual_gate.fill_(-0.5)
        fusion.projector.fc1.bias.add_(0.125)
    fingerprint = decoder_fingerprint(model.config)
    assert str(HIDDEN) in fingerprint
    path = checkpoint.save(tmp_path / "sub" / "fusion.safetensors", vit, fusion, SPEC, fingerprint,
                           dtype=torch.float32, command="test run")
    assert path.is_file()

    meta = checkpoint.read_meta(path)
    assert meta["decoder"] == fingerprint and meta["command"] == "test run"
    vit2, fusion2, spec2, meta2 = checkpoint.load(path, decoder=fingerprint)
    assert meta2 == meta and spec2 == SPEC and fusion2.config == fusion.config
    assert not vit2.training and not fusion2.training
    for a, b in ((vit.state_dict(), vit2.state_dict()), (fusion.state_dict(), fusion2.state_dict())):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert fusion2.gates() == fusion.gates()

    # the default (fp16, to keep shipped files small): every tensor comes back as its fp16 rounding, in float32
    small = checkpoint.save(tmp_path / "small.safetensors", vit, fusion, SPEC, fingerprint)
    assert small.stat().st_size < path.stat().st_size
    vit3, fusion3, _, _ = checkpoint.load(small, decoder=fingerprint)
    for a, b in ((vit.state_dict(), vit3.state_dict()), (fusion.state_dict(), fusion3.state_dict())):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k].dtype == torch.float32 and torch.equal(a[k].half().float(), b[k]), k

    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other), metadata={"format": "something-else"})
    with pytest.raises(ValueError, match="not a docfuse fusion checkpoint"):
        checkpoint.read_meta(other)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(ValueError, match="not a safetensors file"):
        checkpoint.read_meta(garbage)
    with pytest.raises(ValueError, match="not a docfuse fusion checkpoint"):
        checkpoint.load(other)

    with pytest.raises(ValueError) as refused:
        checkpoint.load(path, decoder="other")
    assert fingerprint in str(refused.value) and "'other'" in str(refused.value)


# ---------------------------------------------------------------- 6. the objective

@pytest.mark.slow
def test_choose_mask_never_masks_the_first_or_boxless_tokens(decoder) -> None:
    _, tok = decoder
    _, boxes = page_tensors(tok, FOOTER_TEXT, FOOTER_WORDS)
    before = boxes.clone()
    eligible = ~no_box(boxes)
    eligible[0] = False
    assert not no_box(boxes)[0]  # the first token has a box: only the rule keeps it visible
    full = choose_mask(boxes, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(full, eligible)
    assert not choose_mask(boxes, 0.0, torch.Generator().manual_seed(0)).any()
    for seed in range(20):
        mask = choose_mask(boxes, 0.5, torch.Generator().manual_seed(seed))
        assert not mask[0] and not (mask & no_box(boxes)).any()
    assert torch.equal(choose_mask(boxes, 0.5, torch.Generator().manual_seed(3)),
                       choose_mask(boxes, 0.5, torch.Generator().manual_seed(3)))
    assert torch.equal(boxes, before)


def _two_pages(tok):
    a = PageTensors(*page_tensors(tok, FOOTER_TEXT, FOOTER_WORDS), caption=False)
    b = PageTensors(*page_tensors(tok, "Total: $4,218.07 due", WORDS[:3]), caption=False)
    assert len(b.ids) < len(a.ids)  # the second page is padded in the batch
    masks = []
    for page in (a, b):
        mask = ~no_box(page.boxes) & (torch.arange(len(page.ids)) % 3 == 1)
        mask[0] = False
        assert mask.any()
        masks.append(mask)
    gen = torch.Generator().manual_seed(0)
    return [a, b], masks, torch.randn(2, ROWS * COLS, 64, generator=gen), torch.stack([bottom_ink()] * 2)


@pytest.mark.slow
def test_batch_streams_targets_rows_and_mask_embedding(decoder) -> None:
    model, tok = decoder
    embed = model.get_input_embeddings()
    pages, masks, feats, inks = _two_pages(tok)
    patch_boxes = patch_grid_boxes(ROWS, COLS)
    fusion = tiny_fusion()
    with torch.no_grad():
        outs = batch_streams(fusion, embed, pages, feats, patch_boxes, inks, masks)
    assert len(outs) == 2
    for page, mask, out in zip(pages, masks, outs):
        n = len(page.ids)
        assert out.stream.embeds.shape == (n, HIDDEN) and not out.stream.visual.any()  # no padding rows
        assert torch.equal(out.targets, page.ids[1:])  # targets[k] == ids[k+1]
        assert torch.equal(out.rows, out.stream.text_index[:-1])  # predicted from the previous token's row
        assert torch.equal(out.hidden, mask[1:])
        rows = out.stream.embeds[out.stream.text_index]
        assert torch.equal(rows[mask], fusion.mask_embedding.detach().expand(int(mask.sum()), -1))
        with torch.no_grad():
            assert torch.equal(rows[~mask], embed(page.ids)[~mask])

    # with visual tokens in the stream: the row that predicts a token is the one right before it in the stream,
    # the previous text token's row, or the last visual token put between the two
    with torch.no_grad():
        fusion.visual_gate.fill_(0.5)
        outs = batch_streams(fusion, embed, pages, feats, patch_boxes, inks, masks)
    for page, mask, out in zip(pages, masks, outs):
        stream = out.stream
        assert torch.equal(out.targets, page.ids[1:]) and torch.equal(out.hidden, mask[1:])
        assert torch.equal(out.rows, stream.text_index[1:] - 1)
        between = stream.visual[out.rows]
        assert torch.equal(out.rows[~between], stream.text_index[:-1][~between])
        rows = stream.embeds[stream.text_index]
        assert torch.equal(rows[mask], fusion.mask_embedding.detach().expand(int(mask.sum()), -1))
    first, second = outs
    footer = int(torch.nonzero(pages[0].boxes[:, 1] > 900)[0])
    assert int(first.stream.visual.sum()) == 2 and bool(first.stream.visual[first.rows[footer - 1]])
    assert torch.nonzero(second.stream.visual).flatten().tolist() == [len(pages[1].ids), len(pages[1].ids) + 1]


@pytest.mark.slow
def test_batch_streams_pages_do_not_leak_into_each_other(decoder) -> None:
    model, tok = decoder
    embed = model.get_input_embeddings()
    pages, masks, feats, inks = _two_pages(tok)
    patch_boxes = patch_grid_boxes(ROWS, COLS)
    fusion = tiny_fusion()
    with torch.no_grad():
        fusion.cross.attn_gate.fill_(0.5)
        fusion.cross.mlp_gate.fill_(0.5)
        both = batch_streams(fusion, embed, pages, feats, patch_boxes, inks, masks)
        for b in range(2):
            alone = batch_streams(fusion, embed, [pages[b]], feats[b:b + 1], patch_boxes, inks[b:b + 1], [masks[b]])[0]
            torch.testing.assert_close(both[b].stream.embeds, alone.stream.embeds, rtol=1e-5, atol=1e-5)
            assert torch.equal(both[b].rows, alone.rows) and torch.equal(both[b].targets, alone.targets)
    unmasked = ~masks[0] & ~no_box(pages[0].boxes)
    with torch.no_grad():
        moved = both[0].stream.embeds[both[0].stream.text_index][unmasked] - embed(pages[0].ids)[unmasked]
    assert bool((moved.abs().amax(-1) > 0).all())  # the open gates did change the boxed tokens


# ---------------------------------------------------------------- 7. end to end, tiny

@pytest.fixture(scope="module")
def synthetic_pages(decoder, tmp_path_factory: pytest.TempPathFactory):
    from docfuse.stages.training_pages import read_pages
    from docfuse.fusion.prepare import prepare
    from docfuse.fusion.synth import make_pdf

    _, tok = decoder
    made = make_pdf(tmp_path_factory.mktemp("fusion") / "a.pdf", seed=1, pages=2)
    samples = read_pages([made["path"]], SPEC.image_size, (ROWS, COLS))
    assert len(samples) == 2
    return [p for s in samples if (p := prepare(s, tok, 64)) is not None]


@pytest.mark.slow
def test_end_to_end_eval_then_a_training_step(decoder, synthetic_pages) -> None:
    from docfuse.fusion.train import TrainConfig, train

    model, _ = decoder
    pages = synthetic_pages
    assert pages and all(len(p.tokens.ids) <= 64 and p.ink.shape == (ROWS * COLS,) for p in pages)
    assert all(p.pixels.shape == (*SPEC.image_size, 3) and p.pixels.dtype == torch.uint8 for p in pages)

    vit, fusion = untrained(SPEC, hidden=HIDDEN)
    vit.eval(), fusion.eval()
    report = masked_recovery(model, vit, fusion, pages)
    assert report["pages"] >= 1 and report["masked_tokens"] > 0
    assert report["masked_recovery_fused"] == report["masked_recovery_text_only"]
    assert report["visible_top1_fused"] == report["visible_top1_text_only"]
    assert report["gates"] == {"attention": 0.0, "mlp": 0.0, "visual_tokens": 0.0}

    embedding = model.get_input_embeddings().weight.detach().clone()
    logs: list[str] = []
    vit2, fusion2, history = train(model, pages, TrainConfig(steps=2, batch_pages=2, warmup=1), vision=SPEC,
                                   log=logs.append)
    assert not vit2.training and not fusion2.training
    assert history and history[0]["step"] == 1 and np.isfinite(history[0]["loss"]) and logs
    assert any(g != 0.0 for g in fusion2.gates().values()), fusion2.gates()
    assert torch.equal(model.get_input_embeddings().weight, embedding), "the decoder stays frozen"


@pytest.mark.slow
def test_train_runs_the_configured_number_of_steps(decoder, synthetic_pages) -> None:
    from docfuse.fusion.train import TrainConfig, train

    model, _ = decoder
    _, fusion, history = train(model, synthetic_pages, TrainConfig(steps=1, batch_pages=1, warmup=1), vision=SPEC,
                               log=lambda _: None)
    assert [h["step"] for h in history if "loss" in h] == [1]
    assert any(g != 0.0 for g in fusion.gates().values())


@pytest.mark.slow
def test_reading_logits_score_each_boxed_row_against_its_next_token(decoder, synthetic_pages) -> None:
    from docfuse.fusion.objective import reading_logits

    model, _ = decoder
    embed = model.get_input_embeddings()
    vit, fusion = untrained(SPEC, hidden=HIDDEN)
    fusion.train()
    page = next(p for p in synthetic_pages if not p.tokens.caption)
    ids, boxes = page.tokens.ids, page.tokens.boxes
    mask = torch.zeros(len(ids), dtype=torch.bool)
    with torch.no_grad():
        feats = torch.randn(1, ROWS * COLS, 64)
        logits, targets = reading_logits(fusion, embed, [page.tokens], feats, patch_grid_boxes(ROWS, COLS), [mask])
    both = (boxes[:-1, 2] >= 0) & (boxes[1:, 2] >= 0)
    assert logits.shape == (int(both.sum()), embed.weight.shape[0])
    assert torch.equal(targets, ids[1:][both])
    sub, sub_targets = reading_logits(fusion, embed, [page.tokens], feats, patch_grid_boxes(ROWS, COLS), [mask],
                                      max_rows=3, generator=torch.Generator().manual_seed(0))
    assert sub.shape[0] == 3 and set(sub_targets.tolist()) <= set(targets.tolist())


@pytest.mark.slow
def test_reading_phase_trains_the_reader_and_leaves_the_gates_shut(decoder, synthetic_pages) -> None:
    from docfuse.fusion.train import TrainConfig, train

    model, _ = decoder
    vit0, _ = untrained(SPEC, hidden=HIDDEN)
    config = TrainConfig(steps=2, batch_pages=2, read_batch_pages=2, warmup=1, read_share=1.0)
    vit, fusion, history = train(model, synthetic_pages, config, vision=SPEC, log=lambda _: None,
                                 eval_pages=synthetic_pages[:2])
    assert [h["phase"] for h in history if "loss" in h] == ["reading"]
    assert fusion.gates() == {"attention": 0.0, "mlp": 0.0, "visual_tokens": 0.0}
    assert not torch.equal(vit.patch_embed.proj.weight, vit0.patch_embed.proj.weight), "the ViT learned"
    final = history[-1]["reading_eval"]
    assert final["rows"] > 0 and 0.0 <= final["reading_top1"] <= 1.0

    config = TrainConfig(steps=4, batch_pages=2, read_batch_pages=2, warmup=1, read_share=0.5)
    _, fusion, history = train(model, synthetic_pages, config, vision=SPEC, log=lambda _: None,
                               eval_pages=synthetic_pages[:2])
    assert sum("reading_eval" in h for h in history) == 2  # at the switch and at the end
    assert any(g != 0.0 for g in fusion.gates().values()), "the full phase opens the gates"
    with pytest.raises(ValueError, match="read_share"):
        train(model, synthetic_pages, TrainConfig(steps=1, read_share=1.5), vision=SPEC, log=lambda _: None)


def test_a_fusion_without_the_mlp_branch_trains_saves_and_loads(tmp_path) -> None:
    vit, fusion = checkpoint.untrained(SPEC, HIDDEN, mlp_hidden=0)
    assert fusion.cross.mlp is None
    x, boxes = torch.randn(5, HIDDEN), torch.tensor([[10.0, 10, 50, 30]] * 4 + [[-1.0] * 4])
    feats = torch.randn(ROWS * COLS, 64)
    patch_boxes = patch_grid_boxes(ROWS, COLS)
    fusion.eval()
    assert torch.equal(fusion.fuse_page(x, boxes, feats, patch_boxes).embeds, x)
    with torch.no_grad():
        fusion.cross.attn_gate.fill_(0.5)
    y = fusion.fuse_page(x, boxes, feats, patch_boxes).embeds
    assert not torch.equal(y[:4], x[:4]) and torch.equal(y[4], x[4])
    path = checkpoint.save(tmp_path / "f.safetensors", vit, fusion, SPEC, "d", dtype=torch.float32)
    _, back, _, _ = checkpoint.load(path)
    assert back.cross.mlp is None and torch.equal(back.fuse_page(x, boxes, feats, patch_boxes).embeds, y)


def _char_boxes_per_word(text, words, page_width, page_height):
    """The straightforward form of fusion.tokens.char_boxes: one linspace per word."""
    from docfuse.fusion.tokens import GRID, align_words

    boxes = np.full((len(text), 4), -1.0, dtype=np.float32)
    sx, sy = GRID / float(page_width), GRID / float(page_height)
    for start, end, index in align_words(text, words):
        w = words[index]
        edges = np.linspace(w.x0, w.x1, end - start + 1, dtype=np.float64) * sx
        boxes[start:end, 0], boxes[start:end, 2] = edges[:-1], edges[1:]
        boxes[start:end, 1], boxes[start:end, 3] = w.y0 * sy, w.y1 * sy
    return np.clip(boxes, -1.0, GRID)


def _span_boxes_per_token(chars, offsets):
    out = np.full((len(offsets), 4), -1.0, dtype=np.float32)
    for t, (start, end) in enumerate(offsets):
        part = chars[start:end]
        part = part[part[:, 2] >= 0]
        if len(part):
            out[t] = (part[:, 0].min(), part[:, 1].min(), part[:, 2].max(), part[:, 3].max())
    return out


def test_vectorised_token_boxes_equal_the_per_word_and_per_token_forms_bit_for_bit() -> None:
    from docfuse.fusion.tokens import Word, char_boxes, span_boxes

    rng = np.random.default_rng(3)
    vocab = ["alpha", "b", "Total", "12,500.00", "x", "overlong-hyphenated", "€", "Ω"]
    for trial in range(40):
        picked = rng.choice(vocab, size=int(rng.integers(0, 30)))
        text = " ".join(picked) + ("\n| tail |" if trial % 3 else "")
        words, x = [], 10.0
        for w in picked:
            width = float(rng.uniform(0, 90)) * (trial % 5 != 0 or len(words) % 2)  # zero-width words too
            y = float(rng.uniform(-5, 800))
            words.append(Word(w, x, y, x + width, y + float(rng.uniform(1, 20))))
            x = float(rng.uniform(-20, 640))  # some boxes run off the page: clipping
        if trial % 4 == 1:
            words.append(Word("missing", 1, 1, 2, 2))
        chars = char_boxes(text, words, 612.0, 792.0)
        assert np.array_equal(chars, _char_boxes_per_word(text, words, 612.0, 792.0))
        cuts = np.sort(rng.integers(0, len(text) + 3, size=(int(rng.integers(0, 40)), 2)), axis=1)
        offsets = [tuple(map(int, c)) for c in cuts] + [(0, 0), (len(text), len(text))]
        assert np.array_equal(span_boxes(chars, offsets), _span_boxes_per_token(chars, offsets))
    assert span_boxes(np.zeros((0, 4), np.float32), [(0, 0)]).tolist() == [[-1.0] * 4]
    assert span_boxes(np.zeros((5, 4), np.float32), []).shape == (0, 4)


def test_a_windowed_sam_vit_gives_row_major_patch_features_and_a_json_safe_spec(tmp_path) -> None:
    """The shipped vision (samvit, windowed attention) returns a [B, D, rows, cols] map, not tokens: it must come out
    as [B, P, D] in patch_grid's row-major order, and its list-valued args must survive the checkpoint's JSON."""
    import json

    from docfuse.fusion.encoder import patch_tokens
    from docfuse.stages.vision_model import as_args, geometry

    args = {"depth": 1, "embed_dim": 32, "num_heads": 1, "window_size": 4, "global_attn_indexes": [],
            "use_rel_pos": False, "neck_chans": 0}
    spec = VisionSpec("samvit_base_patch16", json.loads(json.dumps(args)), (128, 96))
    assert spec.grid == (ROWS, COLS)
    geo = geometry(spec.model, spec.image_size, as_args(spec.args))
    assert (geo.rows, geo.cols, geo.dim, geo.prefix_tokens) == (ROWS, COLS, 32, 0)
    vit, fusion = untrained(spec, HIDDEN)
    x = torch.randn(2, 3, 128, 96)
    with torch.no_grad():
        feature_map = vit.forward_features(x)                      # [B, D, rows, cols]
        tokens = patch_tokens(vit, x)
    assert tokens.shape == (2, ROWS * COLS, 32)
    assert torch.equal(tokens[1, 2 * COLS + 5], feature_map[1, :, 2, 5])  # patch (row 2, col 5)
    path = checkpoint.save(tmp_path / "sam.safetensors", vit, fusion, spec, "llama:test")
    vit2, _, spec2, _ = checkpoint.load(path)
    assert spec2.model == spec.model and spec2.grid == (ROWS, COLS)
    with torch.no_grad():
        assert torch.allclose(patch_tokens(vit2, x), tokens, atol=5e-2)  # fp16 weights
