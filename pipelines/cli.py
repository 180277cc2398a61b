"""The ``docfuse`` command line.

Exit codes: 0 every row succeeded; 3 some rows failed (their ``error`` column says why); 2 a usage or
validation error. Progress bars appear only on a terminal.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import pyarrow.parquet as pq
import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipelines.engines import choose_executor
from pipelines.executor import RunReport, StageSetupError
from pipelines.executor_ray import RayUnavailable
from pipelines.pipeline import Pipeline
from pipelines.registry import all_stages
from pipelines.sources import InputError, count
from pipelines.spec import builtin_pipelines
from pipelines.validate import PipelineInvalid, validate

app = typer.Typer(add_completion=False, no_args_is_help=True, help="docfuse: declarative pipelines that turn "
                  "long documents into answers.")
err = Console(stderr=True)
USAGE, ROW_ERRORS = 2, 3
DEFAULT_CACHE = ".docfuse-cache"

SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override STAGE.KEY=VALUE (VALUE is YAML; "
                                                     "null removes the key). Repeatable.")]


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # messages may hold [brackets]
    raise typer.Exit(USAGE)


def load_pipeline(source: str, sets: list[str] | None) -> Pipeline:
    """A pipeline by built-in name or YAML path, with --set overrides applied."""
    try:
        pipeline = Pipeline.from_yaml(source)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    for item in sets or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            _fail(f"--set {item!r}: expected STAGE.KEY=VALUE, e.g. --set answer.max_new_tokens=64")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            _fail(f"--set {item!r}: the value is not valid YAML ({exc.problem}); quote it")
        try:
            pipeline.set(key.strip(), value)
        except KeyError as exc:
            _fail(exc.args[0])
    return pipeline


def _report_problems(problems: list[str]) -> None:
    err.print(f"[bold red]{len(problems)} problem(s) in the pipeline:[/]")
    for p in problems:
        err.print(f"  - {p}", highlight=False)


@app.command()
def run(
    pipeline: Annotated[str, typer.Argument(help="A built-in pipeline name (pdf_extract, pdf_qa, ...) or a YAML file.")],
    input: Annotated[list[str], typer.Option("--input", "-i", help="Files, folders, globs, Parquet/Arrow datasets.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Parquet file to write (a folder for several outputs).")],
    set_: SetOpt = None,
    engine: Annotated[str, typer.Option(help="Executor: local, or ray (pip install 'docfuse\\[ray]').")] = "local",
    batch_docs: Annotated[int, typer.Option(min=1, help="Documents per batch: bounds memory.")] = 8,
    cache_dir: Annotated[Path, typer.Option(help="Stage-output cache, for resuming.")] = Path(DEFAULT_CACHE),
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Neither read nor write the stage cache.")] = False,
    column: Annotated[Optional[str], typer.Option(help="Dataset column holding paths or bytes.")] = None,
    address: Annotated[Optional[str], typer.Option(help="Ray cluster to join with --engine ray (host:port or auto); "
                                                   "without it a local Ray starts, sized to this machine.")] = None,
) -> None:
    """Run a pipeline over documents and write its output as Parquet."""
    pipe = load_pipeline(pipeline, set_)
    report = _execute(pipe, input, output, engine, batch_docs, None if no_cache else cache_dir, column, address)
    err.print(f"{report.rows} row(s) from {report.documents} document(s) in {report.seconds:.1f} s"
              f"{f', {report.batches_from_cache} batch(es) from cache' if report.batches_from_cache else ''}"
              f" -> {', '.join(str(p) for p in report.outputs.values())}", highlight=False)
    if report.error_rows:
        err.print(f"[yellow]{report.error_rows} row(s) failed; see their 'error' column[/]")
    raise typer.Exit(report.exit_code)


def _execute(pipe: Pipeline, inputs: list[str], output: Path, engine: str, batch_docs: int,
             cache_dir: Path | None, column: str | None, address: str | None = None) -> RunReport:
    try:
        executor = choose_executor(pipe, engine, cache_dir=cache_dir, address=address)
    except PipelineInvalid as exc:
        _report_problems(exc.problems)
        raise typer.Exit(USAGE)
    except (ValueError, RayUnavailable) as exc:
        _fail(str(exc))
    try:
        if engine == "ray":  # Ray Data draws its own per-stage progress bars, on a terminal only
            return executor.run(inputs, output, batch_docs=batch_docs, column=column, progress=err.is_terminal)
        total = count(inputs, column)
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, disable=not err.is_terminal, transient=False) as bar:
            task = bar.add_task(pipe.name, total=total)
            return executor.run(inputs, output, batch_docs=batch_docs, column=column,
                                on_batch=lambda n, _cached: bar.advance(task, n))
    except (InputError, StageSetupError, RayUnavailable) as exc:
        _fail(str(exc))


@app.command("validate")
def validate_cmd(
    pipeline: Annotated[str, typer.Argument(help="A built-in pipeline name or a YAML file.")],
    set_: SetOpt = None,
) -> None:
    """Check a pipeline without running it; exit 2 and list every problem if it is invalid."""
    pipe = load_pipeline(pipeline, set_)
    problems = validate(pipe)
    if problems:
        _report_problems(problems)
        raise typer.Exit(USAGE)
    err.print(f"[green]ok[/]: pipeline '{pipe.name}' with {len(pipe.stages)} stage(s) is valid")


@app.command()
def stages(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """List every stage kind with its ports and parameters."""
    described = [cls.describe() for cls in all_stages().values()]
    if as_json:
        typer.echo(json.dumps(described, indent=2, default=str))
        return
    out = Console()
    for d in described:
        table = Table(title=f"{d['kind']} (v{d['version']}): {d['doc']}", title_justify="left", show_lines=False)
        table.add_column("", style="bold")
        table.add_column("")
        for port, cols in d["inputs"].items():
            table.add_row(f"in: {port}", ", ".join(cols))
        table.add_row("out", ", ".join(d["output"]))
        for name, p in d["params"].items():
            default = "required" if p["required"] else repr(p["default"])
            table.add_row(f"with: {name}", f"{p['type']} = {default}  {p['help']}")
        out.print(table)
    out.print(f"built-in pipelines: {', '.join(builtin_pipelines())}")


@app.command()
def ask(
    file: Annotated[Path, typer.Argument(help="A PDF (or .txt/.md) document.")],
    question: Annotated[str, typer.Argument(help="The question to answer from the document.")],
    set_: SetOpt = None,
    pipeline: Annotated[Optional[str], typer.Option(help="Pipeline to run; default pdf_qa, or text_qa for .txt/.md.")] = None,
    cache_dir: Annotated[Path, typer.Option(help="Stage-output cache.")] = Path(DEFAULT_CACHE),
    no_cache: Annotated[bool, typer.Option("--no-cache")] = False,
) -> None:
    """Answer one question about one document with the built-in QA pipeline, and print the answer."""
    name = pipeline or ("text_qa" if file.suffix.lower() in {".txt", ".md", ".markdown"} else "pdf_qa")
    pipe = load_pipeline(name, [*(set_ or [])])
    pipe.set("params.questions", None)
    pipe.set("params.question", question)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "answer.parquet"
        report = _execute(pipe, [str(file)], out, "local", 1, None if no_cache else cache_dir, None)
        rows = pq.read_table(out).to_pylist()
    for row in rows:
        if row.get("error"):
            err.print(f"[bold red]{row['error']}[/]", highlight=False)
        else:
            typer.echo(row.get("answer", ""))
            err.print(f"[dim]{row.get('prompt_tokens')} prompt tokens, time to first token {row.get('ttft_s', 0):.1f} s, "
                      f"{row.get('decode_tokens_per_s', 0):.1f} tokens/s[/]", highlight=False)
    raise typer.Exit(report.exit_code)


@app.command("calibrate-pruning")
def calibrate_pruning(
    corpus: Annotated[list[Path], typer.Option("--corpus", help="Calibration text: .txt/.md files or folders "
                                               "(e.g. python -m runtime.pruning.calibration_text > calib.txt).")],
    out: Annotated[Path, typer.Option("--out", help="Head file to write (.safetensors) plus a .json report.")],
    model: Annotated[str, typer.Option(help="'default' or a local Hugging Face model folder.")] = "default",
    windows: Annotated[int, typer.Option(help="512-token windows to label (a quarter validate).")] = 32,
    label_windows: Annotated[Optional[int], typer.Option(help="Label only the first N of those windows "
                                                         "(a time budget; default all).")] = None,
    work_dir: Annotated[Path, typer.Option(help="Where labels are kept, so a rerun resumes.")] = Path(
        ".docfuse-cache/pruning-labels"),
    threshold: Annotated[float, typer.Option(help="The default threshold the head is chosen for.")] = 0.15,
    tune_steps: Annotated[int, typer.Option(help="Then tune the best head end to end for this many steps per skip "
                                            "target (straight-through masks; a GPU makes it quick). 0 = no tuning.")] = 0,
    skip_targets: Annotated[str, typer.Option(help="Comma-separated shares of blocks to skip that tuning aims "
                                              "at; every tuned head is scored by real skipping.")] = "0.15,0.2,0.25",
    tune_batch: Annotated[int, typer.Option(help="Windows per tuning step.")] = 8,
    read_layers: Annotated[str, typer.Option(help="Comma-separated layers a candidate head may read.")] = "1,2,3",
    label_kls: Annotated[str, typer.Option(help="Comma-separated label levels (nats) of the candidate heads.")]
    = "0.005,0.01,0.02,0.05",
    init_head: Annotated[Optional[Path], typer.Option(help="Tune this head (from an earlier calibrate-pruning for "
                                                      "the model) instead of labelling and training a new one.")]
    = None,
) -> None:
    """Calibrate a pruning decision head: ablation labels per token and block, training, tuning, threshold sweep."""
    try:
        targets = [float(x) for x in skip_targets.split(",") if x.strip()]
        layers = [int(x) for x in read_layers.split(",") if x.strip()]
        levels = [float(x) for x in label_kls.split(",") if x.strip()]
    except ValueError:
        targets = layers = levels = []
    if not layers or not levels or not all(x > 0 for x in levels):
        _fail(f"--read-layers {read_layers!r} / --label-kls {label_kls!r}: give comma-separated layer numbers "
              "such as 1,2,3 and positive label levels such as 0.005,0.01")
    if not targets or not all(0 < t < 1 for t in targets) or tune_steps < 0 or tune_batch < 1:
        _fail(f"--skip-targets {skip_targets!r} / --tune-steps {tune_steps} / --tune-batch {tune_batch}: give "
              "comma-separated shares in (0, 1) such as 0.15,0.2,0.25, a step count >= 0 and a batch >= 1")
    files = [f for p in corpus for f in (sorted(p.rglob("*")) if p.is_dir() else [p])
             if f.is_file() and f.suffix.lower() in {".txt", ".md", ".markdown"}]
    missing = [str(p) for p in corpus if not p.exists()]
    if missing or not files:
        _fail(f"--corpus {', '.join(missing) or ' '.join(map(str, corpus))}: no .txt/.md text found; give text "
              "files or folders (python -m runtime.pruning.calibration_text > calib.txt makes one)")
    if out.suffix != ".safetensors":
        _fail(f"--out {out}: the head is written as safetensors; name it e.g. {out.with_suffix('.safetensors')}")
    if init_head is not None and (not init_head.is_file() or tune_steps == 0):
        _fail(f"--init-head {init_head}: give an existing head file, together with --tune-steps > 0 "
              "(an initial head is only tuned, never relabelled)")
    from runtime.loading import load_model
    from runtime.pruning.calibrate import calibrate

    lm, tokenizer = load_model(model)
    start = None
    if init_head is not None:
        from runtime.pruning import find_head

        try:
            start = find_head(lm, str(init_head))
        except ValueError as exc:
            _fail(str(exc))
    text = "\n\n".join(f.read_text(errors="replace") for f in files)
    try:
        head, report = calibrate(lm, tokenizer, text, work_dir, windows=windows, label=label_windows,
                                 default_threshold=threshold, read_layers=layers, label_kls=levels,
                                 tune_steps=tune_steps, skip_targets=targets,
                                 tune_batch=tune_batch, init_head=start,
                                 log=lambda m: err.print(m, highlight=False))
    except ValueError as exc:
        _fail(str(exc))
    command = " ".join(["docfuse", *sys.argv[1:]])
    head.save(out, report["fingerprint"], {"command": command, "chosen": report["chosen"],
                                           "default_threshold": threshold,
                                           "initial_head_command": report["initial_head"]})
    out.with_suffix(".json").write_text(json.dumps({"command": command, **report}, indent=1))
    chosen = next(r for r in report["sweep"] if r["threshold"] == threshold) if any(
        r["threshold"] == threshold for r in report["sweep"]) else report["sweep"][0]
    err.print(f"wrote {out} ({report['head_parameters']} parameters, "
              f"{report['head_parameters'] / report['model_parameters']:.3%} of the model); at threshold "
              f"{chosen['threshold']}: top-1 {chosen['top1_agreement']:.3f}, skipped {chosen['skipped_fraction']:.1%}",
              highlight=False)


def _pdfs_or_fail(paths: list[Path], flag: str) -> list[Path]:
    from fusion.run import pdf_files

    missing = [str(p) for p in paths if not p.exists()]
    files = pdf_files(paths) if not missing else []
    if missing or not files:
        _fail(f"{flag} {', '.join(missing) or ' '.join(map(str, paths))}: no PDF found; give PDF files or folders")
    return files


@app.command("train-fusion")
def train_fusion(
    out: Annotated[Path, typer.Option("--out", help="Checkpoint to write (.safetensors) plus a .json report.")],
    corpus: Annotated[Optional[list[Path]], typer.Option("--corpus", help="PDFs or folders to train on "
                                                         "(e.g. ../shared/corpus).")] = None,
    eval_corpus: Annotated[Optional[list[Path]], typer.Option("--eval", help="Held-out PDFs or folders: never "
                                                              "trained on, reported at the end.")] = None,
    synthetic: Annotated[int, typer.Option(help="Synthetic PDFs (4 pages each) the project draws itself.")] = 200,
    model: Annotated[str, typer.Option(help="'default' or a local Hugging Face model folder.")] = "default",
    steps: Annotated[int, typer.Option(help="Optimiser steps (or --minutes).")] = 1000,
    minutes: Annotated[Optional[float], typer.Option(help="Training time budget; overrides --steps.")] = None,
    batch: Annotated[int, typer.Option(help="Pages per step.")] = 16,
    workers: Annotated[int, typer.Option(help="Processes that read and render PDFs.")] = 1,
    mlp_hidden: Annotated[int, typer.Option(help="Width of the gated MLP branch; 0 = none.")] = 1024,
    read_share: Annotated[float, typer.Option(help="Share of the budget for the reading phase first: the ViT "
                                              "learns to name the next token from the image alone.")] = 0.0,
) -> None:
    """Train a fusion checkpoint (ViT + gated cross-attention) against the frozen decoder; GPU when present."""
    if out.suffix != ".safetensors":
        _fail(f"--out {out}: the checkpoint is written as safetensors; name it e.g. {out.with_suffix('.safetensors')}")
    train_set = _pdfs_or_fail(corpus, "--corpus") if corpus else []
    held_out = _pdfs_or_fail(eval_corpus, "--eval") if eval_corpus else []
    if not train_set and synthetic <= 0:
        _fail("nothing to train on: give --corpus PDFs or --synthetic N")
    if not 0.0 <= read_share < 1.0:
        _fail(f"--read-share {read_share}: give a share in [0, 1); the rest of the budget trains the full objective")
    from fusion.run import train_from_pdfs
    from fusion.train import TrainConfig
    from runtime.loading import load_model

    lm, tokenizer = load_model(model, dtype="float32" if not _cuda() else "bfloat16")
    config = TrainConfig(steps=steps, batch_pages=batch, time_budget_s=minutes * 60 if minutes else None,
                         mlp_hidden=mlp_hidden, read_share=read_share)
    try:
        summary = train_from_pdfs(lm, tokenizer, corpus=train_set, eval_corpus=held_out, out=out, config=config,
                                  synthetic_docs=synthetic, workers=workers,
                                  command=" ".join(["docfuse", *sys.argv[1:]]),
                                  log=lambda m: err.print(m, highlight=False, markup=False))
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(summary["held_out"], indent=1))


@app.command("train-fusion-read")
def train_fusion_read(
    out: Annotated[Path, typer.Option("--out", help="Checkpoint to write (.safetensors) plus a .json report.")],
    init: Annotated[Path, typer.Option(help="The fusion checkpoint that gets the read path.")] = Path(
        "data/fusion/smollm2-135m-instruct.safetensors"),
    corpus: Annotated[Optional[list[Path]], typer.Option("--corpus", help="PDFs or folders to train on.")] = None,
    eval_corpus: Annotated[Optional[list[Path]], typer.Option("--eval", help="Held-out PDFs or folders: never "
                                                              "trained on, reported at the end.")] = None,
    synthetic: Annotated[int, typer.Option(help="Synthetic PDFs (4 pages each) the project draws itself.")] = 100,
    sheets: Annotated[int, typer.Option(help="Word sheets (2 pages each) for the word reader.")] = 100,
    reader_from: Annotated[Optional[Path], typer.Option(help="Take the word reader from this checkpoint "
                                                        "instead of training one.")] = None,
    reader_minutes: Annotated[float, typer.Option(help="Word reader training time.")] = 10.0,
    steer_minutes: Annotated[float, typer.Option(help="Read-path (steering) training time.")] = 10.0,
    model: Annotated[str, typer.Option(help="'default' or a local Hugging Face model folder.")] = "default",
    batch: Annotated[int, typer.Option(help="Pages per steering step.")] = 16,
    workers: Annotated[int, typer.Option(help="Processes that read and render PDFs.")] = 1,
) -> None:
    """Give a fusion checkpoint a word reader and a read path (hidden tokens read from the page image)."""
    if out.suffix != ".safetensors":
        _fail(f"--out {out}: the checkpoint is written as safetensors; name it e.g. {out.with_suffix('.safetensors')}")
    from stages.vision_model import resolve_checkpoint

    init_path = resolve_checkpoint(str(init))
    if not init_path.is_file():
        _fail(f"--init {init}: not found; give a `docfuse train-fusion` checkpoint")
    if reader_from is not None and not reader_from.is_file():
        _fail(f"--reader-from {reader_from}: not found; leave it out to train a reader")
    if reader_minutes <= 0 or steer_minutes <= 0:
        _fail("--reader-minutes and --steer-minutes must be positive")
    train_set = _pdfs_or_fail(corpus, "--corpus") if corpus else []
    held_out = _pdfs_or_fail(eval_corpus, "--eval") if eval_corpus else []
    if not train_set and synthetic <= 0:
        _fail("nothing to train the read path on: give --corpus PDFs or --synthetic N")
    from fusion.read_train import ReaderTrainConfig, SteerTrainConfig
    from fusion.run import read_path
    from runtime.loading import load_model

    lm, tokenizer = load_model(model, dtype="float32" if not _cuda() else "bfloat16")
    try:
        summary = read_path(lm, tokenizer, init=init_path, out=out, corpus=train_set, eval_corpus=held_out,
                            sheets=sheets, synthetic_docs=synthetic, reader_from=reader_from, workers=workers,
                            reader_config=ReaderTrainConfig(time_budget_s=reader_minutes * 60),
                            steer_config=SteerTrainConfig(batch_pages=batch, time_budget_s=steer_minutes * 60),
                            command=" ".join(["docfuse", *sys.argv[1:]]),
                            log=lambda m: err.print(m, highlight=False, markup=False))
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(summary["held_out"], indent=1))


@app.command("eval-fusion")
def eval_fusion(
    pdfs: Annotated[list[Path], typer.Argument(help="PDFs (or folders) the checkpoint never saw in training.")],
    checkpoint: Annotated[Path, typer.Option(help="A `docfuse train-fusion` checkpoint.")] = Path(
        "data/fusion/smollm2-135m-instruct.safetensors"),
    model: Annotated[str, typer.Option(help="The decoder the checkpoint was trained for.")] = "default",
    mask_rate: Annotated[float, typer.Option(help="Share of text tokens hidden.")] = 0.15,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Masked-token recovery with the fusion vs text-only on the text pages of PDFs."""
    from fusion.run import evaluate_pdfs
    from runtime.loading import load_model
    from stages.vision_model import resolve_checkpoint

    files = _pdfs_or_fail(pdfs, "PDF")
    path = resolve_checkpoint(str(checkpoint))
    if not path.is_file():
        _fail(f"--checkpoint {checkpoint}: not found; make one with `docfuse train-fusion`")
    lm, tokenizer = load_model(model, dtype="float32")
    try:
        report = evaluate_pdfs(lm, tokenizer, path, files, mask_rate=mask_rate)
    except ValueError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    err.print(f"{report['pages']} pages, {report['masked_tokens']} hidden tokens: recovered "
              f"{report['masked_recovery_fused']:.1%} fused vs {report['masked_recovery_text_only']:.1%} text-only",
              highlight=False)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())
