"""Train and evaluate a fusion from PDF folders: what ``docfuse train-fusion`` and ``eval-fusion`` run.

Also runnable on its own (``python -m docfuse.fusion.run train ...``) where only torch, timm, transformers and PyMuPDF
are installed, as on a lent GPU. Its options take their defaults from fusion.config, as fusion/cli.py's do.
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

from docfuse.fusion import checkpoint
from docfuse.fusion.checkpoint import VisionSpec
from docfuse.fusion.config import CORPUS, READER, STEER, TRAIN, ReaderTrainConfig, SteerTrainConfig, TrainConfig
from docfuse.fusion.data import PageSample
from docfuse.fusion.evaluate import masked_recovery
from docfuse.fusion.prepare import Prepared, prepare
from docfuse.fusion.read_train import page_words, train_reader, train_steer, with_read_path
from docfuse.fusion.train import DEFAULT_VISION, train

MAX_TOKENS = 512  # tokens of a page used in training and evaluation (a page of prose is ~400-700)
SHEET_TOKENS = 8192  # a word sheet's words all train the reader (random strings take many tokens)


def pdf_files(paths: Sequence[str | Path]) -> list[Path]:
    """PDFs under the given files and folders, sorted, so a run is reproducible."""
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(f for f in p.rglob("*") if f.suffix.lower() == ".pdf") if p.is_dir() else [p])
    return out


def _read(args: tuple) -> list[PageSample]:
    """One PDF's pages as the pipeline reads them (pdf_qa's pdf.open, pdf.text and pdf.render): one reading of a
    PDF for training and serving. A corrupt or locked PDF is an error row there and no page here."""
    from docfuse.stages.training_pages import read_pages  # the stages and the engine: only when reading PDFs

    path, vision, truths = args
    return read_pages([path], vision.image_size, vision.grid, vision.dpi, truths={path: truths} if truths else None)


def read_many(paths: Sequence[Path], vision: VisionSpec, truths: dict[str, list] | None = None,
              workers: int = 1) -> list[PageSample]:
    """Pages of many PDFs, read in ``workers`` processes."""
    jobs = [(str(p), vision, (truths or {}).get(str(p))) for p in paths]
    if workers <= 1:
        return [s for job in jobs for s in _read(job)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [s for pages in pool.map(_read, jobs, chunksize=4) for s in pages]


def prepared(samples: Sequence[PageSample], tokenizer: Any, max_tokens: int = MAX_TOKENS) -> list[Prepared]:
    return [p for s in samples if (p := prepare(s, tokenizer, max_tokens)) is not None]


def synthetic(n_docs: int, seed: int, out_dir: Path, workers: int = 1) -> tuple[list[Path], dict[str, list]]:
    """The project's own training PDFs (fusion.synth) and, per file, the known text of its scanned pages."""
    from docfuse.fusion.synth import make_corpus

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
    reader = checkpoint.load_reader(ckpt, device=device)
    pages = prepared(read_many(pdf_files(pdfs), vision), tokenizer)
    if not pages:
        raise ValueError(f"none of {list(map(str, pdfs))} has a page with a text layer to mask; "
                         "eval-fusion measures masked-token recovery on text pages")
    return masked_recovery(decoder, vit, fusion, pages, mask_rate=mask_rate, reader=reader, tokenizer=tokenizer)


def pack(src: Path, out: Path) -> Path:
    """Re-save a checkpoint in fp16 with its training report's held-out figures in the metadata (what data/ ships)."""
    vit, fusion, vision, meta = checkpoint.load(src)
    reader = checkpoint.load_reader(src)
    report = src.with_suffix(".json")
    held = json.loads(report.read_text())["held_out"] if report.is_file() else {}
    extra = checkpoint.carried_meta(meta)
    extra["held_out"] = json.dumps({k: v for k, v in held.items() if k != "gates"})
    return checkpoint.save(out, vit, fusion, vision, meta["decoder"], reader=reader, **extra)


