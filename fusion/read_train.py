"""Train the read path: the word reader (CTC on word crops), then the steering map behind it (frozen decoder).

1. ``train_reader``: words of training pages (their boxes and text from the text layer: labels for free) are cut
   out of the page images and read with CTC. No decoder is involved.
2. ``train_steer``: the fusion's ``read_steer`` and ``read_gate`` learn, through the frozen decoder, to make the
   row before a hidden token predict the token the reader read there (the masked-token objective, with the
   reader's real reads, mistakes and all). Nothing else in the fusion or its ViT changes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from docfuse.fusion.config import ReaderTrainConfig, SteerTrainConfig
from docfuse.fusion.features import encode
from docfuse.fusion.model import Fusion, FusionConfig
from docfuse.fusion.objective import batch_streams, choose_mask, pad_streams
from docfuse.fusion.prepare import Prepared, patch_grid_boxes
from docfuse.fusion.train import warmup_cosine
from docfuse.fusion.reader import (ReaderConfig, WordReader, ctc_loss, decode, group_boxes, group_texts,
                           ink_image, read_tokens, word_crops, word_groups)


@dataclass
class PageWords:
    """The words of one page: its pixels, word boxes [G, 4] (grid) and their texts."""

    pixels: torch.Tensor
    boxes: torch.Tensor
    texts: list[str]


def page_words(pages: Sequence[Prepared], tokenizer: Any, max_chars: int = 60) -> list[PageWords]:
    """Each text page's word groups (fusion.reader.word_groups) with their text; words the reader cannot spell
    within its columns (longer than ``max_chars``) or that are empty are left out."""
    out = []
    for p in pages:
        if p.tokens.caption:
            continue
        boxes = p.tokens.boxes.numpy()
        group = word_groups(boxes)
        texts = group_texts(tokenizer, p.tokens.ids.numpy(), group)
        keep = [i for i, t in enumerate(texts) if 0 < len(t) <= max_chars]
        if keep:
            out.append(PageWords(p.pixels, torch.from_numpy(group_boxes(boxes, group)[keep]), [texts[i] for i in keep]))
    return out


def train_reader(words: Sequence[PageWords], config: ReaderTrainConfig, device: str | torch.device = "cpu",
                 reader_config: ReaderConfig = ReaderConfig(), log: Callable[[str], None] = print,
                 eval_words: Sequence[PageWords] = ()) -> tuple[WordReader, list[dict]]:
    """A word reader trained with CTC on ``words``; the log reports exact-word accuracy on ``eval_words``."""
    if not words:
        raise ValueError("no words to train the reader on: give pages with a text layer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        reader = WordReader(reader_config)
    reader = reader.to(device).train()
    opt = torch.optim.AdamW(reader.parameters(), lr=config.lr, weight_decay=0.01)
    rng, gen = random.Random(config.seed), torch.Generator().manual_seed(config.seed)
    autocast = torch.autocast("cuda", torch.bfloat16) if torch.device(device).type == "cuda" else nullcontext()
    history, started, step = [], time.perf_counter(), 0
    per_page = max(1, config.batch_words // config.pages_per_step)
    while True:
        done = (time.perf_counter() - started) / config.time_budget_s if config.time_budget_s else step / config.steps
        if done >= 1.0:
            break
        step += 1
        for g in opt.param_groups:
            g["lr"] = config.lr * warmup_cosine(step, done, config.warmup)
        crops, labels = [], []
        for page in rng.sample(list(words), min(config.pages_per_step, len(words))):
            pick = torch.randperm(len(page.texts), generator=gen)[:per_page]
            boxes = page.boxes[pick] + (torch.rand((len(pick), 4), generator=gen) * 2 - 1) * config.jitter
            crops.append(word_crops(ink_image(page.pixels.to(device)), boxes, reader_config))
            labels += [page.texts[int(i)] for i in pick]
        with autocast:
            logp = reader(torch.cat(crops))
        loss = ctc_loss(logp.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reader.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == 1:
            hits = sum(w == t for (w, _), t in zip(decode(logp.detach()), labels))
            history.append({"step": step, "loss": round(float(loss.detach()), 4), "word_acc": round(hits / len(labels), 4),
                            "elapsed_s": round(time.perf_counter() - started, 1)})
            log(str(history[-1]))
    reader.eval()
    if eval_words:
        history.append({"step": step, "held_out": reader_accuracy(reader, eval_words)})
        log(str(history[-1]))
    return reader, history


@torch.no_grad()
def reader_accuracy(reader: WordReader, words: Sequence[PageWords], batch: int = 512) -> dict:
    """Exact-word accuracy and character error rate (edit distance over characters) of ``reader`` on ``words``."""
    device = next(reader.parameters()).device
    hits = n = errors = chars = 0
    for page in words:
        ink = ink_image(page.pixels.to(device))
        for s in range(0, len(page.texts), batch):
            read = decode(reader(word_crops(ink, page.boxes[s:s + batch], reader.config)))
            for (w, _), t in zip(read, page.texts[s:s + batch]):
                hits += w == t
                errors += _edit_distance(w, t)
                chars += len(t)
                n += 1
    return {"word_acc": hits / max(n, 1), "char_error": errors / max(chars, 1), "words": n}


def _edit_distance(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def with_read_path(fusion: Fusion, read_hidden: int, seed: int = 0) -> Fusion:
    """A copy of ``fusion`` with a fresh read path (``read_hidden`` wide, gate at 0): the same stream as before.

    The steering map's last layer starts small, not zero: with the gate at 0 as well, neither would ever move."""
    config = FusionConfig(**(fusion.config.to_dict() | {"read_hidden": read_hidden}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = Fusion(config)
        torch.nn.init.normal_(out.read_steer[-1].weight, std=1e-3)
        torch.nn.init.zeros_(out.read_steer[-1].bias)
    state = {k: v for k, v in fusion.state_dict().items() if not k.startswith("read_")}
    missing, unexpected = out.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("read_") for k in missing), (missing, unexpected)
    return out.to(next(fusion.parameters()).device)


def train_steer(decoder: Any, tokenizer: Any, vit: Any, fusion: Fusion, reader: WordReader,
                pages: Sequence[Prepared], config: SteerTrainConfig,
                log: Callable[[str], None] = print) -> tuple[Fusion, list[dict]]:
    """Train ``fusion.read_steer`` and ``fusion.read_gate`` only (all else frozen) on ``pages``' text pages."""
    if fusion.read_steer is None:
        raise ValueError("the fusion has no read path; add one with with_read_path(fusion, width)")
    device = next(decoder.parameters()).device
    for module in (decoder, vit, reader):
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
    trainable = list(fusion.read_steer.parameters()) + [fusion.read_gate]
    for p in fusion.parameters():
        p.requires_grad_(any(p is q for q in trainable))
    fusion.train()
    opt = torch.optim.AdamW([{"params": list(fusion.read_steer.parameters()), "lr": config.lr},
                             {"params": [fusion.read_gate], "lr": config.gate_lr, "weight_decay": 0.0}],
                            weight_decay=0.0)
    base = [g["lr"] for g in opt.param_groups]
    embed = decoder.get_input_embeddings()
    rows, cols = vit.patch_embed.grid_size
    patch_boxes = patch_grid_boxes(rows, cols).to(device)
    text_pages = [p for p in pages if not p.tokens.caption]
    rng, gen = random.Random(config.seed), torch.Generator().manual_seed(config.seed)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else nullcontext()
    history, started, step = [], time.perf_counter(), 0
    while True:
        done = (time.perf_counter() - started) / config.time_budget_s if config.time_budget_s else step / config.steps
        if done >= 1.0:
            break
        step += 1
        scale = warmup_cosine(step, done, config.warmup)
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * scale
        batch = rng.sample(text_pages, min(config.batch_pages, len(text_pages)))
        masks = [choose_mask(p.tokens.boxes, config.mask_rate, gen) for p in batch]
        with autocast:
            reads = [read_tokens(reader, tokenizer, p.pixels, p.tokens.ids, p.tokens.boxes, m).to(device)
                     for p, m in zip(batch, masks)]
            with torch.no_grad():
                feats = encode(vit, torch.stack([p.pixels for p in batch]))
            inks = torch.stack([p.ink for p in batch]).to(device)
            out = batch_streams(fusion, embed, [p.tokens for p in batch], feats, patch_boxes, inks,
                                [m.to(device) for m in masks], reads=reads)
            x, attn = pad_streams([o.stream.embeds for o in out])
            logits = decoder(inputs_embeds=x.to(embed.weight.dtype), attention_mask=attn).logits
        total, weights, hits, n_hidden = logits.new_zeros((), dtype=torch.float32), 0.0, 0, 0
        for b, o in enumerate(out):
            ce = F.cross_entropy(logits[b, o.rows].float(), o.targets, reduction="none")
            w = torch.full_like(ce, config.visible_weight)
            w[o.hidden] = 1.0
            total, weights = total + (ce * w).sum(), weights + float(w.sum())
            hits += int((logits[b, o.rows[o.hidden]].argmax(-1) == o.targets[o.hidden]).sum())
            n_hidden += int(o.hidden.sum())
        loss = total / max(weights, 1e-6)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        if step % 25 == 0 or step == 1:
            history.append({"step": step, "loss": round(float(loss.detach()), 4),
                            "hidden_top1": round(hits / max(n_hidden, 1), 4), "gates": fusion.gates(),
                            "elapsed_s": round(time.perf_counter() - started, 1)})
            log(str(history[-1]))
    fusion.cross.read = None
    for p in fusion.parameters():
        p.requires_grad_(True)
    return fusion.eval(), history
