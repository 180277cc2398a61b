"""The ``docfuse`` command line: run, validate, stages and ask.

Exit codes: 0 every row succeeded; 3 some rows failed (their ``error`` column says why); 2 a usage or
validation error. Progress bars appear only on a terminal. Commands that train or calibrate models live beside
what they train and join ``docfuse`` through the ``docfuse.commands`` entry points (pipelines.commands).
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import pyarrow.parquet as pq
import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from docfuse.pipelines.commands import mount
from docfuse.pipelines.console import USAGE, err, fail
from docfuse.pipelines.engines import choose_executor
from docfuse.pipelines.executor import RunReport, StageSetupError
from docfuse.pipelines.executor_ray import RayUnavailable
from docfuse.pipelines.pipeline import Pipeline
from docfuse.pipelines.planning import make_plan
from docfuse.pipelines.registry import all_stages
from docfuse.pipelines.sources import InputError, count
from docfuse.pipelines.spec import builtin_pipelines
from docfuse.pipelines.validate import PipelineInvalid, check
from docfuse.pipelines.writers import output_format

app = typer.Typer(add_completion=False, no_args_is_help=True, help="docfuse: declarative pipelines that turn "
                  "long documents into answers.", context_settings={"help_option_names": ["-h", "--help"]})


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"docfuse {version('docfuse')}")
        except PackageNotFoundError:  # a source tree without the package installed
            print("docfuse (not installed: run `make setup`)")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="Print docfuse's version and exit.")] = False) -> None:
    """docfuse: declarative pipelines that turn long documents into answers."""
DEFAULT_CACHE = ".docfuse-cache"

SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override STAGE.KEY=VALUE (VALUE is YAML; "
                                                     "null removes the key). Repeatable.")]


def load_pipeline(source: str, sets: list[str] | None) -> Pipeline:
    """A pipeline by built-in name or YAML path, with --set overrides applied."""
    try:
        pipeline = Pipeline.from_yaml(source)
    except (FileNotFoundError, ValueError) as exc:
        fail(str(exc))
    for item in sets or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            fail(f"--set {item!r}: expected STAGE.KEY=VALUE, e.g. --set answer.max_new_tokens=64")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            fail(f"--set {item!r}: the value is not valid YAML ({exc.problem}); quote it")
        try:
            pipeline.set(key.strip(), value)
        except KeyError as exc:
            fail(exc.args[0])
    return pipeline


def _report_problems(problems: list[str]) -> None:
    err.print(f"[bold red]{len(problems)} problem(s) in the pipeline:[/]")
    for p in problems:
        err.print(f"  - {p}", highlight=False)


@app.command()
def run(
    pipeline: Annotated[str, typer.Argument(help="A built-in pipeline name (pdf_extract, pdf_qa, ...) or a YAML file.")],
    more: Annotated[Optional[list[str]], typer.Argument(
        help="More inputs: a shell glob after -i (-i docs/*.pdf) expands to several paths, and the rest land here.",
        show_default=False)] = None,
    input: Annotated[Optional[list[str]], typer.Option("--input", "-i", help="Files, folders, globs, Parquet/Arrow "
                                                       "datasets; repeatable, and paths after it count too.")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="File to write: .parquet, .csv or .jsonl (nested "
                                         "columns as JSON text in CSV); a folder of Parquet files for several "
                                         "outputs.")] = ...,
    set_: SetOpt = None,
    engine: Annotated[str, typer.Option(help="Executor: local, or ray (pip install 'docfuse\\[ray]').")] = "local",
    batch_docs: Annotated[int, typer.Option(min=1, help="Documents per batch: bounds memory.")] = 8,
    cache_dir: Annotated[Path, typer.Option(help="Stage-output cache, for resuming.")] = Path(DEFAULT_CACHE),
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Neither read nor write the stage cache.")] = False,
    column: Annotated[Optional[str], typer.Option(help="Dataset column holding paths or bytes.")] = None,
    address: Annotated[Optional[str], typer.Option(help="Ray cluster to join with --engine ray (host:port or auto); "
                                                   "without it a local Ray starts, sized to this machine.")] = None,
    kv_store: Annotated[Optional[Path], typer.Option(help="Prefilled documents' KV caches for decode.generate, so a "
                                                          "document asked about again skips its prefill (default: "
                                                          "<cache-dir>/kv; off with --no-cache).")] = None,
) -> None:
    """Run a pipeline over documents and write its output as Parquet, CSV or JSON Lines (by the file's suffix)."""
    inputs = [*(input or []), *(more or [])]
    if not inputs:
        fail("no input documents: pass --input/-i PATH (files, folders, globs or datasets), e.g. -i docs/*.pdf")
    try:
        output_format(output)  # .parquet (or no suffix), .csv, .jsonl: anything else is refused before the run
    except ValueError as exc:
        fail(str(exc))
    pipe = load_pipeline(pipeline, set_)
    _use_kv_store(pipe, kv_store, None if no_cache else cache_dir)
    report = _execute(pipe, inputs, output, engine, batch_docs, None if no_cache else cache_dir, column, address)
    err.print(f"{report.rows} row(s) from {report.documents} document(s) in {report.seconds:.1f} s"
              f"{f', {report.batches_from_cache} batch(es) from cache' if report.batches_from_cache else ''}"
              f" -> {', '.join(str(p) for p in report.outputs.values())}", highlight=False)
    if report.error_rows:
        err.print(f"[yellow]{report.error_rows} row(s) failed; see their 'error' column[/]")
    raise typer.Exit(report.exit_code)


def _execute(pipe: Pipeline, inputs: list[str], output: Path, engine: str, batch_docs: int,
             cache_dir: Path | None, column: str | None, address: str | None = None,
             bar: bool = True) -> RunReport:
    """Run with a progress bar of documents on a terminal (``bar=False``: the caller shows its own progress)."""
    try:
        executor = choose_executor(pipe, engine, cache_dir=cache_dir, address=address)
    except PipelineInvalid as exc:
        _report_problems(exc.problems)
        raise typer.Exit(USAGE)
    except (ValueError, RayUnavailable) as exc:
        fail(str(exc))
    try:
        if engine == "ray":  # Ray Data draws its own per-stage progress bars, on a terminal only
            return executor.run(inputs, output, batch_docs=batch_docs, column=column, progress=err.is_terminal)
        total = count(inputs, column)
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, disable=not (bar and err.is_terminal),
                      transient=False) as progress:
            task = progress.add_task(pipe.name, total=total)
            return executor.run(inputs, output, batch_docs=batch_docs, column=column,
                                on_batch=lambda n, _cached: progress.advance(task, n))
    except (InputError, StageSetupError, RayUnavailable) as exc:
        fail(str(exc))


