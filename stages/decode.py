"""decode.generate: answer questions about each document with a causal LM (the adapter to ``runtime``).

One row per (document, question). A document's pages are joined (in page order, with page markers) into one
prompt prefix that is prefilled once; every question then costs only its own suffix and the answer's decoding.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import pyarrow as pa
from pydantic import BaseModel, Field, ValidationError, field_validator

from docfuse.pipelines.registry import register
from docfuse.pipelines.stage import Stage, StageParams, error_value
from docfuse.stages import schemas

PAGE_COLUMNS = ("doc_id", "source", "page", "text")


def kv_store_for(params: Any, device: Any) -> Any:
    """The KV store ``params`` ask for on ``device``, or None: off with ``kv_store: false``, and on a GPU unless
    ``kv_store_gpu`` (there a fresh prefill beats a load; bench/RESULTS.md, issue 24)."""
    if not params.kv_store or (device.type == "cuda" and not params.kv_store_gpu):
        return None
    from docfuse.runtime.kv_store import KVStore

    return KVStore(params.kv_store, int(params.kv_store_max_gb * 1e9))


class DecodeParams(StageParams):
    model: str = Field("default", description="'default' (the embedded SmolLM2-135M-Instruct) or a local "
                                              "Hugging Face model folder")
    prompt: str = Field("{question}", description="template of the question text; {question} is replaced")
    max_new_tokens: int = Field(128, gt=0, description="most answer tokens per question")
    prefill_chunk: int | Literal["auto"] = Field(
        "auto", description="document tokens per prefill forward pass; auto: 512 on the CPU (it keeps its working "
                            "set in cache), 131072 on CUDA (a document of up to 128K in one pass, the fastest "
                            "attention there; the engine chunks by 8192 where that pass would take its streams' memory, "
                            "and a lone run retries in 8192 passes where it does not fit)")
    truncate: Literal["none", "head", "head_tail", "retrieve"] = Field(
        "none", description="a document longer than the context: none = error row, head = keep its beginning, "
                            "head_tail = keep beginning and end, retrieve = each question reads the pages that "
                            "match it best (BM25) and their neighbours (the built-in QA pipelines' default)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 on CUDA and on CPUs with native bf16, else float32")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available")
    kv: dict[str, Any] | None = Field(None, description="tiered KV cache budgets (core_tokens, association_tokens, "
                                      "association_bits, ...; see runtime.kv.KVConfig); null = a plain full cache")
    pruning: dict[str, Any] | None = Field(None, description="runtime block skipping in decode: {threshold: 0.15, "
                                           "safe_mode: false} (see runtime.pruning.PruningConfig); null = dense")
    system: str | None = Field(None, description="system message; null = answer from the document, concisely; "
                                                 "'' = the model's own default")
    stop: dict[str, Any] | bool | None = Field(
        default_factory=dict, description="end an answer at a stop string (a new 'Question:' turn, ...) or when it "
                                          "starts repeating itself: {strings: [...], repeat_tokens: 12} (see "
                                          "runtime.stopping.StopConfig); false (or null in YAML) = only at "
                                          "end-of-sequence. On the command line write --set answer.stop=false: "
                                          "--set KEY=null removes the key, which brings the default back")
    engine: Literal["auto", "on", "off"] = Field(
        "auto", description="the batched decode engine (runtime.engine): every question of every document of the "
                            "batch decodes together over paged tiers. auto = on CUDA with a kv: block it serves; "
                            "on = also on the CPU; off = one question at a time (runtime.session)")
    max_streams: int = Field(64, gt=0, description="most (document, question) streams the engine decodes at once")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 = greedy decoding (the default); above 0, "
                                                                "answers are sampled at this temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="with temperature > 0: sample from the most likely tokens "
                                                          "that hold this share of the probability")
    seed: int = Field(0, ge=0, description="with temperature > 0: the sampler's seed (per question, so answers "
                                           "repeat run after run)")
    kv_store: str | None = Field(None, description="a folder of prefilled documents' KV caches (runtime.kv_store): "
                                    "a document prefilled before is loaded instead of read again; false turns it off "
                                    "(docfuse run and ask use <cache-dir>/kv unless --no-cache). Full caches "
                                    "(kv: null) and tiered caches prefilled token by token, one question at a time "
                                    "and in the engine; a layer-major prefill is not stored")
    kv_store_max_gb: float = Field(20.0, gt=0, description="the KV store's size cap; least recently used go first")
    kv_store_gpu: bool = Field(False, description="use kv_store when decoding on a GPU too. Off by default: on an "
                               "H100 (8B model, 17.8K tokens) loading an entry took 2.3x a fresh prefill's first "
                               "token and storing it 20 s; the store pays where prefill is slow (the CPU)")
    cite: bool = Field(True, description="fill cited_pages: the pages the answer's own attention drew on most "
                                         "(one extra forward of the answer's tokens; a full cache only, kv: null)")
    ignore_eos: bool = Field(False, description="decode max_new_tokens for every answer, past end-of-sequence "
                                                "(benchmarks)")

    @field_validator("prefill_chunk")
    @classmethod
    def _chunk(cls, value: int | str) -> int | str:
        if value != "auto" and value <= 0:
            raise ValueError(f"prefill_chunk {value} must be a positive token count, or auto")
        return value

    @field_validator("kv_store", mode="before")
    @classmethod
    def _kv_store(cls, value: Any) -> Any:
        if value is False:  # the off switch: a null would drop the key and let the CLI's default come back
            return None
        if value is True:
            raise ValueError("kv_store takes a folder (or false to turn the store off)")
        return value

    @field_validator("kv")
    @classmethod
    def _kv(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from docfuse.runtime.kv import KVConfig

        return _sub_block("kv", KVConfig, value)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: dict[str, Any] | bool | None) -> dict[str, Any] | None:
        from docfuse.runtime.stopping import StopConfig

        if value is False:  # the off switch --set can write (null there removes the key: the default, on)
            return None
        if value is True:
            value = {}
        return _sub_block("stop", StopConfig, value)

    @field_validator("pruning")
    @classmethod
    def _pruning(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from docfuse.runtime.pruning import PruningConfig

        return _sub_block("pruning", PruningConfig, value)

    @field_validator("prompt")
    @classmethod
    def _template(cls, value: str) -> str:
        try:
            value.format(question="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"prompt {value!r} is not a template with only {{question}} in it ({exc!r}); "
                             "write literal braces as {{ and }}") from exc
        if "{question}" not in value:
            raise ValueError(f"prompt {value!r} never uses {{question}}; for example 'Answer briefly: {{question}}'")
        return value


def _sub_block(name: str, config: type[BaseModel], value: dict[str, Any] | None) -> dict[str, Any] | None:
    """Validate a nested block (``kv:``, ``pruning:``) with its runtime config; every problem named, with its path."""
    if value is None:
        return None
    try:
        return config(**value).model_dump(mode="json")
    except ValidationError as exc:
        accepted = ", ".join(config.model_fields)
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or name
            hint = f"; accepted keys: {accepted}" if err["type"] == "extra_forbidden" else ""
            problems.append(f"{name}.{key}: {err['msg']}{hint}")
        raise ValueError("; ".join(problems)) from None


@register
class DecodeGenerate(Stage):
    """Answer the pipeline's question(s) about each document from its page text, one prefill per document."""

    kind = "decode.generate"
    version = "3"
    Params = DecodeParams
    inputs: ClassVar[dict[str, pa.Schema]] = {
        "pages": pa.schema([schemas.PAGE_TEXT.field(name) for name in PAGE_COLUMNS]),
    }
    output_schema = schemas.QA
    reads_params = ("question", "questions", "safe_mode")
    resources: ClassVar[dict[str, float]] = {"num_cpus": 1}

    session: Any = None
    engine: Any = None
    #: Why the engine does not serve this stage (None when it does, or when it was not asked for).
    engine_note: str | None = None
    #: ``params.prefill_chunk`` resolved for the model's device (``setup``; runtime.loading.prefill_chunk_for)
    prefill_chunk: int = 512

    def setup(self) -> None:
        from docfuse.runtime.engine import Engine, engine_unsupported
        from docfuse.runtime.loading import prefill_chunk_for
        from docfuse.runtime.prompt import DEFAULT_SYSTEM, ChatPrompt
        from docfuse.runtime.session import Sampling, Session
        from docfuse.stages.models import shared_model

        p = self.params
        model, tokenizer = shared_model(p.model, p.dtype, p.device)
        system = DEFAULT_SYSTEM if p.system is None else (p.system or None)
        store = kv_store_for(p, next(model.parameters()).device)
        self.session = Session(model, tokenizer, ChatPrompt(tokenizer, system), kv=p.kv,
                               pruning=p.pruning, stop=p.stop, cite=p.cite,
                               sampling=Sampling(p.temperature, p.top_p, p.seed), kv_store=store)
        if p.ignore_eos:
            self.session.stop_ids = set()
        self.prefill_chunk = prefill_chunk_for(p.prefill_chunk, self.session.device)
        wanted = p.engine == "on" or (p.engine == "auto" and self.session.device.type == "cuda" and p.kv is not None)
        if wanted:
            self.engine_note = engine_unsupported(model, p.kv, p.pruning, p.temperature)
            if self.engine_note is None:
                stopper = self.session.stopper
                self.engine = Engine(model, p.kv, self.session.stop_ids, max_streams=p.max_streams,
                                     prefill_chunk=None if p.prefill_chunk == "auto" else self.prefill_chunk,
                                     stop_when=stopper.should_stop if stopper is not None else None,
                                     kv_store=store)
            else:
                print(f"decode.generate: the batched engine does not serve {self.engine_note}; decoding one question "
                      "at a time", file=sys.stderr)

    def questions(self) -> list[str]:
        """``params.questions`` (a list) when given, else ``[params.question]``; ValueError naming the fix."""
        value = self.context.get("questions")
        if value is None:
            value = self.context.get("question")
        if isinstance(value, str):
            value = [value]
        if not value or not all(isinstance(q, str) and q.strip() for q in value):
            raise ValueError('no question to answer; pass --set params.question="..." '
                             "(or a list: --set 'params.questions=[\"a\", \"b\"]')")
        return list(value)

    def pass_errors(self, errors: pa.Table) -> pa.Table:
        """Upstream errors in the pdf_qa grain: one row per (document, question), each carrying the error."""
        try:
            questions: list[str | None] = list(self.questions())
        except ValueError:
            questions = [None]
        rows, seen = [], set()
        for r in errors.to_pylist():
            if (r["doc_id"], r["error"]) in seen:
                continue
            seen.add((r["doc_id"], r["error"]))
            rows.extend(_row(r["doc_id"], r.get("source"), q, error=r["error"]) for q in questions)
        return pa.Table.from_pylist(rows, schema=self.output_schema)

    def run(self, pages: pa.Table) -> pa.Table:
        from docfuse.pipelines.progress import LIVE

        live = LIVE.get()
        if live is None:
            return self._run(pages)
        from docfuse.runtime.session import PROGRESS, Progress

        token = PROGRESS.set(Progress(on_prefill=live.on_prefill, on_text=live.on_text))
        try:
            return self._run(pages)
        finally:
            PROGRESS.reset(token)

    def _run(self, pages: pa.Table) -> pa.Table:
        rows: list[dict] = []
        try:
            questions = self.questions()
        except ValueError as exc:
            for doc_id, doc in group_pages(pages).items():
                rows.append(_row(doc_id, doc["source"], None, error=error_value("no_question", str(exc))))
            return pa.Table.from_pylist(rows, schema=self.output_schema)
        from docfuse.runtime.prompt import document_text

        fused = fused_pages(pages) if "fused" in pages.column_names else {}
        docs = group_pages(pages)
        if self.session is None and any(document_text(d["pages"]) or fused.get(i) for i, d in docs.items()):
            self.setup()  # only when some document has something to read: error rows need no model
        if self.engine is not None:
            return pa.Table.from_pylist(self._answer_together(docs, questions, fused), schema=self.output_schema)
        for doc_id, doc in docs.items():
            rows.extend(self._answer_document(doc_id, doc, questions, fused.get(doc_id)))
        return pa.Table.from_pylist(rows, schema=self.output_schema)

    def _reads(self, pages: list[tuple[int, str]], questions: list[str], prompts: list[str],
               fused: list[tuple[int, Any]] | None) -> list[_Read]:
        """How the document is read: one prefix for every question, or with ``truncate: retrieve`` on a document
        past the context, one prefix per set of pages the questions chose. Raises ``ContextTooLong`` otherwise."""
        from docfuse.runtime.page_select import PageIndex
        from docfuse.runtime.prompt import document_text
        from docfuse.runtime.session import ContextTooLong

        p, session = self.params, self.session
        everyone = list(range(len(questions)))
        if fused:
            ids, embeds, cut = self._fused_prefix(fused, prompts)
            return [_Read(everyone, ids, embeds, None if cut else [page for page, _ in fused], cut)]
        with_text = [page for page, text in pages if text and text.strip()]
        try:
            prefix = session.fit_document(document_text(pages), questions=prompts, max_new_tokens=p.max_new_tokens,
                                          truncate="none" if p.truncate == "retrieve" else p.truncate)
            return [_Read(everyone, list(prefix.ids), None, None if prefix.truncated else with_text,
                          prefix.truncated)]
        except ContextTooLong:
            if p.truncate != "retrieve":
                raise
        index = PageIndex(pages, lambda text: len(session.prompt.encode(text)))
        head = len(session.prompt.prefix(""))
        groups: dict[Any, list[int]] = {}
        for i, question in enumerate(questions):
            reserve = len(session.prompt.suffix(prompts[i])) + p.max_new_tokens
            chosen = index.select(question, session.limit - reserve - head)
            groups.setdefault(chosen, []).append(i)
        reads = []
        for chosen, members in groups.items():
            prefix = session.fit_document(index.text(chosen), questions=[prompts[i] for i in members],
                                          max_new_tokens=p.max_new_tokens, truncate="head")
            reads.append(_Read(members, list(prefix.ids), None, list(chosen.pages), True))
        return reads

    def _answer_together(self, docs: dict[str, dict[str, Any]], questions: list[str],
                         fused: dict[str, list[tuple[int, Any]]]) -> list[dict]:
        """Every question of every document through the engine at once; rows in document order."""
        from docfuse.runtime.engine import Document

        p = self.params
        prompts = [p.prompt.format(question=q) for q in questions]
        suffixes = [list(self.session.prompt.suffix(q)) for q in prompts]
        jobs: list[tuple[str, Any, _Read]] = []
        failed: dict[str, list[dict]] = {}
        for doc_id, doc in docs.items():
            reads, errors = self._plan(doc_id, doc, questions, prompts, fused.get(doc_id))
            if errors:
                failed[doc_id] = errors
            jobs.extend((doc_id, doc["source"], read) for read in reads)
        outputs = self.engine.run([Document(read.ids, [suffixes[i] for i in read.questions], p.max_new_tokens,
                                            read.embeds, source=str(source)) for _, source, read in jobs])
        by_doc: dict[str, dict[int, dict]] = {}
        for (doc_id, source, read), outs in zip(jobs, outputs):
            for i, out in zip(read.questions, outs):
                if out.error:
                    kind, _, message = out.error.partition(": ")
                    row = _row(doc_id, source, questions[i], error=error_value(kind, message))
                else:
                    row = _answered(doc_id, source, questions[i], read, self._text(out.tokens), out)
                by_doc.setdefault(doc_id, {})[i] = row
        rows: list[dict] = []
        for doc_id in docs:
            rows.extend(failed[doc_id] if doc_id in failed else [by_doc[doc_id][i] for i in range(len(questions))])
        return rows

    def _text(self, tokens: list[int]) -> str:
        stopper = self.session.stopper
        if stopper is not None:
            return stopper.text(tokens)
        return self.session.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def _plan(self, doc_id: str, doc: dict[str, Any], questions: list[str], prompts: list[str],
              fused: list[tuple[int, Any]] | None) -> tuple[list[_Read], list[dict]]:
        """A document's reads, or its error rows (one per question) when it has no text or cannot fit."""
        from docfuse.runtime.prompt import document_text
        from docfuse.runtime.session import ContextTooLong

        source, pages = doc["source"], doc["pages"]

        def errors(kind: str, message: str) -> list[dict]:
            return [_row(doc_id, source, q, error=error_value(kind, message)) for q in questions]

        if not document_text(pages) and not fused:
            return [], errors("no_text", f"none of the document's {len(pages)} page(s) has text; image-only pages "
                                         "need OCR or the fusion stage (trained) before decode.generate")
        try:
            return self._reads(pages, questions, prompts, fused), []
        except ContextTooLong as exc:
            return [], errors("context_too_long", _too_long(exc))

    def _answer_document(self, doc_id: str, doc: dict[str, Any], questions: list[str],
                         fused: list[tuple[int, Any]] | None = None) -> list[dict]:
        p = self.params
        prompts = [p.prompt.format(question=q) for q in questions]
        reads, errors = self._plan(doc_id, doc, questions, prompts, fused)
        if errors:
            return errors
        rows: dict[int, dict] = {}
        for read in reads:
            self.session.prefill(read.ids, chunk_size=self.prefill_chunk, embeds=read.embeds,
                                 source=doc.get("source") or "")
            self.session.read_questions([prompts[i] for i in read.questions])  # kv.questions: together only
            for i in read.questions:
                a = self.session.ask(prompts[i], max_new_tokens=p.max_new_tokens,
                                     safe_mode=self.context.get("safe_mode"))
                rows[i] = _answered(doc_id, doc["source"], questions[i], read, a.text, a)
        return [rows[i] for i in range(len(questions))]

    def _fused_prefix(self, fused: list[tuple[int, Any]], prompts: list[str]) -> tuple[list[int], Any, bool]:
        """Prompt head + per page (marker, fused rows), pages joined as document_text joins them; and whether the
        stream was cut to fit."""
        import torch

        from docfuse.runtime.prompt import page_marker
        from docfuse.runtime.session import ContextTooLong

        with torch.inference_mode():  # embedding lookups only: no autograd graph
            session, p = self.session, self.params
            embed = session.model.get_input_embeddings()
            encode = session.prompt.encode
            head = list(session.prompt.prefix("").ids)
            ids, parts = list(head), [embed(torch.tensor(head, device=session.device))]
            for n, (page, (page_ids, rows)) in enumerate(fused):
                lead = encode(("\n\n" if n else "") + f"{page_marker(page)}\n")
                ids += lead + [max(i, 0) for i in page_ids]
                page_rows = embed(torch.tensor(page_ids, device=session.device)) if rows is None else \
                    torch.from_numpy(rows).to(session.device)  # a text-only page: the decoder's own embeddings
                parts += [embed(torch.tensor(lead, device=session.device)), page_rows]
            reserve = max(len(session.prompt.suffix(q)) for q in prompts) + p.max_new_tokens
            cut = len(ids) + reserve > session.limit
            if cut:
                if p.truncate == "none" or session.limit - reserve <= len(head):
                    raise ContextTooLong(len(ids), reserve, session.limit)
                # head, head_tail and retrieve keep the beginning of a fused stream
                ids = ids[:session.limit - reserve]
            return ids, torch.cat(parts)[:len(ids)], cut