def load_decoder(name: str = "default", device: str | None = None, dtype: str | None = None) -> tuple[Any, Any]:
    """The frozen decoder and its tokenizer, through runtime.loading's loader (``default``, a folder or a .gguf).

    On CUDA when present (``device=None``), in bf16 there and in fp32 on CPU unless ``dtype`` says otherwise:
    training keeps fp32 on CPU even where the CPU computes bf16, which load_model's ``auto`` would pick.
    """
    from docfuse.runtime.loading import load_model, resolve_device

    device = resolve_device(device)
    return load_model(name, dtype=dtype or ("bfloat16" if device.startswith("cuda") else "float32"), device=device)


def read_path_pages(tokenizer: Any, vision: VisionSpec, corpus: Sequence[str | Path], eval_corpus: Sequence[str | Path],
                    synthetic_docs: int, sheets: int, docs_seed: int, sheets_seed: int,
                    workers: int) -> tuple[list[Prepared], list[Prepared], list[Prepared]]:
    """(document pages: ``corpus`` and synthetic PDFs, never the held-out ones; word-sheet pages, all their words;
    held-out pages of ``eval_corpus``) for training the read path."""
    held_out = {p.resolve() for p in pdf_files(eval_corpus)}
    with tempfile.TemporaryDirectory() as tmp:
        made, truths = synthetic(synthetic_docs, docs_seed, Path(tmp) / "docs", workers) if synthetic_docs \
            else ([], {})
        docs = [p for p in pdf_files(corpus) + made if p.resolve() not in held_out]
        pages = prepared(read_many(docs, vision, truths, workers), tokenizer)
        sheet_pages = []
        if sheets:
            from docfuse.fusion.synth_words import make_sheets

            made = make_sheets(Path(tmp) / "sheets", sheets, seed=sheets_seed, workers=workers)
            sheet_pages = prepared(read_many(made, vision, None, workers), tokenizer, SHEET_TOKENS)
    return pages, sheet_pages, prepared(read_many(sorted(held_out), vision, None, workers), tokenizer)


def train_word_reader(tokenizer: Any, *, init: Path, out: Path, corpus: Sequence[str | Path] = (),
                      eval_corpus: Sequence[str | Path] = (), sheets: int = 0, synthetic_docs: int = 0,
                      config: ReaderTrainConfig = ReaderTrainConfig(), workers: int = 1, command: str = "",
                      log: Callable[[str], None] = print) -> dict:
    """Train only the word reader (no decoder: its tokenizer finds the words) on word sheets, synthetic and
    ``corpus`` pages; write ``init``'s fusion with the reader inside to ``out`` (for ``read --reader-from``)."""
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vit, fusion, vision, meta = checkpoint.load(init, device=device)
    docs, sheet_pages, eval_pages = read_path_pages(tokenizer, vision, corpus, eval_corpus, synthetic_docs, sheets,
                                                    config.seed, config.seed, workers)
    pages = docs + sheet_pages
    words = page_words(pages, tokenizer)
    log(f"{len(pages)} training pages ({sum(len(w.texts) for w in words)} words), {len(eval_pages)} held-out "
        f"pages; read in {time.perf_counter() - started:.0f} s")
    reader, history = train_reader(words, config, device, log=log, eval_words=page_words(eval_pages, tokenizer))
    extra = checkpoint.carried_meta(meta)
    checkpoint.save(out, vit, fusion, vision, meta["decoder"], dtype=torch.float32, reader=reader,
                    reader_command=command, **extra)
    summary = {"checkpoint": str(out), "pages": len(pages), "eval_pages": len(eval_pages),
               "held_out": history[-1].get("held_out", {}), "history": history,
               "seconds": round(time.perf_counter() - started, 1), "command": command}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    return summary