@app.command("validate")
def validate_cmd(
    pipeline: Annotated[str, typer.Argument(help="A built-in pipeline name or a YAML file.")],
    set_: SetOpt = None,
) -> None:
    """Check a pipeline without running it; exit 2 and list every problem if it is invalid."""
    pipe = load_pipeline(pipeline, set_)
    checked = check(pipe)
    if checked.problems:
        _report_problems(checked.problems)
        raise typer.Exit(USAGE)
    err.print(f"[green]ok[/]: pipeline '{pipe.name}' with {len(pipe.stages)} stage(s) is valid")
    for note in make_plan(pipe, checked.graph, checked.instances).warnings:
        err.print(f"[yellow]note:[/] {note}", highlight=False)


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


def _use_kv_store(pipe: Pipeline, kv_store: Path | None, cache_dir: Path | None) -> None:
    """Point every decode.generate stage that names no ``kv_store`` at ``kv_store``, else ``<cache_dir>/kv``; with
    neither (``--no-cache``) the documents are prefilled every run."""
    folder = kv_store or (cache_dir / "kv" if cache_dir is not None else None)
    if folder is None:
        return
    for name, stage in pipe.stages.items():
        if stage.stage == "decode.generate" and "kv_store" not in stage.params:
            pipe.set(f"{name}.kv_store", str(folder))


