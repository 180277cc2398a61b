"""``docfuse calibrate-pruning``: make a pruning decision head for a model, beside the code that trains it.

It joins ``docfuse`` through the ``docfuse.commands`` entry point (pipelines.commands). torch and the model are
imported only when the command runs, so listing docfuse's commands stays quick.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from docfuse.pipelines.console import err, fail

app = typer.Typer(add_completion=False)

TEXT_SUFFIXES = {".txt", ".md", ".markdown"}


def _numbers(text: str, kind: type) -> list:
    """Comma-separated numbers of ``kind``; empty when one does not parse."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return []


@app.command("calibrate-pruning")
def calibrate_pruning(
    corpus: Annotated[list[Path], typer.Option("--corpus", help="Calibration text: .txt/.md files or folders "
                                               "(e.g. python -m docfuse.runtime.pruning.calibration_text > calib.txt).")],
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
    targets, layers, levels = _numbers(skip_targets, float), _numbers(read_layers, int), _numbers(label_kls, float)
    if not layers or not levels or not all(x > 0 for x in levels):
        fail(f"--read-layers {read_layers!r} / --label-kls {label_kls!r}: give comma-separated layer numbers "
             "such as 1,2,3 and positive label levels such as 0.005,0.01")
    if not targets or not all(0 < t < 1 for t in targets) or tune_steps < 0 or tune_batch < 1:
        fail(f"--skip-targets {skip_targets!r} / --tune-steps {tune_steps} / --tune-batch {tune_batch}: give "
             "comma-separated shares in (0, 1) such as 0.15,0.2,0.25, a step count >= 0 and a batch >= 1")
    files = [f for p in corpus for f in (sorted(p.rglob("*")) if p.is_dir() else [p])
             if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES]
    missing = [str(p) for p in corpus if not p.exists()]
    if missing or not files:
        fail(f"--corpus {', '.join(missing) or ' '.join(map(str, corpus))}: no .txt/.md text found; give text "
             "files or folders (python -m docfuse.runtime.pruning.calibration_text > calib.txt makes one)")
    if out.suffix != ".safetensors":
        fail(f"--out {out}: the head is written as safetensors; name it e.g. {out.with_suffix('.safetensors')}")
    if init_head is not None and (not init_head.is_file() or tune_steps == 0):
        fail(f"--init-head {init_head}: give an existing head file, together with --tune-steps > 0 "
             "(an initial head is only tuned, never relabelled)")
    from docfuse.runtime.loading import load_model
    from docfuse.runtime.pruning.calibrate import calibrate

    lm, tokenizer = load_model(model)
    start = None
    if init_head is not None:
        from docfuse.runtime.pruning import find_head

        try:
            start = find_head(lm, str(init_head))
        except ValueError as exc:
            fail(str(exc))
    text = "\n\n".join(f.read_text(errors="replace") for f in files)
    try:
        head, report = calibrate(lm, tokenizer, text, work_dir, windows=windows, label=label_windows,
                                 default_threshold=threshold, read_layers=layers, label_kls=levels,
                                 tune_steps=tune_steps, skip_targets=targets,
                                 tune_batch=tune_batch, init_head=start,
                                 log=lambda m: err.print(m, highlight=False))
    except ValueError as exc:
        fail(str(exc))
    command = " ".join(["docfuse", *sys.argv[1:]])
    head.save(out, report["fingerprint"], {"command": command, "chosen": report["chosen"],
                                           "default_threshold": threshold,
                                           "initial_head_command": report["initial_head"]})
    out.with_suffix(".json").write_text(json.dumps({"command": command, **report}, indent=1))
    chosen = next((r for r in report["sweep"] if r["threshold"] == threshold), report["sweep"][0])
    err.print(f"wrote {out} ({report['head_parameters']} parameters, "
              f"{report['head_parameters'] / report['model_parameters']:.3%} of the model); at threshold "
              f"{chosen['threshold']}: top-1 {chosen['top1_agreement']:.3f}, skipped {chosen['skipped_fraction']:.1%}",
              highlight=False)
