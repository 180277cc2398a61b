"""Train and evaluate a fusion from PDF folders: what ``docfuse train-fusion`` and ``eval-fusion`` run.

Also runnable on its own (``python -m fusion.run train ...``) where only torch, timm, transformers and PyMuPDF
are installed, as on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fusion import checkpoint
from fusion.checkpoint import VisionSpec
from fusion.data import PageSample, read_pdf
from fusion.evaluate import masked_recovery
from fusion.prepare import Prepared, prepare
from fusion.train import DEFAULT_VISION, TrainConfig, train

MAX_TOKENS = 512  # tokens of a page used in training and evaluation (a page of prose is ~400-700)


def pdf_files(paths: Sequence[str | Path]) -> list[Path]:
    """PDFs under the given files and folders, sorted, so a run is reproducible."""
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(f for f in p.rglob("*") if f.suffix.lower() == ".pdf") if p.is_dir() else [p])
    return out


def _read(args: tuple) -> list[PageSample]:
    path, vision, truths = args
    try:
        return read_pdf(path, vision.image_size, vision.grid, vision.dpi, truths=truths)
    except Exception:  # noqa: BLE001 - an unreadable PDF (corrupt, encrypted) is left out of the data
        return []


def read_many(paths: Sequence[Path], vision: VisionSpec, truths: dict[str, list] | None = None,
              workers: int = 1) -> list[PageSample]:
    """Pages of many PDFs, read in ``workers`` processes."""
    jobs = [(str(p), vision, (truths or {}).get(str(p))) for p in paths]
    if workers <= 1:
        return [s for job in jobs for s in _read(job)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [s for pages in pool.map(_read, jobs, chunksize=4) for s in pages]


def prepared(samples: Sequence[PageSample], tokenizer: Any) -> list[Prepared]:
    return [p for s in samples if (p := prepare(s, tokenizer, MAX_TOKENS)) is not None]


def synthetic(n_docs: int, seed: int, out_dir: Path, workers: int = 1) -> tuple[list[Path], dict[str, list]]:
    """The project's own training PDFs (fusion.synth) and, per file, the known text of its scanned pages."""
    from fusion.synth import make_corpus

    made = make_corpus(out_dir, n_docs, seed=seed, workers=workers)
    return [Path(m["path"]) for m in made], {m["path"]: [pg["text"] for pg in m["pages"]] for m in made}


def train_from_pdfs(decoder: Any, tokenizer: Any, *, corpus: Sequence[str | Path], eval_corpus: Sequence[str | Path],
                    out: Path, config: TrainConfig, synthetic_docs: int = 0, vision: VisionSpec = DEFAULT_VISION,
                    workers: int = 1, command: str = "", log: Callable[[str], None] = print) -> dict:
    """Train on ``corpus`` (+ synthetic PDFs), report on ``eval_corpus`` (never trained on), write ``out``."""
    started = time.perf_counter()
    train_paths = pdf_files(corpus)
    truths: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if synthetic_docs:
            paths, truths = synthetic(synthetic_docs, config.seed, Path(tmp), workers)
            train_paths += paths
        held_out = {p.resolve() for p in pdf_files(eval_corpus)}
        train_paths = [p for p in train_paths if p.resolve() not in held_out]
        pages = prepared(read_many(train_paths, vision, truths, workers), tokenizer)
    eval_pages = prepared(read_many(sorted(held_out), vision, None, workers), tokenizer)
    log(f"{len(pages)} training pages from {len(train_paths)} PDFs, {len(eval_pages)} held-out pages; "
        f"read in {time.perf_counter() - started:.0f} s")
    if not pages:
        raise ValueError(f"no trainable page (with text) in {list(map(str, corpus))} or the synthetic set; "
                         "give PDFs with a text layer, or --synthetic N")
    vit, fusion, history = train(decoder, pages, config, vision, log=log, eval_pages=eval_pages[:48],
                                 eval_every=500)
    report = masked_recovery(decoder, vit, fusion, eval_pages, mask_rate=config.mask_rate) if eval_pages else {}
    checkpoint.save(out, vit, fusion, vision, checkpoint.decoder_fingerprint(decoder.config), command=command,
                    trained="true", train_pages=str(len(pages)), config=json.dumps(asdict(config)),
                    held_out=json.dumps({k: v for k, v in report.items() if k != "gates"}))
    summary = {"checkpoint": str(out), "train_pages": len(pages), "eval_pages": len(eval_pages),
               "eval_sources": sorted({p.source for p in eval_pages}), "held_out": report,
               "history": history, "seconds": round(time.perf_counter() - started, 1), "command": command}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    return summary


