"""fusion.gate: each page's text tokens fused with its vision patches (the adapter to ``fusion``).

One row per page: the page text's token ids and, per token (plus any pooled visual tokens of word-free regions),
the decoder input embedding, as a list of fixed-shape tensors. decode.generate prefills those embeddings instead
of the token ids. Without a usable checkpoint (none given, none found, or one that lost to text-only on its
held-out pages, see ``apply``) a page is text-only: ``fused`` is null, ``fusion`` says why, and the decoder embeds
``token_ids`` itself, which is the text-only stream bit for bit.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field

from docfuse.pipelines.registry import register
from docfuse.pipelines.stage import Stage, StageParams, Unread, error_value
from docfuse.stages import schemas

DEFAULT_CHECKPOINT = "data/fusion/smollm2-135m-instruct.safetensors"  # package data: see vision_model.resolve_checkpoint
TEXT_COLUMNS = ("doc_id", "source", "page", "text", "image_only", "page_width", "page_height", "words")
#: Errors of pdf.render / vision.patches that concern only a page's picture, not its text.
IMAGE_ONLY_ERRORS = {"page_too_large", "bad_image", "bad_page_size"}
#: What fused.apply=always cost pdf_qa with the shipped checkpoint on data/sample.pdf (3 pages, a busy 2-core CPU
#: machine, 2026-12-06, one run each): pdf.render + vision.patches + fusion.gate 1.8 s (0.6 s a page), and decode
#: prefills the fused stream instead of token ids (8.7 s against 4.6 s); the whole run 13.0 s against 6.4 s.
MEASURED_COST = "about 0.6 s a page on CPU, and a slower prefill: data/sample.pdf ran 13.0 s instead of 6.4 s"


def fused_schema(hidden: int) -> pa.Schema:
    """fusion.gate's output for a decoder of ``hidden`` size."""
    return pa.schema(schemas.DOC + [
        pa.field("page", pa.int32()),
        pa.field("text", pa.string()),
        pa.field("image_only", pa.bool_()),
        pa.field("token_ids", pa.list_(pa.int32())),  # -1 on pooled visual tokens
        pa.field("fused", pa.list_(pa.fixed_shape_tensor(pa.float32(), [hidden]))),
        pa.field("visual_tokens", pa.int32()),
        pa.field("fusion", pa.string()),  # "fused", or "text_only: why"
        schemas.ERROR,
    ])


class FusionGateParams(StageParams):
    checkpoint: str | None = Field("default", description="'default' (data/fusion/, trained for the embedded "
                                   "model), a `docfuse train-fusion` file, or null for text-only")
    model: str = Field("default", description="the decoder whose embedding space the stream is in: the same "
                                              "as decode.generate's model")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the fusion's compute dtype on CPU: auto = bfloat16 where the CPU has it natively "
                            "(about 1.8x faster), else float32; the stream stays float32")
    apply: Literal["auto", "always", "never"] = Field(
        "auto", description="auto: use the checkpoint only if it beat text-only on its held-out pages "
                            "(its own report); always; never (text-only)")


