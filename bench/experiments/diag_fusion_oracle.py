"""Ceilings of the routes by which a page image can reach a frozen causal decoder, with a perfect reader.

The fusion adds its read to input rows. A hidden token j is predicted at row j - 1, so to recover it the read
must enter at row j - 1 (or earlier). This probe replaces the learnt read by the truth to see whether the frozen
decoder can use each route at all, before any training is spent on it (a diagnosis, no checkpoint involved
beyond the mask vector):

- ``text_only``: hidden rows hold the mask vector; nothing else changes.
- ``next_embed_xA``: row j - 1 also gets A times the true embedding of token j added (what the reading phase
  teaches the read to be: the next token's embedding).
- ``own_row``: the hidden row j holds its own true embedding (a perfect read of its own box). It cannot help
  recover token j (a causal decoder never sees row j when predicting it) but repairs the context after it:
  reported as top-1 of the token after each hidden one.
- ``copy_prefix``: the page's true tokens as a prefix before the masked page (what visual tokens would have to
  carry); the decoder can copy from it.
- ``bigram_hint``: before row j - 1, two inserted rows hold the true embeddings of tokens j - 1 and j: a local
  "t(j-1) is followed by t(j)" that the decoder's copying can use, at two rows per hidden token.

    .venv/bin/python bench/experiments/diag_fusion_oracle.py [--pages N] PDF_OR_DIR...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import save  # noqa: E402
from docfuse.fusion import checkpoint  # noqa: E402
from docfuse.fusion.objective import choose_mask  # noqa: E402
from docfuse.fusion.run import pdf_files, prepared, read_many  # noqa: E402
from docfuse.runtime.loading import load_model  # noqa: E402
from docfuse.stages.fuse import DEFAULT_CHECKPOINT  # noqa: E402

SCALES = (0.5, 1.0, 2.0, 4.0)


@torch.no_grad()
def top1(decoder, x: torch.Tensor) -> torch.Tensor:
    """[N] top-1 token at each row of the stream ``x`` [N, H]."""
    return decoder(inputs_embeds=x.unsqueeze(0)).logits[0].argmax(-1)


@torch.no_grad()
def probe(decoder, mask_vector: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor) -> dict[str, tuple[int, int]]:
    """(right, counted) per route for one page: ``ids`` [T], ``hidden`` [T] bool."""
    embed = decoder.get_input_embeddings()
    true = embed(ids)
    masked = torch.where(hidden.unsqueeze(-1), mask_vector.to(true.dtype), true)
    rows = hidden.nonzero().squeeze(-1)            # hidden token j, predicted at row j - 1 (j >= 1 always)
    after = rows[rows + 1 < len(ids)]              # hidden token j whose next token j + 1 exists
    out: dict[str, tuple[int, int]] = {}
    plain = top1(decoder, masked)
    out["text_only"] = (int((plain[rows - 1] == ids[rows]).sum()), len(rows))
    out["text_only_after_hidden"] = (int((plain[after] == ids[after + 1]).sum()), len(after))
    for a in SCALES:
        x = masked.clone()
        x[rows - 1] += a * true[rows]
        out[f"next_embed_x{a:g}"] = (int((top1(decoder, x)[rows - 1] == ids[rows]).sum()), len(rows))
    own = top1(decoder, true)  # every hidden row holds its own true embedding: the unmasked page
    out["own_row"] = (int((own[rows - 1] == ids[rows]).sum()), len(rows))
    out["own_row_after_hidden"] = (int((own[after] == ids[after + 1]).sum()), len(after))
    n = len(ids)
    copy = top1(decoder, torch.cat([true, masked]))[n:]
    out["copy_prefix"] = (int((copy[rows - 1] == ids[rows]).sum()), len(rows))
    x, at = [], 0
    for j in rows.tolist():  # hints before row j - 1 (its own token, as the page has it, then token j)
        x += [masked[at:j - 1], true[j - 1:j + 1]]
        at = j - 1
    x.append(masked[at:])
    stream = torch.cat(x)
    shift = 2 * torch.arange(1, len(rows) + 1)   # row j - 1 moved down by two rows per hint up to and including its own
    hint = top1(decoder, stream)[rows - 1 + shift]
    out["bigram_hint"] = (int((hint == ids[rows]).sum()), len(rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pdfs", nargs="+")
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--mask-rate", type=float, default=0.15)
    args = ap.parse_args()
    decoder, tok = load_model("default", dtype="float32", device="cpu")
    _, fusion, vision, _ = checkpoint.load(Path(__file__).resolve().parents[2] / DEFAULT_CHECKPOINT)
    pages = [p for p in prepared(read_many(pdf_files(args.pdfs), vision), tok) if not p.tokens.caption]
    totals: dict[str, list[int]] = {}
    used = 0
    for i, page in enumerate(pages[:args.pages]):
        mask = choose_mask(page.tokens.boxes, args.mask_rate, torch.Generator().manual_seed(1234 + i))
        if not mask.any():
            continue
        for name, (right, n) in probe(decoder, fusion.mask_embedding, page.tokens.ids, mask).items():
            t = totals.setdefault(name, [0, 0])
            t[0] += right
            t[1] += n
        used += 1
        print(i, {k: round(r / max(n, 1), 3) for k, (r, n) in totals.items()}, flush=True)
    result = {k: {"top1": round(r / max(n, 1), 4), "tokens": n} for k, (r, n) in totals.items()}
    print("->", save("fusion_oracle", {"routes": result, "pages": used, "mask_rate": args.mask_rate,
                                       "pdfs": [str(p) for p in pdf_files(args.pdfs)],
                                       "command": "python bench/experiments/diag_fusion_oracle.py " + " ".join(sys.argv[1:])}))


if __name__ == "__main__":
    main()