def read_path(decoder: Any, tokenizer: Any, *, init: Path, out: Path, corpus: Sequence[str | Path] = (),
              eval_corpus: Sequence[str | Path] = (), sheets: int = 0, synthetic_docs: int = 0,
              reader_config: ReaderTrainConfig = ReaderTrainConfig(), steer_config: SteerTrainConfig = SteerTrainConfig(),
              reader_from: Path | None = None, workers: int = 1, command: str = "",
              log: Callable[[str], None] = print) -> dict:
    """Give the fusion in ``init`` a read path: train a word reader (on word sheets, synthetic and ``corpus``
    pages; or take the one in ``reader_from``), then its steering map through the frozen decoder (synthetic and
    ``corpus`` pages), report on ``eval_corpus`` and write ``out`` with the reader inside."""
    started = time.perf_counter()
    device = str(next(decoder.parameters()).device)
    vit, fusion, vision, meta = checkpoint.load(init, checkpoint.decoder_fingerprint(decoder.config), device=device)
    pages, sheet_pages, eval_pages = read_path_pages(
        tokenizer, vision, corpus, eval_corpus, synthetic_docs, sheets if reader_from is None else 0,
        steer_config.seed, reader_config.seed, workers)
    log(f"{len(pages)} document pages, {len(sheet_pages)} word-sheet pages, {len(eval_pages)} held-out pages; "
        f"read in {time.perf_counter() - started:.0f} s")
    history: dict[str, Any] = {}
    if reader_from is not None:
        reader = checkpoint.load_reader(reader_from, device=device)
        if reader is None:
            raise ValueError(f"{str(reader_from)!r} holds no word reader; train one (leave out --reader-from)")
    else:
        words = page_words(sheet_pages + pages, tokenizer)
        reader, history["reader"] = train_reader(words, reader_config, device, log=log,
                                                 eval_words=page_words(eval_pages, tokenizer))
    steered = with_read_path(fusion, steer_config.read_hidden, steer_config.seed)
    steered, history["steer"] = train_steer(decoder, tokenizer, vit, steered, reader, pages, steer_config, log=log)
    report = masked_recovery(decoder, vit, steered, eval_pages, reader=reader, tokenizer=tokenizer) if eval_pages else {}
    extra = checkpoint.carried_meta(meta)
    extra |= {"read_command": command, "held_out": json.dumps({k: v for k, v in report.items() if k != "gates"})}
    checkpoint.save(out, vit, steered, vision, meta["decoder"], dtype=torch.float32, reader=reader, **extra)
    summary = {"checkpoint": str(out), "init": str(init), "pages": len(pages), "sheet_pages": len(sheet_pages),
               "eval_pages": len(eval_pages), "held_out": report, "history": history,
               "seconds": round(time.perf_counter() - started, 1), "command": command}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    return summary