@register
class FusionGate(Stage):
    """Text tokens (with their word boxes) and page patches into one stream of decoder input embeddings."""

    kind = "fusion.gate"
    version = "1"
    Params = FusionGateParams
    inputs: ClassVar[dict[str, pa.Schema]] = {
        "text": pa.schema([f for f in schemas.PAGE_TEXT if f.name in TEXT_COLUMNS[:5]]
                          + [f for f in schemas.PAGE_LAYOUT_FIELDS if f.name in TEXT_COLUMNS]),
        "patches": pa.schema([pa.field("doc_id", pa.string()), pa.field("page", pa.int32())]),
    }
    output_schema = fused_schema(576)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fusion: Any = None
        self._why: str | None = None

    def _path(self):
        from docfuse.stages.vision_model import resolve_checkpoint

        c = self.params.checkpoint
        return None if c is None else resolve_checkpoint(DEFAULT_CHECKPOINT if c == "default" else c)

    def output(self) -> pa.Schema:
        from docfuse.fusion.checkpoint import read_meta

        path = self._path()
        if path is not None and path.is_file():
            return fused_schema(int(json.loads(read_meta(path)["fusion_config"])["hidden"]))
        return self.output_schema

    def cache_salt(self) -> str:
        path = self._path()
        st = path.stat() if path is not None and path.is_file() else None
        return f"{path}:{st.st_size}:{st.st_mtime_ns}" if st else str(path)

    def unread_inputs(self) -> dict[str, Unread]:
        """``patches`` when the pages will be text-only whatever they show, so the engine renders none and runs no
        ViT: no checkpoint, ``apply: never``, or under ``apply: auto`` a checkpoint that lost to text-only on its
        own held-out pages (its metadata says so; nothing is loaded)."""
        from docfuse.fusion.checkpoint import read_meta

        path, p = self._path(), self.params
        if path is None or p.apply == "never":
            return {"patches": Unread("no fusion checkpoint" if path is None else "apply: never")}
        if p.apply == "always" or not path.is_file():
            return {}  # a missing checkpoint is setup()'s error, named with its fix
        meta = read_meta(path)
        why = _verdict(meta)
        if why is None:
            return {}
        return {"patches": Unread(f"{why}, so the pages stay text-only", {"apply": "always"}, _cost(meta))}

    def setup(self) -> None:
        import torch

        from docfuse.fusion.checkpoint import decoder_fingerprint, load
        from docfuse.stages.models import shared_model

        # decode.generate's defaults: one copy of the decoder in the process serves both stages
        model, self._tokenizer = shared_model(self.params.model, "auto", "auto")
        self._embed = model.get_input_embeddings()
        self._device = self._embed.weight.device
        path, p = self._path(), self.params
        if path is None or p.apply == "never":
            self._why = "text_only: no fusion checkpoint" if path is None else "text_only: apply: never"
            return
        if not path.is_file():
            raise ValueError(f"fusion.gate: checkpoint {str(path)!r} not found; make one with `docfuse train-fusion`"
                             " or set checkpoint: null for text-only")
        vit, fusion, spec, meta = load(path, decoder_fingerprint(model.config), device=str(self._device))
        why = _verdict(meta) if p.apply == "auto" else None
        if why:  # the engine warned when it planned the run (Stage.unread_inputs)
            self._why = f"text_only: {why}"
            return
        from docfuse.runtime.loading import cpu_has_bf16

        bf16 = p.dtype == "bfloat16" or (p.dtype == "auto" and self._device.type == "cpu" and cpu_has_bf16())
        self._fusion = fusion.to(torch.bfloat16 if bf16 else torch.float32)

    def pass_errors(self, errors: pa.Table) -> pa.Table:
        """Upstream errors, once each; a page that only lost its image (too large, bad PNG) is no error here:
        its text row goes on text-only."""
        from docfuse.pipelines.stage import conform

        keep, seen = [], set()
        n = errors.num_rows
        pages = errors.column("page").to_pylist() if "page" in errors.column_names else [None] * n
        for i, (doc, page, error) in enumerate(zip(errors.column("doc_id").to_pylist(), pages,
                                                   errors.column("error").to_pylist())):
            if error.split(":", 1)[0] in IMAGE_ONLY_ERRORS or (doc, page, error) in seen:
                continue
            seen.add((doc, page, error))
            keep.append(i)
        return conform(errors.take(pa.array(keep, pa.int64())), self.output())

    def run(self, text: pa.Table, patches: pa.Table) -> pa.Table:
        if self._why is None and self._fusion is None:
            self.setup()
        patch_rows = _index_patches(patches)
        rows = [self._page(r, patch_rows.get((r["doc_id"], r["page"]))) for r in _rows(text, TEXT_COLUMNS)]
        return as_table(rows, self.output())

    def _page(self, r: dict, patch: dict | None) -> dict:
        import torch

        from docfuse.fusion.tokens import Word, tokenize_page

        row = {"doc_id": r["doc_id"], "source": r["source"], "page": r["page"], "text": r["text"],
               "image_only": r["image_only"], "error": None}
        body = (r["text"] or "").strip()
        words = [Word(w["text"], w["x0"], w["y0"], w["x1"], w["y1"]) for w in (r["words"] or [])]
        width, height = r["page_width"] or 0.0, r["page_height"] or 0.0
        if body and not (width > 0 and height > 0):
            return {**row, "error": error_value("bad_page_size", f"page {r['page']} has size {width} x {height}; "
                                                "run pdf.text with layout: true")}
        tok = tokenize_page(self._tokenizer, body, words if width > 0 else [], width or 1.0, height or 1.0)
        ids = torch.from_numpy(tok.ids).to(self._device)
        with torch.inference_mode():
            embeds = self._embed(ids)
            visual = 0
            why = self._why or ("text_only: no patches for this page" if patch is None else None)
            if why is None:
                fused = self._fusion.fuse_page(embeds, torch.from_numpy(tok.boxes).to(self._device),
                                               patch["features"].to(self._device), patch["grid"].to(self._device),
                                               patch["ink"].to(self._device))
                embeds, visual = fused.embeds, int(fused.visual.sum())
                token_ids = np.full(len(embeds), -1, dtype=np.int32)
                token_ids[fused.text_index.cpu().numpy()] = tok.ids
            else:
                token_ids = tok.ids.astype(np.int32)
        # a text-only page carries no rows: they would only repeat the decoder's embedding table (1.4 MB a page)
        return {**row, "token_ids": token_ids.tolist(), "fused": None if why else embeds.float().cpu().numpy(),
                "visual_tokens": visual, "fusion": why or "fused"}