def fused_pages(table: pa.Table) -> dict[str, list[tuple[int, Any]]]:
    """doc_id -> [(page, (token_ids, fused rows))] in page order, for documents where fusion.gate fused a page.

    A document whose pages all stayed text-only is left out: it takes the text path, exactly as without fusion.
    """
    from docfuse.stages.fuse import fused_rows

    docs: dict[str, list] = {}
    applied: set[str] = set()
    column = table.column("fused").combine_chunks()
    for i, (doc, page, ids, how) in enumerate(zip(*(table.column(c).to_pylist() for c in
                                                   ("doc_id", "page", "token_ids", "fusion")))):
        if not ids:
            continue
        if how == "fused":
            applied.add(doc)
        rows = fused_rows(column, i) if column[i].is_valid else None
        docs.setdefault(doc, []).append((page or 0, (ids, rows)))
    return {d: sorted(pages, key=lambda x: x[0]) for d, pages in docs.items() if d in applied}


def group_pages(table: pa.Table) -> dict[str, dict[str, Any]]:
    """Rows grouped by ``doc_id`` in order of first appearance; each document's ``(page, text)`` sorted by page."""
    docs: dict[str, dict[str, Any]] = {}
    columns: Sequence[list] = [table.column(name).to_pylist() for name in PAGE_COLUMNS]
    for doc_id, source, page, text in zip(*columns):
        doc = docs.setdefault(doc_id, {"source": source, "pages": []})
        if doc["source"] is None:
            doc["source"] = source
        doc["pages"].append((page if page is not None else 0, text or ""))
    for doc in docs.values():
        doc["pages"].sort(key=lambda item: item[0])
    return docs


