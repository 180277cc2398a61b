"""``docfuse train-fusion``, ``train-fusion-read`` and ``eval-fusion``: the fusion's commands, beside what they train.

They join ``docfuse`` through the ``docfuse.commands`` entry point (pipelines.commands). Option defaults come from
fusion.config, as ``python -m docfuse.fusion.run``'s do. torch and the model are imported only when a command runs, so
listing docfuse's commands stays quick.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from docfuse.fusion.config import CORPUS, STEER, TRAIN, ReaderTrainConfig, SteerTrainConfig, TrainConfig
from docfuse.pipelines.console import err, fail

app = typer.Typer(add_completion=False)

#: The checkpoint docfuse ships (stages/fuse.py's default), relative to the project root.
SHIPPED = Path("data/fusion/smollm2-135m-instruct.safetensors")

OutOpt = Annotated[Path, typer.Option("--out", help="Checkpoint to write (.safetensors) plus a .json report.")]
EvalOpt = Annotated[Optional[list[Path]], typer.Option("--eval", help="Held-out PDFs or folders: never trained on, "
                                                       "reported at the end.")]
ModelOpt = Annotated[str, typer.Option(help="'default' or a local Hugging Face model folder.")]
WorkersOpt = Annotated[int, typer.Option(help="Processes that read and render PDFs.")]


def pdfs_or_fail(paths: list[Path], flag: str) -> list[Path]:
    """The PDFs under ``paths``; a usage error naming ``flag`` when a path is missing or holds no PDF."""
    from docfuse.fusion.run import pdf_files

    missing = [str(p) for p in paths if not p.exists()]
    files = pdf_files(paths) if not missing else []
    if missing or not files:
        fail(f"{flag} {', '.join(missing) or ' '.join(map(str, paths))}: no PDF found; give PDF files or folders")
    return files


def _safetensors_or_fail(out: Path) -> None:
    if out.suffix != ".safetensors":
        fail(f"--out {out}: the checkpoint is written as safetensors; name it e.g. {out.with_suffix('.safetensors')}")


def _existing_checkpoint(given: Path, flag: str, how: str) -> Path:
    """``given`` as stages resolve checkpoints (relative to the project root too), or a usage error naming ``how``."""
    from docfuse.stages.vision_model import resolve_checkpoint

    path = resolve_checkpoint(str(given))
    if not path.is_file():
        fail(f"{flag} {given}: not found; {how}")
    return path


def _command() -> str:
    return " ".join(["docfuse", *sys.argv[1:]])


def _log(message: str) -> None:
    err.print(message, highlight=False, markup=False)


@app.command("train-fusion")
def train_fusion(
    out: OutOpt,
    corpus: Annotated[Optional[list[Path]], typer.Option("--corpus", help="PDFs or folders to train on "
                                                         "(e.g. ../shared/corpus).")] = None,
    eval_corpus: EvalOpt = None,
    synthetic: Annotated[int, typer.Option(help="Synthetic PDFs (4 pages each) the project draws itself.")]
    = CORPUS.synthetic_docs,
    model: ModelOpt = "default",
    steps: Annotated[int, typer.Option(help="Optimiser steps (or --minutes).")] = TRAIN.steps,
    minutes: Annotated[Optional[float], typer.Option(help="Training time budget; overrides --steps.")] = None,
    batch: Annotated[int, typer.Option(help="Pages per step.")] = TRAIN.batch_pages,
    workers: WorkersOpt = CORPUS.workers,
    mlp_hidden: Annotated[int, typer.Option(help="Width of the gated MLP branch; 0 = none.")] = TRAIN.mlp_hidden,
    read_share: Annotated[float, typer.Option(help="Share of the budget for the reading phase first: the ViT "
                                              "learns to name the next token from the image alone.")]
    = TRAIN.read_share,
) -> None:
    """Train a fusion checkpoint (ViT + gated cross-attention) against the frozen decoder; GPU when present."""
    _safetensors_or_fail(out)
    train_set = pdfs_or_fail(corpus, "--corpus") if corpus else []
    held_out = pdfs_or_fail(eval_corpus, "--eval") if eval_corpus else []
    if not train_set and synthetic <= 0:
        fail("nothing to train on: give --corpus PDFs or --synthetic N")
    if not 0.0 <= read_share < 1.0:
        fail(f"--read-share {read_share}: give a share in [0, 1); the rest of the budget trains the full objective")
    from docfuse.fusion.run import load_decoder, train_from_pdfs

    lm, tokenizer = load_decoder(model)
    config = TrainConfig(steps=steps, batch_pages=batch, time_budget_s=minutes * 60 if minutes else None,
                         mlp_hidden=mlp_hidden, read_share=read_share)
    try:
        summary = train_from_pdfs(lm, tokenizer, corpus=train_set, eval_corpus=held_out, out=out, config=config,
                                  synthetic_docs=synthetic, workers=workers, command=_command(), log=_log)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(json.dumps(summary["held_out"], indent=1))


@app.command("train-fusion-read")
def train_fusion_read(
    out: OutOpt,
    init: Annotated[Path, typer.Option(help="The fusion checkpoint that gets the read path.")] = SHIPPED,
    corpus: Annotated[Optional[list[Path]], typer.Option("--corpus", help="PDFs or folders to train on.")] = None,
    eval_corpus: EvalOpt = None,
    synthetic: Annotated[int, typer.Option(help="Synthetic PDFs (4 pages each) the project draws itself.")]
    = CORPUS.read_synthetic_docs,
    sheets: Annotated[int, typer.Option(help="Word sheets (2 pages each) for the word reader.")] = CORPUS.sheets,
    reader_from: Annotated[Optional[Path], typer.Option(help="Take the word reader from this checkpoint "
                                                        "instead of training one.")] = None,
    reader_minutes: Annotated[float, typer.Option(help="Word reader training time.")] = CORPUS.reader_minutes,
    steer_minutes: Annotated[float, typer.Option(help="Read-path (steering) training time.")] = CORPUS.steer_minutes,
    model: ModelOpt = "default",
    batch: Annotated[int, typer.Option(help="Pages per steering step.")] = STEER.batch_pages,
    workers: WorkersOpt = CORPUS.workers,
) -> None:
    """Give a fusion checkpoint a word reader and a read path (hidden tokens read from the page image)."""
    _safetensors_or_fail(out)
    init_path = _existing_checkpoint(init, "--init", "give a `docfuse train-fusion` checkpoint")
    if reader_from is not None and not reader_from.is_file():
        fail(f"--reader-from {reader_from}: not found; leave it out to train a reader")
    if reader_minutes <= 0 or steer_minutes <= 0:
        fail("--reader-minutes and --steer-minutes must be positive")
    train_set = pdfs_or_fail(corpus, "--corpus") if corpus else []
    held_out = pdfs_or_fail(eval_corpus, "--eval") if eval_corpus else []
    if not train_set and synthetic <= 0:
        fail("nothing to train the read path on: give --corpus PDFs or --synthetic N")
    from docfuse.fusion.run import load_decoder, read_path

    lm, tokenizer = load_decoder(model)
    try:
        summary = read_path(lm, tokenizer, init=init_path, out=out, corpus=train_set, eval_corpus=held_out,
                            sheets=sheets, synthetic_docs=synthetic, reader_from=reader_from, workers=workers,
                            reader_config=ReaderTrainConfig(time_budget_s=reader_minutes * 60),
                            steer_config=SteerTrainConfig(batch_pages=batch, time_budget_s=steer_minutes * 60),
                            command=_command(), log=_log)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(json.dumps(summary["held_out"], indent=1))


@app.command("eval-fusion")
def eval_fusion(
    pdfs: Annotated[list[Path], typer.Argument(help="PDFs (or folders) the checkpoint never saw in training.")],
    checkpoint: Annotated[Path, typer.Option(help="A `docfuse train-fusion` checkpoint.")] = SHIPPED,
    model: Annotated[str, typer.Option(help="The decoder the checkpoint was trained for.")] = "default",
    mask_rate: Annotated[float, typer.Option(help="Share of text tokens hidden.")] = TRAIN.mask_rate,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Masked-token recovery with the fusion vs text-only on the text pages of PDFs."""
    files = pdfs_or_fail(pdfs, "PDF")
    path = _existing_checkpoint(checkpoint, "--checkpoint", "make one with `docfuse train-fusion`")
    from docfuse.fusion.run import evaluate_pdfs, load_decoder

    lm, tokenizer = load_decoder(model, dtype="float32")
    try:
        report = evaluate_pdfs(lm, tokenizer, path, files, mask_rate=mask_rate)
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    err.print(f"{report['pages']} pages, {report['masked_tokens']} hidden tokens: recovered "
              f"{report['masked_recovery_fused']:.1%} fused vs {report['masked_recovery_text_only']:.1%} text-only",
              highlight=False)
