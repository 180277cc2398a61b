"""Commands beside what they train, mounted into ``docfuse`` through entry points, with one set of defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import typer

from docfuse.fusion import cli as fusion_cli
from docfuse.fusion.config import CORPUS, TRAIN, TrainConfig
from docfuse.fusion.run import parser
from docfuse.pipelines import commands

ROOT = Path(__file__).resolve().parents[1]
MOUNTED = {"train-fusion", "train-fusion-read", "eval-fusion", "calibrate-pruning", "kv-store"}

CLASH = typer.Typer()
CLASH.command("run")(lambda: None)
NOT_AN_APP = object()


def test_docfuse_lists_the_mounted_commands_without_importing_torch() -> None:
    code = ("import sys, typer; from pipelines.cli import app; "
            "print(sorted(typer.main.get_command(app).commands)); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    names, torch_loaded = out.splitlines()
    assert MOUNTED <= set(eval(names)) and {"run", "validate", "stages", "ask"} <= set(eval(names))
    assert torch_loaded == "False", "listing commands must not import torch"


def test_builtin_commands_load_even_where_the_installed_metadata_lacks_them(monkeypatch) -> None:
    monkeypatch.setattr(commands, "entry_points", lambda group: [])
    assert commands.command_entry_points() == list(commands.BUILTIN)
    listed = [EntryPoint("fusion", "docfuse.fusion.cli:app", commands.GROUP)]
    monkeypatch.setattr(commands, "entry_points", lambda group: listed)
    assert [ep.name for ep in commands.command_entry_points()] == ["fusion", "pruning", "kv-store"]


@pytest.mark.parametrize("target, error, message", [
    ("tests.test_commands:CLASH", ValueError, "command 'run' from entry point 'x = tests.test_commands:CLASH' is "
                                              "already a docfuse command; rename one"),
    ("tests.test_commands:NOT_AN_APP", TypeError, "must name a typer.Typer"),
])
def test_a_bad_command_entry_point_is_refused_with_the_fix(monkeypatch, target, error, message) -> None:
    monkeypatch.setattr(commands, "command_entry_points", lambda: [EntryPoint("x", target, commands.GROUP)])
    app = typer.Typer()
    app.command("run")(lambda: None)
    with pytest.raises(error, match=message):
        commands.mount(app)


def test_the_default_training_config_is_the_one_the_shipped_checkpoint_was_trained_with() -> None:
    from safetensors import safe_open

    with safe_open(str(ROOT / fusion_cli.SHIPPED), "pt") as f:
        shipped = json.loads(f.metadata()["config"])
    assert {k: v for k, v in asdict(TrainConfig()).items() if k != "time_budget_s"} == \
        {k: v for k, v in shipped.items() if k != "time_budget_s"}


def _typer_defaults(command: str) -> dict[str, object]:
    click_command = typer.main.get_command(fusion_cli.app).commands[command]
    return {p.name: p.default for p in click_command.params}


def test_both_ways_into_fusion_training_share_their_defaults() -> None:
    argparse_defaults = vars(parser().parse_args(["train", "--out", "x.safetensors"]))
    train = _typer_defaults("train-fusion")
    for typer_name, argparse_name in [("steps", "steps"), ("batch", "batch"), ("workers", "workers"),
                                      ("mlp_hidden", "mlp_hidden"), ("read_share", "read_share"), ("model", "model")]:
        assert train[typer_name] == argparse_defaults[argparse_name], typer_name
    assert train["synthetic"] == CORPUS.synthetic_docs and train["mlp_hidden"] == TRAIN.mlp_hidden
    read = _typer_defaults("train-fusion-read")
    for name in ("sheets", "reader_minutes", "steer_minutes", "workers", "batch"):
        assert read[name] == argparse_defaults[name], name
    assert read["synthetic"] == CORPUS.read_synthetic_docs


def test_both_ways_into_fusion_load_the_decoder_through_runtimes_one_loader(monkeypatch) -> None:
    import torch
    from typer.testing import CliRunner

    from docfuse.fusion import run
    from docfuse.runtime import loading

    calls: list[tuple[str, str, str]] = []
    monkeypatch.setattr(loading, "load_model", lambda name, dtype, device: calls.append((name, dtype, device)) or
                        ("lm", "tok"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.load_decoder("m") == ("lm", "tok")
    run.load_decoder("m", device="cuda")
    run.load_decoder("m", device="cuda", dtype="float32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    run.load_decoder()
    assert calls == [("m", "float32", "cpu"), ("m", "bfloat16", "cuda"), ("m", "float32", "cuda"),
                     ("default", "bfloat16", "cuda")]

    class Loaded(Exception):
        pass

    def refuse(*args, **kwargs):
        calls.append(("loader", args, kwargs))
        raise Loaded

    monkeypatch.setattr(run, "load_decoder", refuse)
    result = CliRunner().invoke(fusion_cli.app, ["eval-fusion", str(ROOT / "data" / "sample.pdf")])
    assert isinstance(result.exception, Loaded) and calls[-1] == ("loader", ("default",), {"dtype": "float32"})
    with pytest.raises(Loaded):
        run.main(["train", "--out", "x.safetensors", "--synthetic", "0"])
    assert calls[-1] == ("loader", ("default",), {})


def test_run_takes_the_paths_a_shell_glob_expands_after_one_i(tmp_path) -> None:
    """``docfuse run pdf_extract -i docs/*.pdf`` reaches the command as ``-i a.pdf b.pdf``: both are inputs."""
    from typer.testing import CliRunner

    import pyarrow.parquet as pq

    from docfuse.pipelines.cli import app
    from tests import pdf_fixtures as fx

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = fx.write_born_digital(tmp_path / "a", n_pages=1)
    b = fx.write_born_digital(tmp_path / "b", n_pages=2)
    out = tmp_path / "pages.parquet"
    res = CliRunner().invoke(app, ["run", "pdf_extract", "-i", str(a), str(b), "-o", str(out), "--no-cache"])
    assert res.exit_code == 0, res.output
    assert sorted(set(pq.read_table(out).column("source").to_pylist())) == sorted([str(a), str(b)])
    missing = CliRunner().invoke(app, ["run", "pdf_extract", "-o", str(out)])
    assert missing.exit_code == 2 and "--input/-i" in missing.output
    xlsx = CliRunner().invoke(app, ["run", "pdf_extract", "-i", str(a), "-o", str(tmp_path / "pages.xlsx")])
    assert xlsx.exit_code == 2 and ".csv or .jsonl" in xlsx.output and "pages.parquet" in xlsx.output
    assert not (tmp_path / "pages.xlsx").exists()


def test_csv_and_json_lines_outputs_hold_what_parquet_holds(tmp_path) -> None:
    """-o pages.csv writes CSV (nested columns as JSON text, bytes as base64), -o pages.jsonl one object a row;
    both carry the Parquet output's rows and values."""
    import base64
    import csv
    import json

    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from docfuse.pipelines.cli import app
    from tests import pdf_fixtures as fx

    pdf = fx.write_born_digital(tmp_path, n_pages=2)
    outs = {}
    for suffix in ("parquet", "csv", "jsonl"):
        out = tmp_path / f"pages.{suffix}"
        res = CliRunner().invoke(app, ["run", "pdf_extract", "-i", str(pdf), "-o", str(out), "--no-cache"])
        assert res.exit_code == 0, res.output
        outs[suffix] = out
    table = pq.read_table(outs["parquet"])
    rows = table.to_pylist()
    with outs["csv"].open(newline="") as f:
        cells = list(csv.DictReader(f))
    lines = [json.loads(line) for line in outs["jsonl"].read_text().splitlines()]
    assert len(cells) == len(lines) == len(rows) == 2
    assert list(cells[0]) == list(lines[0]) == table.column_names
    for row, cell, line in zip(rows, cells, lines):
        assert cell["text"] == line["text"] == row["text"]
        assert int(cell["page"]) == line["page"] == row["page"]


def test_the_text_writers_keep_nested_binary_and_null_values(tmp_path) -> None:
    import base64
    import csv
    import json

    import pyarrow as pa

    from docfuse.pipelines.writers import open_writer

    schema = pa.schema([("doc_id", pa.string()), ("cited_pages", pa.list_(pa.int32())),
                        ("box", pa.struct([("x", pa.float32()), ("y", pa.float32())])), ("image", pa.binary()),
                        ("score", pa.float64())])
    batches = [pa.table({"doc_id": ["a", "b"], "cited_pages": [[0, 2], None], "box": [{"x": 1.5, "y": 2.0}, None],
                         "image": [b"\x00\xffpng", None], "score": [0.25, None]}, schema=schema),
               pa.table({"doc_id": ["c, \"quoted\"\nline"], "cited_pages": [[]], "box": [{"x": 0.0, "y": -1.0}],
                         "image": [b""], "score": [1.0]}, schema=schema)]
    for fmt in ("csv", "jsonl"):
        writer = open_writer(tmp_path / f"out.{fmt}", schema)
        for batch in batches:  # streamed, batch by batch
            writer.write_table(batch)
        writer.close()
    with (tmp_path / "out.csv").open(newline="") as f:
        cells = list(csv.DictReader(f))
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [c["doc_id"] for c in cells] == [r["doc_id"] for r in lines] == ["a", "b", 'c, "quoted"\nline']
    assert json.loads(cells[0]["cited_pages"]) == lines[0]["cited_pages"] == [0, 2]
    assert json.loads(cells[0]["box"]) == lines[0]["box"] == {"x": 1.5, "y": 2.0}
    assert base64.b64decode(cells[0]["image"]) == base64.b64decode(lines[0]["image"]) == b"\x00\xffpng"
    assert cells[1]["cited_pages"] == "" and lines[1]["cited_pages"] is None and lines[1]["image"] is None
    assert json.loads(cells[2]["cited_pages"]) == lines[2]["cited_pages"] == []
    assert float(cells[0]["score"]) == lines[0]["score"] == 0.25
    with pytest.raises(ValueError, match=r"\.csv or \.jsonl"):
        open_writer(tmp_path / "out.xlsx", schema)


def test_version_and_short_help() -> None:
    from typer.testing import CliRunner

    from docfuse.pipelines.cli import app

    version = CliRunner().invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.startswith("docfuse ")
    for args in (["-h"], ["run", "-h"], ["ask", "-h"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0 and "Usage" in res.output, args


def test_cache_info_clear_and_the_size_cap(tmp_path, monkeypatch) -> None:
    import os

    import pyarrow as pa
    from typer.testing import CliRunner

    from docfuse.pipelines.cache import StageCache
    from docfuse.pipelines.cli import app

    table = pa.table({"x": list(range(2000))})
    cache = StageCache(tmp_path / "c", max_bytes=10 ** 9)
    for i in range(3):
        cache.put("text", f"k{i}", table)
    cache.put("pages", "k0", table)
    size = cache.entries()[0][1]
    info = CliRunner().invoke(app, ["cache", "info", "--cache-dir", str(tmp_path / "c")])
    assert info.exit_code == 0 and "text" in info.output and "pages" in info.output
    # the cap: a put past it drops the least recently used entries; a hit counts as a use
    os.utime(tmp_path / "c" / "text" / "k0.arrow", (1, 1))
    os.utime(tmp_path / "c" / "text" / "k1.arrow", (2, 2))
    os.utime(tmp_path / "c" / "text" / "k2.arrow", (3, 3))
    os.utime(tmp_path / "c" / "pages" / "k0.arrow", (4, 4))
    small = StageCache(tmp_path / "c", max_bytes=int(3.5 * size))
    assert small.get("text", "k0") is not None  # used now: k1 is the oldest
    small.put("text", "k3", table)
    left = {(p.parent.name, p.stem) for p, _, _ in small.entries()}
    assert left == {("pages", "k0"), ("text", "k0"), ("text", "k3")} and small.evicted == 2  # k1 and k2 went
    cleared = CliRunner().invoke(app, ["cache", "clear", "--stage", "text", "--cache-dir", str(tmp_path / "c")])
    assert cleared.exit_code == 0 and "removed 2 entries" in cleared.output
    assert [p.parent.name for p, _, _ in StageCache(tmp_path / "c").entries()] == ["pages"]
    CliRunner().invoke(app, ["cache", "clear", "--cache-dir", str(tmp_path / "c")])
    assert StageCache(tmp_path / "c").entries() == []
    monkeypatch.setenv("DOCFUSE_CACHE_MAX_GB", "0.5")
    assert StageCache(tmp_path / "c").max_bytes == 500_000_000
