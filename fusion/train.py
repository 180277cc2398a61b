"""Train the fusion (and its ViT) against a frozen decoder: masked-token recovery plus captions (fusion.objective).

Only the ViT and the fusion learn; the decoder's weights never change. Pages come from PDFs: the project's own
synthetic ones (fusion.synth) and any real ones given. A fixed share of pages is held out for the report.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from docfuse.fusion.checkpoint import VisionSpec, untrained
from docfuse.fusion.config import TrainConfig
from docfuse.fusion.evaluate import masked_recovery
from docfuse.fusion.features import encode
from docfuse.fusion.model import Fusion
from docfuse.fusion.objective import PageTargets, batch_streams, choose_mask, pad_streams, reading_logits
from docfuse.fusion.prepare import Prepared, patch_grid_boxes

#: The default vision encoder: a small ViT that reads a 96-dpi page at 1024x768 (16-px patches, 64x48 grid).
#: A 3-layer ViT at 1024x768 (3072 patches of 16 px, a page at about 96 dpi). Attention stays within windows of
#: 16x16 patches (256x256 px, a paragraph): global attention over 3072 patches was most of a CPU page's time.
DEFAULT_VISION = VisionSpec("samvit_base_patch16", {"depth": 3, "embed_dim": 128, "num_heads": 2, "window_size": 16,
                                                    "global_attn_indexes": [], "use_rel_pos": False,
                                                    "neck_chans": 0}, (1024, 768), 96.0)


def warmup_cosine(step: int, done: float, warmup: int) -> float:
    """Learning-rate scale: linear warm-up over ``warmup`` steps, then cosine decay over the share ``done`` (0..1)."""
    return min(1.0, step / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))


def train(decoder: Any, pages: Sequence[Prepared], config: TrainConfig, vision: VisionSpec = DEFAULT_VISION,
          log: Callable[[str], None] = print, eval_pages: Sequence[Prepared] = (),
          eval_every: int = 0) -> tuple[Any, Fusion, list[dict]]:
    """The trained ViT and fusion (on the decoder's device) and the log of losses and evaluations."""
    if not 0.0 <= config.read_share <= 1.0:
        raise ValueError(f"read_share {config.read_share}: give a share of the budget in [0, 1]")
    device = next(decoder.parameters()).device
    for p in decoder.parameters():
        p.requires_grad_(False)
    decoder.eval()
    vit, fusion = untrained(vision, decoder.config.hidden_size, config.seed, mlp_hidden=config.mlp_hidden)
    vit, fusion = vit.to(device).train(), fusion.to(device).train()
    embed = decoder.get_input_embeddings()
    rows, cols = vit.patch_embed.grid_size
    patch_boxes = patch_grid_boxes(rows, cols).to(device)
    gates = [fusion.cross.attn_gate, fusion.cross.mlp_gate, fusion.visual_gate]
    rest = [p for p in fusion.parameters() if all(p is not g for g in gates)]
    opt = torch.optim.AdamW([{"params": vit.parameters(), "lr": config.vit_lr},
                             {"params": rest, "lr": config.lr},
                             {"params": gates, "lr": config.gate_lr, "weight_decay": 0.0}], weight_decay=0.01)
    base = [g["lr"] for g in opt.param_groups]
    rng = random.Random(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else nullcontext()
    history, started = [], time.perf_counter()
    step, phase_start = 0, 1
    reading = config.read_share > 0
    while True:
        step += 1
        done = (time.perf_counter() - started) / config.time_budget_s if config.time_budget_s else (step - 1) / config.steps
        if done >= 1.0:
            break
        if reading and done >= config.read_share:
            reading, phase_start = False, step
            if eval_pages:
                with autocast:
                    history.append({"step": step, "reading_eval": reading_accuracy(vit, fusion, embed, eval_pages)})
                log(str(history[-1]))
        # each phase has its own warm-up and cosine decay over its share of the budget
        local = done / config.read_share if reading else \
            (done - config.read_share) / (1.0 - config.read_share) if config.read_share > 0 else done
        scale = warmup_cosine(step - phase_start + 1, local, config.warmup)
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * scale
        batch = rng.sample(list(pages), min(config.read_batch_pages if reading else config.batch_pages, len(pages)))
        with autocast:
            feats = encode(vit, torch.stack([p.pixels for p in batch]))
            masks = [choose_mask(p.tokens.boxes, config.mask_rate, gen) for p in batch]
            if reading:
                if all(p.tokens.caption for p in batch):
                    continue
                logits, targets = reading_logits(fusion, embed, [p.tokens for p in batch], feats, patch_boxes,
                                                 masks, config.read_rows, gen)
                loss = F.cross_entropy(logits, targets)
                hits, n_hidden = int((logits.argmax(-1) == targets).sum()), int(targets.numel())
            else:
                inks = torch.stack([p.ink for p in batch]).to(device)
                pages_out = batch_streams(fusion, embed, [p.tokens for p in batch], feats, patch_boxes, inks, masks)
                x, attn = pad_streams([p.stream.embeds for p in pages_out])
                logits = decoder(inputs_embeds=x.to(embed.weight.dtype), attention_mask=attn).logits
                loss, hits, n_hidden = objective_loss(logits, pages_out, [p.tokens.caption for p in batch], embed,
                                                      config)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(vit.parameters()) + list(fusion.parameters()), 1.0)
        opt.step()
        if step % 25 == 0 or step == 1:
            # reading phase: top-1 of the read itself over scored rows; then the decoder's over hidden tokens
            entry = {"step": step, "phase": "reading" if reading else "full", "loss": round(float(loss.detach()), 4),
                     "reading_top1" if reading else "hidden_top1": round(hits / max(n_hidden, 1), 4),
                     "gates": fusion.gates(), "elapsed_s": round(time.perf_counter() - started, 1)}
            history.append(entry)
            log(str(entry))
        if eval_every and eval_pages and step % eval_every == 0 and not reading:
            vit.eval(), fusion.eval()
            with autocast:
                report = masked_recovery(decoder, vit, fusion, eval_pages, mask_rate=config.mask_rate)
            vit.train(), fusion.train()
            history.append({"step": step, "eval": report})
            log(f"eval @ {step}: {report}")
    if eval_pages:
        with autocast:
            history.append({"step": step, "reading_eval": reading_accuracy(vit, fusion, embed, eval_pages)})
        log(str(history[-1]))
    fusion.cross.read = None  # the last step's activation, graph and all
    return vit.eval(), fusion.eval(), history


@torch.no_grad()
def reading_accuracy(vit: Any, fusion: Fusion, embed: torch.nn.Embedding, pages: Sequence[Prepared],
                     mask_rate: float = 0.15, seed: int = 1234) -> dict:
    """Top-1 of the ungated read alone over ``pages``' rows (objective.reading_logits): can the ViT read yet?"""
    device = embed.weight.device
    rows, cols = vit.patch_embed.grid_size
    patch_boxes = patch_grid_boxes(rows, cols).to(device)
    modes = vit.training, fusion.training
    vit.eval(), fusion.train()  # the fusion keeps its read only in training mode; it has no dropout
    hits = n = 0
    for i, page in enumerate(p for p in pages if not p.tokens.caption):
        mask = choose_mask(page.tokens.boxes, mask_rate, torch.Generator().manual_seed(seed + i))
        logits, targets = reading_logits(fusion, embed, [page.tokens], encode(vit, page.pixels.unsqueeze(0)),
                                         patch_boxes, [mask])
        hits, n = hits + int((logits.argmax(-1) == targets).sum()), n + int(targets.numel())
    fusion.cross.read = None
    vit.train(modes[0]), fusion.train(modes[1])
    return {"reading_top1": hits / max(n, 1), "rows": n}


def objective_loss(logits: torch.Tensor, pages: list[PageTargets], captions: list[bool], embed: torch.nn.Embedding,
                   config: TrainConfig) -> tuple[torch.Tensor, int, int]:
    """Weighted next-token loss over the batch plus the auxiliary read loss; (loss, hidden hits, hidden tokens).

    Hidden tokens weigh 1, visible ones ``visible_weight``, caption text ``caption_weight``. The auxiliary loss
    scores the cross-attention's ungated read at each hidden token's predicting row against the decoder's
    (tied) embedding table: it teaches the ViT to read before the gate has opened far enough for the decoder's
    own loss to reach it.
    """
    total, weight_sum, hits, n_hidden = logits.new_zeros((), dtype=torch.float32), 0.0, 0, 0
    aux, aux_n = logits.new_zeros((), dtype=torch.float32), 0
    for b, (page, caption) in enumerate(zip(pages, captions)):
        ce = F.cross_entropy(logits[b, page.rows].float(), page.targets, reduction="none")
        weight = torch.full_like(ce, config.caption_weight if caption else config.visible_weight)
        weight[page.hidden] = 1.0
        total = total + (ce * weight).sum()
        weight_sum += float(weight.sum())
        hits += int((logits[b, page.rows[page.hidden]].argmax(-1) == page.targets[page.hidden]).sum())
        n_hidden += int(page.hidden.sum())
        if page.read is not None and page.hidden.any():
            read = page.read[page.hidden].float() @ embed.weight.float().T
            aux = aux + F.cross_entropy(read, page.targets[page.hidden], reduction="sum")
            aux_n += int(page.hidden.sum())
    loss = total / max(weight_sum, 1e-6) + config.aux_weight * aux / max(aux_n, 1)
    return loss, hits, n_hidden


