"""Can a row's input carry "the next token is t" to a frozen causal decoder? A learnt-map ceiling.

bench/experiments/diag_fusion_oracle.py shows that adding the true embedding of token j at row j - 1 (what the fusion's
reading phase teaches its read to be) makes the decoder worse at naming token j: it reads the row as token j
and predicts what follows it. Here a linear map ``A`` (576 x 576, plus a bias) is learnt so that adding
``A @ E[t_j] + b`` at row j - 1 makes the frozen decoder predict t_j, from the true next token (a perfect
reader). Learnt on training PDFs' pages, measured on held-out pages: if even a perfect reader through the best
linear steering map gains little, the input-side route at the row before a hidden token is closed and the
image has to reach the decoder another way (the page's text as a prefix it copies from: copy_prefix).

    .venv/bin/python bench/experiments/diag_fusion_steering.py --train PDF_OR_DIR... --eval PDF_OR_DIR... [--steps 60]
    # pages read once here (token ids and boxes only), the learning where a GPU is:
    .venv/bin/python bench/experiments/diag_fusion_steering.py --train ... --eval ... --save-pages pages.pt
    python bench/experiments/diag_fusion_steering.py --pages-file pages.pt --model SmolLM2-135M-Instruct.Q4_1.gguf --steps 1500
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import save  # noqa: E402
from docfuse.fusion import checkpoint  # noqa: E402
from docfuse.fusion.objective import choose_mask  # noqa: E402
from docfuse.stages.fuse import DEFAULT_CHECKPOINT  # noqa: E402


def steered(decoder, mask_vector, steer: torch.nn.Linear | None, ids: torch.Tensor, hidden: torch.Tensor):
    """(logits at the rows before hidden tokens [N, vocab], the hidden tokens [N]) for one page."""
    embed = decoder.get_input_embeddings()
    with torch.no_grad():
        true = embed(ids)
    x = torch.where(hidden.unsqueeze(-1), mask_vector.detach(), true)
    rows = hidden.nonzero().squeeze(-1)
    if steer is not None:
        x = x.index_add(0, rows - 1, steer(true[rows]))
    logits = decoder(inputs_embeds=x.unsqueeze(0)).logits[0]
    return logits[rows - 1], ids[rows]


def load_pages(args, tok, vision) -> tuple[list, list]:
    """(training pages, held-out pages) as PageTensors, from PDFs or from a ``--save-pages`` file."""
    if args.pages_file:
        saved = torch.load(args.pages_file, weights_only=False)
        return saved["train"], saved["eval"]
    from docfuse.fusion.run import pdf_files, prepared, read_many  # PyMuPDF: not needed with --pages-file

    text = lambda paths: [p.tokens for p in prepared(read_many(pdf_files(paths), vision), tok) if not p.tokens.caption]
    return text(args.train), text(args.eval)[:args.eval_pages]


def evaluate(decoder, mask_vector, steer, pages, rate: float) -> dict:
    hits = {"text_only": 0, "steered": 0}
    n = 0
    with torch.no_grad():
        for i, page in enumerate(pages):
            mask = choose_mask(page.boxes, rate, torch.Generator().manual_seed(1234 + i))
            if not mask.any():
                continue
            for name, s in (("text_only", None), ("steered", steer)):
                logits, targets = steered(decoder, mask_vector, s, page.ids.to(mask_vector.device),
                                          mask.to(mask_vector.device))
                hits[name] += int((logits.argmax(-1) == targets).sum())
            n += int(mask.sum())
    return {k: round(v / max(n, 1), 4) for k, v in hits.items()} | {"tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", nargs="*", default=[])
    ap.add_argument("--eval", nargs="*", default=[])
    ap.add_argument("--save-pages", type=Path, help="write the pages' token ids and boxes here and stop")
    ap.add_argument("--pages-file", type=Path, help="pages from --save-pages instead of PDFs")
    ap.add_argument("--model", default="default", help="decoder: default, or a .gguf / folder (on a GPU machine)")
    ap.add_argument("--steer", choices=["linear", "mlp"], default="linear")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="tokens of a training page used")
    ap.add_argument("--eval-pages", type=int, default=16)
    ap.add_argument("--mask-rate", type=float, default=0.15)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model == "default":
        from docfuse.runtime.loading import load_model

        decoder, tok = load_model("default", dtype="float32", device="cpu")
    else:
        from docfuse.fusion.run import load_decoder
        decoder, tok = load_decoder(args.model, device)
        decoder = decoder.float()
    for p in decoder.parameters():
        p.requires_grad_(False)
    _, fusion, vision, _ = checkpoint.load(Path(__file__).resolve().parents[2] / DEFAULT_CHECKPOINT, device=device)
    train_pages, eval_pages = load_pages(args, tok, vision)
    if args.save_pages:
        torch.save({"train": train_pages, "eval": eval_pages}, args.save_pages)
        print(f"{len(train_pages)} training and {len(eval_pages)} held-out pages -> {args.save_pages}")
        return
    hidden = decoder.config.hidden_size
    steer = torch.nn.Linear(hidden, hidden) if args.steer == "linear" else torch.nn.Sequential(
        torch.nn.Linear(hidden, 2048), torch.nn.GELU(), torch.nn.Linear(2048, hidden))
    last = steer if args.steer == "linear" else steer[-1]
    torch.nn.init.zeros_(last.weight), torch.nn.init.zeros_(last.bias)
    steer = steer.to(device)
    opt = torch.optim.AdamW(steer.parameters(), lr=args.lr, weight_decay=0.0)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    before = evaluate(decoder, fusion.mask_embedding, steer, eval_pages, args.mask_rate)
    print("before", before, flush=True)
    started, log = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        loss_sum, hits, n = 0.0, 0, 0
        for page in rng.sample(train_pages, min(args.batch, len(train_pages))):
            ids, boxes = page.ids[:args.tokens], page.boxes[:args.tokens]
            mask = choose_mask(boxes, args.mask_rate, gen)
            if not mask.any():
                continue
            logits, targets = steered(decoder, fusion.mask_embedding, steer, ids.to(device), mask.to(device))
            loss = F.cross_entropy(logits, targets, reduction="sum")
            loss.backward()
            loss_sum += float(loss.detach())
            hits += int((logits.argmax(-1) == targets).sum())
            n += len(targets)
        for p in steer.parameters():
            p.grad /= max(n, 1)
        opt.step()
        log.append({"step": step, "loss": round(loss_sum / max(n, 1), 4), "top1": round(hits / max(n, 1), 4)})
        if step % max(args.steps // 20, 1) == 0:
            print(log[-1], f"{time.perf_counter() - started:.0f} s", flush=True)
    after = evaluate(decoder, fusion.mask_embedding, steer, eval_pages, args.mask_rate)
    print("after", after, flush=True)
    print("->", save("fusion_steering", {
        "held_out_before": before, "held_out_after": after, "train_pages": len(train_pages), "steer": args.steer,
        "eval_pages": len(eval_pages), "log": log, "seconds": round(time.perf_counter() - started, 1),
        "command": "python bench/experiments/diag_fusion_steering.py " + " ".join(sys.argv[1:])}))


if __name__ == "__main__":
    main()