def parser() -> argparse.ArgumentParser:
    """``python -m docfuse.fusion.run``'s options; their defaults are fusion.config's, as ``docfuse train-fusion``'s are."""
    ap = argparse.ArgumentParser(prog="python -m docfuse.fusion.run")
    ap.add_argument("verb", choices=["train", "pack", "read", "reader"])
    ap.add_argument("src", nargs="?", type=Path, help="pack: the checkpoint to re-save")
    ap.add_argument("--model", default="default", help="decoder: 'default', a Hugging Face folder or a .gguf file")
    ap.add_argument("--corpus", nargs="*", default=[])
    ap.add_argument("--eval-corpus", nargs="*", default=[])
    ap.add_argument("--synthetic", type=int, default=None,
                    help=f"synthetic PDFs; default {CORPUS.synthetic_docs} (train), {CORPUS.read_synthetic_docs} "
                         "(read, reader)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=TRAIN.steps)
    ap.add_argument("--batch", type=int, default=TRAIN.batch_pages, help="pages per step (train and read)")
    ap.add_argument("--workers", type=int, default=CORPUS.workers)
    ap.add_argument("--seed", type=int, default=TRAIN.seed)
    ap.add_argument("--minutes", type=float, default=None, help="training time budget (overrides --steps)")
    ap.add_argument("--mlp-hidden", type=int, default=TRAIN.mlp_hidden, help="width of the gated MLP branch; 0 = none")
    ap.add_argument("--read-share", type=float, default=TRAIN.read_share,
                    help="share of the budget for the reading phase first (no decoder, no gate); 0 = none")
    ap.add_argument("--read-batch", type=int, default=TRAIN.read_batch_pages, help="pages per reading-phase step")
    ap.add_argument("--init", type=Path, help="read: the fusion checkpoint that gets a read path")
    ap.add_argument("--sheets", type=int, default=CORPUS.sheets,
                    help="read: word-sheet PDFs (2 pages each) for the reader")
    ap.add_argument("--reader-minutes", type=float, default=CORPUS.reader_minutes,
                    help="reader training time; 0 = go by --reader-steps")
    ap.add_argument("--reader-steps", type=int, default=READER.steps)
    ap.add_argument("--reader-batch", type=int, default=READER.batch_words, help="words per reader step")
    ap.add_argument("--reader-from", type=Path, help="read: take the word reader from this checkpoint")
    ap.add_argument("--steer-minutes", type=float, default=CORPUS.steer_minutes,
                    help="steering training time; 0 = go by --steer-steps")
    ap.add_argument("--steer-steps", type=int, default=STEER.steps)
    ap.add_argument("--read-hidden", type=int, default=STEER.read_hidden)
    ap.add_argument("--tokenizer", help="reader: the decoder's tokenizer folder (no weights needed)")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.verb == "pack":
        print(pack(args.src, args.out))
        return
    command = "python -m docfuse.fusion.run " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.synthetic is None:
        args.synthetic = CORPUS.synthetic_docs if args.verb == "train" else CORPUS.read_synthetic_docs
    reader_config = ReaderTrainConfig(steps=args.reader_steps, batch_words=args.reader_batch, seed=args.seed,
                                      pages_per_step=max(READER.pages_per_step, args.reader_batch // 64),
                                      time_budget_s=args.reader_minutes * 60 if args.reader_minutes else None)
    if args.verb == "reader":  # the word reader alone: no decoder, only its tokenizer (to find the words)
        from transformers import AutoTokenizer

        if args.init is None or args.tokenizer is None:
            raise SystemExit("reader needs --init CHECKPOINT and --tokenizer DIR")
        summary = train_word_reader(
            AutoTokenizer.from_pretrained(args.tokenizer), init=args.init, out=args.out, corpus=args.corpus,
            eval_corpus=args.eval_corpus, sheets=args.sheets, synthetic_docs=args.synthetic, workers=args.workers,
            config=reader_config, command=command)
        print(json.dumps(summary["held_out"], indent=1))
        return
    decoder, tokenizer = load_decoder(args.model)
    if args.verb == "read":
        if args.init is None:
            raise SystemExit("read needs --init CHECKPOINT: the fusion that gets a read path")
        summary = read_path(
            decoder, tokenizer, init=args.init, out=args.out, corpus=args.corpus, eval_corpus=args.eval_corpus,
            sheets=args.sheets, synthetic_docs=args.synthetic, reader_config=reader_config,
            steer_config=SteerTrainConfig(steps=args.steer_steps, batch_pages=args.batch, seed=args.seed,
                                          read_hidden=args.read_hidden,
                                          time_budget_s=args.steer_minutes * 60 if args.steer_minutes else None),
            reader_from=args.reader_from, workers=args.workers, command=command)
        print(json.dumps(summary["held_out"], indent=1))
        return
    config = TrainConfig(steps=args.steps, batch_pages=args.batch, seed=args.seed, mlp_hidden=args.mlp_hidden,
                         read_share=args.read_share, read_batch_pages=args.read_batch,
                         time_budget_s=args.minutes * 60 if args.minutes else None)
    summary = train_from_pdfs(decoder, tokenizer, corpus=args.corpus, eval_corpus=args.eval_corpus, out=args.out,
                              config=config, synthetic_docs=args.synthetic, workers=args.workers,
                              command=command)
    print(json.dumps(summary["held_out"], indent=1))


if __name__ == "__main__":
    main()