def evaluate_pdfs(decoder: Any, tokenizer: Any, ckpt: Path, pdfs: Sequence[str | Path], mask_rate: float = 0.15) -> dict:
    """``eval-fusion``'s JSON: masked recovery with the fusion and text-only on the pages of ``pdfs``."""
    device = str(next(decoder.parameters()).device)
    vit, fusion, vision, _ = checkpoint.load(ckpt, checkpoint.decoder_fingerprint(decoder.config), device=device)
    pages = prepared(read_many(pdf_files(pdfs), vision), tokenizer)
    if not pages:
        raise ValueError(f"none of {list(map(str, pdfs))} has a page with a text layer to mask; "
                         "eval-fusion measures masked-token recovery on text pages")
    return masked_recovery(decoder, vit, fusion, pages, mask_rate=mask_rate)


def pack(src: Path, out: Path) -> Path:
    """Re-save a checkpoint in fp16 with its training report's held-out figures in the metadata (what data/ ships)."""
    vit, fusion, vision, meta = checkpoint.load(src)
    report = src.with_suffix(".json")
    held = json.loads(report.read_text())["held_out"] if report.is_file() else {}
    # save() writes these itself; the rest (command, config, ...) is carried over
    extra = {k: v for k, v in meta.items() if k not in ("format", "fusion_config", "vision_model", "vision_args",
                                                          "image_size", "dpi", "decoder")}
    extra["held_out"] = json.dumps({k: v for k, v in held.items() if k != "gates"})
    return checkpoint.save(out, vit, fusion, vision, meta["decoder"], **extra)


def load_decoder(name: str, device: str) -> tuple[Any, Any]:
    """A causal LM (folder or .gguf) with transformers alone, in bf16 on CUDA, fp32 on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if path.suffix == ".gguf" else path
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).to(device)
    return model, AutoTokenizer.from_pretrained(folder, **kwargs)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fusion.run")
    ap.add_argument("verb", choices=["train", "pack"])
    ap.add_argument("src", nargs="?", type=Path, help="pack: the checkpoint to re-save")
    ap.add_argument("--model", help="decoder: a Hugging Face folder or a .gguf file")
    ap.add_argument("--corpus", nargs="*", default=[])
    ap.add_argument("--eval-corpus", nargs="*", default=[])
    ap.add_argument("--synthetic", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=None, help="training time budget (overrides --steps)")
    ap.add_argument("--mlp-hidden", type=int, default=1024, help="width of the gated MLP branch; 0 = none")
    ap.add_argument("--read-share", type=float, default=0.0,
                    help="share of the budget for the reading phase first (no decoder, no gate); 0 = none")
    ap.add_argument("--read-batch", type=int, default=32, help="pages per reading-phase step")
    args = ap.parse_args(argv)
    if args.verb == "pack":
        print(pack(args.src, args.out))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    decoder, tokenizer = load_decoder(args.model, device)
    config = TrainConfig(steps=args.steps, batch_pages=args.batch, seed=args.seed, mlp_hidden=args.mlp_hidden,
                         read_share=args.read_share, read_batch_pages=args.read_batch,
                         time_budget_s=args.minutes * 60 if args.minutes else None)
    summary = train_from_pdfs(decoder, tokenizer, corpus=args.corpus, eval_corpus=args.eval_corpus, out=args.out,
                              config=config, synthetic_docs=args.synthetic, workers=args.workers,
                              command="python -m fusion.run " + " ".join(sys.argv[1:] if argv is None else argv))
    print(json.dumps(summary["held_out"], indent=1))


if __name__ == "__main__":
    main()