def as_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """Rows (``fused`` a ``[N, H]`` array or None) as a table of ``schema``."""
    at = schema.get_field_index("fused")
    rest = pa.schema([f for f in schema if f.name != "fused"])
    table = pa.Table.from_pylist([{k: v for k, v in r.items() if k != "fused"} for r in rows], schema=rest)
    return table.add_column(at, schema.field("fused"), tensor_lists([r.get("fused") for r in rows],
                                                                     schema.field("fused").type))


def tensor_lists(arrays: list[np.ndarray | None], list_type: pa.ListType) -> pa.Array:
    """A list<fixed_shape_tensor[H]> column: row i holds ``arrays[i]``'s rows, null where it is None."""
    tensor_type = list_type.value_type
    hidden = int(np.prod(tensor_type.shape))
    parts = [a.reshape(-1, hidden) for a in arrays if a is not None]
    flat = np.concatenate(parts).astype(np.float32).ravel() if parts else np.zeros(0, dtype=np.float32)
    values = pa.ExtensionArray.from_storage(tensor_type, pa.FixedSizeListArray.from_arrays(pa.array(flat), hidden))
    lengths = [0 if a is None else a.reshape(-1, hidden).shape[0] for a in arrays]
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    mask = pa.array([a is None for a in arrays], pa.bool_())
    return pa.ListArray.from_arrays(offsets, values, type=list_type, mask=mask)


def fused_rows(column: pa.ChunkedArray | pa.Array, i: int) -> np.ndarray:
    """Row ``i`` of a ``fused`` column as ``[N, H]`` float32."""
    value = column[i]
    hidden = int(np.prod(column.type.value_type.shape))
    return np.array(value.values.storage.flatten(), dtype=np.float32).reshape(-1, hidden)  # a writable copy


def _verdict(meta: dict[str, str]) -> str | None:
    """Why a checkpoint should not be used by default: it lost to text-only on its own held-out pages.

    A stage's text has no hidden tokens, so a checkpoint's read path (fusion.reader) never acts here: what is
    judged is the fusion without it (``masked_recovery_without_reads``) where the checkpoint reports it."""
    held = json.loads(meta.get("held_out", "{}") or "{}")
    fused = held.get("masked_recovery_without_reads", held.get("masked_recovery_fused"))
    plain = held.get("masked_recovery_text_only")
    if fused is None or plain is None:
        return None
    if fused < plain:
        which = "without its read path " if "masked_recovery_without_reads" in held else ""
        return f"the checkpoint's held-out masked recovery {which}{fused:.3f} is below text-only's {plain:.3f}"
    return None


def _cost(meta: dict[str, str]) -> str:
    """What using a checkpoint costs a run: a render and a ViT pass per page and a slower prefill (MEASURED_COST),
    for a stream its held-out pages rate below text alone."""
    vision = f"{meta.get('vision_model', 'its ViT')} at {meta.get('image_size', '?')}"
    return (f"every page is then rendered at {meta.get('dpi', '?')} dpi and read by the checkpoint's ViT ({vision}) "
            f"and the fusion ({MEASURED_COST}), for answers from a stream that recovered fewer hidden tokens than "
            "text alone on its held-out pages")


def _rows(table: pa.Table, columns: tuple[str, ...]) -> list[dict]:
    present = [c for c in columns if c in table.column_names]
    data = {c: table.column(c).to_pylist() for c in present}
    return [{c: data[c][i] if c in data else None for c in columns} for i in range(table.num_rows)]


def _index_patches(patches: pa.Table) -> dict[tuple[str, int], dict]:
    """(doc_id, page) -> that page's patch tensors."""
    import torch

    if patches.num_rows == 0 or "patch_features" not in patches.column_names:
        return {}
    out = {}
    feats = _tensor(patches.column("patch_features"))
    grid = _tensor(patches.column("patch_grid")).astype(np.float32)
    ink = _tensor(patches.column("patch_ink"))
    for i, (doc, page) in enumerate(zip(patches.column("doc_id").to_pylist(), patches.column("page").to_pylist())):
        out[(doc, page)] = {"features": torch.from_numpy(feats[i]), "grid": torch.from_numpy(grid[i]),
                            "ink": torch.from_numpy(ink[i])}
    return out


def _tensor(column: pa.ChunkedArray) -> np.ndarray:
    """A fixed-shape tensor column as one ``[rows, *shape]`` array."""
    return np.concatenate([chunk.to_numpy_ndarray() for chunk in column.chunks]) if column.num_chunks else np.zeros(0)
