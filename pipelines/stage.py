"""The stage contract: the only thing the engine knows about a stage.

A stage is a class with
- ``kind``: the name YAML uses (``pdf.open``);
- ``version``: bumped when the output for the same input changes; it enters the cache key;
- ``Params``: a pydantic model of its JSON-serialisable parameters (unknown keys are refused);
- ``inputs``: one Arrow schema per input port, naming the columns it reads (a producer may carry more);
- ``output_schema``: the schema of every table ``run`` returns (``output()`` when parameters change it);
- ``reads_params``: the pipeline-level params it reads, handed over as ``self.context``;
- ``setup()``: loads heavy state (models) once, after construction; maps onto a Ray actor's constructor;
- ``unread_inputs()``: the input ports its parameters make it ignore, known before any batch runs (optional);
- ``run(*tables) -> table``: batch in, batch out, one table per input port, in port order.

Rows that carry an ``error`` never reach ``run``: the engine passes them on itself, so a stage only sees good
rows. A stage that finds a bad row returns it with ``error`` set to ``"kind: message"`` instead of raising.
A stage that raises anyway has its batch retried one document at a time, and the documents that still raise
become error rows.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

ERROR_FIELD = pa.field("error", pa.string())


class StageParams(BaseModel):
    """Base for stage parameters: unknown keys are errors, values are validated by type."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


@dataclass(frozen=True)
class Unread:
    """An input port that a stage's parameters make it ignore, decided before any batch runs.

    Why the engine asks: a stage upstream that feeds only ignored ports (a renderer and a ViT feeding a fusion
    that will stay text-only) would be work thrown away, so the engine does not run it and hands the port an
    empty table. ``enable`` names the parameters that would make the stage read the port and ``cost`` what that
    costs; the engine's warning shows both. ``enable`` is empty when the parameters chose this plainly (``apply:
    never``): there is nothing to warn about then.
    """

    why: str
    enable: dict[str, Any] = field(default_factory=dict)
    cost: str = ""


class Stage:
    kind: ClassVar[str] = ""
    version: ClassVar[str] = "1"
    Params: ClassVar[type[StageParams]] = StageParams
    inputs: ClassVar[dict[str, pa.Schema]] = {}
    output_schema: ClassVar[pa.Schema] = pa.schema([])
    #: Pipeline-level ``params`` this stage reads (for example ``question``); they enter its cache key.
    reads_params: ClassVar[tuple[str, ...]] = ()
    #: Resources a distributed engine reserves for one instance (Ray actor or task).
    resources: ClassVar[dict[str, float]] = {"num_cpus": 1}

    def __init__(self, *, context: dict[str, Any] | None = None, **params: Any) -> None:
        self.params = self.Params(**params)
        self.context = {k: v for k, v in (context or {}).items() if k in self.reads_params}

    def output(self) -> pa.Schema:
        """The schema ``run`` returns for these parameters; override when parameters add columns."""
        return self.output_schema

    def setup(self) -> None:
        """Load heavy state. Called once per instance before the first ``run``."""

    def unread_inputs(self) -> dict[str, Unread]:
        """Input ports (by name) that these parameters make ``run`` ignore; the engine asks once, before
        ``setup()`` and before any batch, so it must be cheap (read a file's header, not a model)."""
        return {}

    def run(self, *tables: pa.Table) -> pa.Table:  # pragma: no cover - abstract
        raise NotImplementedError

    def cache_salt(self) -> str:
        """Extra cache-key material: what changes the output besides the parameters (a weights file's identity)."""
        return ""

    def pass_errors(self, errors: pa.Table) -> pa.Table:
        """Error rows from upstream, in this stage's output schema (nulls where a column has no value).

        Override when the output has another grain, e.g. one row per question instead of one per document.
        """
        return conform(errors, self.output())

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """Ports and parameters, for ``docfuse stages`` and error messages."""
        return {
            "kind": cls.kind,
            "version": cls.version,
            "doc": _summary(cls.__doc__),
            "inputs": {port: [f"{f.name}: {f.type}" for f in schema] for port, schema in cls.inputs.items()},
            "output": [f"{f.name}: {f.type}" for f in cls.output_schema],
            "params": {
                name: {
                    "type": _type_name(field.annotation),
                    "default": None if field.is_required() else field.get_default(call_default_factory=True),
                    "required": field.is_required(),
                    "help": field.description or "",
                }
                for name, field in cls.Params.model_fields.items()
            },
        }


def _summary(doc: str | None) -> str:
    """A docstring's first paragraph on one line (a summary may wrap over several source lines)."""
    lines = []
    for line in inspect.cleandoc(doc or "").splitlines():
        if not line.strip():
            break
        lines.append(line.strip())
    return " ".join(lines)


def _type_name(annotation: Any) -> str:
    name = getattr(annotation, "__name__", None)
    return name if name and not str(annotation).startswith("typing") else str(annotation).replace("typing.", "")


def error_value(kind: str, message: str) -> str:
    """The ``error`` column's text: a short kind, then a message that names the fix."""
    return f"{kind}: {message}"


def with_error_column(schema: pa.Schema) -> pa.Schema:
    return schema if "error" in schema.names else schema.append(ERROR_FIELD)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns: missing ones filled with nulls, the rest cast."""
    n = table.num_rows
    columns = []
    for fld in schema:
        if fld.name in table.column_names:
            col = table.column(fld.name)
            columns.append(col if col.type == fld.type else col.cast(fld.type))
        else:
            columns.append(_nulls(n, fld.type))
    return pa.Table.from_arrays(columns, schema=schema)


def _nulls(n: int, typ: pa.DataType) -> pa.Array:
    if isinstance(typ, pa.ExtensionType):
        return pa.ExtensionArray.from_storage(typ, pa.nulls(n, type=typ.storage_type))
    return pa.nulls(n, type=typ)