@dataclass
class _Read:
    """One prefill of a document and the questions (by index) it serves; the pages it holds (None: not known page by
    page, e.g. after a head cut) and whether pages or text were left out."""

    questions: list[int]
    ids: list[int]
    embeds: Any
    pages_used: list[int] | None
    truncated: bool


def _answered(doc_id: str, source: str | None, question: str, read: _Read, text: str, m: Any) -> dict:
    """An answer's row; ``m`` is a ``Session`` Answer or an engine StreamOutput (the same measurement names)."""
    return _row(doc_id, source, question, answer=text, prompt_tokens=m.prompt_tokens, ttft_s=m.ttft_s,
                decode_tokens_per_s=m.decode_tokens_per_s, kv_device_bytes=m.kv_device_bytes,
                kv_host_bytes=m.kv_host_bytes, kv_full_bytes=m.kv_full_bytes,
                skipped_fraction=getattr(m, "skipped_fraction", 0.0), peak_memory_bytes=m.peak_memory_bytes,
                pages_used=read.pages_used, truncated=read.truncated, cited_pages=getattr(m, "cited_pages", None))


def _too_long(exc: Exception) -> str:
    return (f"{exc}; set truncate: retrieve (each question reads the pages that match it best) or head "
            "(--set answer.truncate=retrieve), or use a model with a longer context")


def _row(doc_id: str, source: str | None, question: str | None, **values: Any) -> dict:
    return schemas.empty_row(schemas.QA, doc_id=doc_id, source=source, question=question, **values)