@app.command()
def ask(
    file: Annotated[Path, typer.Argument(help="A PDF (or .txt/.md) document.")],
    question: Annotated[str, typer.Argument(help="The question to answer from the document.")],
    set_: SetOpt = None,
    pipeline: Annotated[Optional[str], typer.Option(help="Pipeline to run; default pdf_qa, or text_qa for .txt/.md.")] = None,
    cache_dir: Annotated[Path, typer.Option(help="Stage-output cache.")] = Path(DEFAULT_CACHE),
    no_cache: Annotated[bool, typer.Option("--no-cache")] = False,
    max_new_tokens: Annotated[Optional[int], typer.Option(min=1, help="Most answer tokens (answer.max_new_tokens).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the answer row as JSON on stdout.")] = False,
    kv_store: Annotated[Optional[Path], typer.Option(help="Prefilled documents' KV caches, so a second question "
                                                          "about the same document skips its prefill (default: "
                                                          "<cache-dir>/kv; off with --no-cache).")] = None,
) -> None:
    """Answer one question about one document with the built-in QA pipeline, and print the answer."""
    name = pipeline or ("text_qa" if file.suffix.lower() in {".txt", ".md", ".markdown"} else "pdf_qa")
    extra = [f"answer.max_new_tokens={max_new_tokens}"] if max_new_tokens is not None else []
    pipe = load_pipeline(name, [*(set_ or []), *extra])
    _use_kv_store(pipe, kv_store, None if no_cache else cache_dir)
    pipe.set("params.questions", None)
    pipe.set("params.question", question)
    live = sys.stdout.isatty() and not as_json
    streamed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, _streaming(live, streamed):
        out = Path(tmp) / "answer.parquet"
        report = _execute(pipe, [str(file)], out, "local", 1, None if no_cache else cache_dir, None, bar=not live)
        rows = pq.read_table(out).to_pylist()
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row, default=str))
        raise typer.Exit(report.exit_code)
    for row in rows:
        if row.get("error"):
            err.print(f"[bold red]{row['error']}[/]", highlight=False)
        else:
            typer.echo("" if streamed else row.get("answer", ""))  # streamed: the answer is on the screen already
            if row.get("cited_pages"):  # counted from 1, as a reader counts
                typer.echo(f"(pages {', '.join(str(p + 1) for p in row['cited_pages'])})")
            if row.get("skipped_fraction"):
                err.print(f"[yellow]pruning skipped {row['skipped_fraction']:.0%} of the decode's blocks: it is "
                          "experimental and can change answers; --set params.safe_mode=true decodes dense[/]",
                          highlight=False)
            if row.get("truncated"):
                used = row.get("pages_used")
                where = f"pages {', '.join(str(p + 1) for p in used)}" if used else "its beginning"
                err.print(f"[yellow]the document is longer than the context: read {where} only[/]", highlight=False)
            err.print(f"[dim]{row.get('prompt_tokens')} prompt tokens, time to first token {row.get('ttft_s', 0):.1f} s, "
                      f"{row.get('decode_tokens_per_s', 0):.1f} tokens/s[/]", highlight=False)
    raise typer.Exit(report.exit_code)


@app.command()
def serve(
    idle_minutes: Annotated[float, typer.Option(min=0, help="Stop after this many minutes without a question "
                                                            "(0: never).")] = 30.0,
    pipeline: Annotated[str, typer.Option(help="Pipeline whose stages are set up at start (its answer stage loads "
                                                "the model then).")] = "pdf_qa",
    stop: Annotated[bool, typer.Option("--stop", help="Ask the running server to leave, and exit.")] = False,
) -> None:
    """Keep the model loaded and answer `docfuse ask` from any folder of this user, so that a question costs its
    answer, not seconds of start-up. Ctrl-C or --stop ends it; DOCFUSE_SERVER=0 makes one `ask` run by itself."""
    from docfuse.pipelines.ask_server import serve as run_server
    from docfuse.pipelines.ask_server import socket_path
    from docfuse.pipelines.ask_server import stop as stop_server

    if stop:
        if not stop_server():
            fail(f"no docfuse server answers on {socket_path()}")
        err.print(f"the docfuse server on {socket_path()} has stopped", highlight=False)
        return
    try:
        run_server(app, idle_minutes, load_pipeline(pipeline, None))
    except RuntimeError as exc:
        fail(str(exc))


#: What ``ask`` shows on a terminal while a stage of the QA pipelines starts (others: "name (kind)").
_STAGE_WORDS = {"pdf.open": "opening the document", "pdf.text": "reading its text (OCR for scanned pages)",
                "text.pages": "reading the text", "pdf.render": "rendering its pages",
                "vision.patches": "encoding the page images", "fusion.gate": "fusing text and images",
                "decode.generate": "loading the model"}


@contextlib.contextmanager
def _streaming(live: bool, streamed: list[str]):
    """On a terminal, ``ask`` shows the prefill's progress in tokens (stderr) and the answer as it is decoded."""
    if not live:
        yield
        return
    from docfuse.pipelines.progress import LIVE, Live

    def prefill(done: int, total: int) -> None:
        sys.stderr.write(f"\r\x1b[Kreading the document: {done:,} / {total:,} tokens")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def text(piece: str) -> None:
        streamed.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()

    def stage(name: str, kind: str) -> None:
        sys.stderr.write(f"\r\x1b[K{_STAGE_WORDS.get(kind, f'{name} ({kind})')} ...")
        sys.stderr.flush()

    sys.stderr.write("starting ...\n")  # before the first stage imports its libraries (seconds on a laptop)
    sys.stderr.flush()
    token = LIVE.set(Live(on_prefill=prefill, on_text=text, on_stage=stage))
    try:
        yield
    finally:
        LIVE.reset(token)


cache_app = typer.Typer(help="The stage-output cache (.docfuse-cache): what it holds, and clearing it. It keeps "
                        "DOCFUSE_CACHE_MAX_GB (default 10) gigabytes, dropping the least recently used entries.",
                        no_args_is_help=True)
app.add_typer(cache_app, name="cache")
CacheDir = Annotated[Path, typer.Option(help="Stage-output cache.")]


@cache_app.command("info")
def cache_info(cache_dir: CacheDir = Path(DEFAULT_CACHE)) -> None:
    """Entries and bytes per stage."""
    from docfuse.pipelines.cache import StageCache

    cache = StageCache(cache_dir)
    table = Table("stage", "entries", "MB")
    total = 0
    for stage, (n, nbytes) in sorted(cache.info().items()):
        table.add_row(stage, str(n), f"{nbytes / 1e6:.1f}")
        total += nbytes
    Console().print(table)
    typer.echo(f"{total / 1e6:.1f} MB in {cache_dir} (cap {cache.max_bytes / 1e9:g} GB: DOCFUSE_CACHE_MAX_GB)")


@cache_app.command("clear")
def cache_clear(stage: Annotated[Optional[str], typer.Option(help="Only this stage's entries.")] = None,
                cache_dir: CacheDir = Path(DEFAULT_CACHE)) -> None:
    """Remove the cached entries (all, or one stage's)."""
    from docfuse.pipelines.cache import StageCache

    n, nbytes = StageCache(cache_dir).clear(stage)
    typer.echo(f"removed {n} entr{'y' if n == 1 else 'ies'}, {nbytes / 1e6:.1f} MB, from {cache_dir}")


mount(app)  # the training and calibration commands (fusion/cli.py, runtime/pruning/cli.py, ...)


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())
