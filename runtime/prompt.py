"""Chat prompts split into a document PREFIX and a question SUFFIX.

The document goes first so its tokens are identical for every question: one prefill of the document serves many
questions, each of which only prefills its own short suffix. The split is made on the rendered chat template:
the conversation is rendered once with placeholder markers, cut at the markers, and each part is tokenised on its
own (``add_special_tokens=False``: the template already carries any BOS/role tokens).

Pages are joined with markers ``--- page N ---`` where N is 1-based (as people number pages); page text already
holds Markdown headings and tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

DEFAULT_SYSTEM = (
    "You answer questions about the document the user gives you. Answer only from the document, "
    "concisely, in a few words or one sentence. If the document does not contain the answer, say so."
)
_DOC = "\x00DOCFUSE_DOCUMENT\x00"
_QUESTION = "\x00DOCFUSE_QUESTION\x00"
_DOCUMENT_LEAD = "Document:\n"
_QUESTION_LEAD = "\n\nQuestion: "
_ELISION = "\n[...]\n"

Truncate = Literal["none", "head", "head_tail"]


def page_marker(page: int) -> str:
    """The marker before a page's text; ``page`` is 0-based as in the Arrow tables, printed 1-based."""
    return f"--- page {page + 1} ---"


def document_text(pages: Iterable[tuple[int, str]]) -> str:
    """Join ``(page, text)`` pairs in page order; pages without text (image-only, empty) contribute nothing."""
    parts = [f"{page_marker(page)}\n{text.strip()}" for page, text in sorted(pages, key=lambda p: p[0])
             if text and text.strip()]
    return "\n\n".join(parts)


@dataclass(frozen=True)
class DocumentPrefix:
    """Token ids of the prompt up to the end of the document; ``ids[body_start:]`` is the document itself."""

    ids: tuple[int, ...]
    body_start: int
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def body_tokens(self) -> int:
        return len(self.ids) - self.body_start


@dataclass
class ChatPrompt:
    """Builds prefix and suffix token ids for one tokenizer and system message."""

    tokenizer: Any
    system: str | None = DEFAULT_SYSTEM
    _head: str = field(init=False, repr=False)
    _between: str = field(init=False, repr=False)
    _tail: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._head, self._between, self._tail = _split_template(self.tokenizer, self.system)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens (the template carries them)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    def prefix(self, document: str) -> DocumentPrefix:
        """Prompt tokens up to the end of the document: identical for every question on it."""
        head = self.encode(self._head)
        return DocumentPrefix(tuple(head + self.encode(document)), body_start=len(head))

    def suffix(self, question: str) -> list[int]:
        """Prompt tokens after the document: the question and the assistant turn's opening."""
        return self.encode(self._between + question.strip() + self._tail)

    def elision(self) -> list[int]:
        """Tokens that mark where ``head_tail`` truncation cut the document."""
        return self.encode(_ELISION)


def _split_template(tokenizer: Any, system: str | None) -> tuple[str, str, str]:
    """Render the chat template with markers and cut it into (before document, document->question, after)."""
    user = f"{_DOCUMENT_LEAD}{_DOC}{_QUESTION_LEAD}{_QUESTION}"
    text = None
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": user}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # templates that refuse a system role: put the instruction in the user turn
            if not system:
                raise
            merged = [{"role": "user", "content": f"{system}\n\n{user}"}]
            text = tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)
    if text is None:  # a base model without a chat template: a plain transcript
        text = (f"{system}\n\n" if system else "") + f"{user}\nAnswer:"
    if text.count(_DOC) != 1 or text.count(_QUESTION) != 1 or text.index(_DOC) > text.index(_QUESTION):
        raise ValueError("the tokenizer's chat template does not keep the user message in one piece; "
                         "use a model whose chat template renders the user content verbatim")
    head, rest = text.split(_DOC)
    between, tail = rest.split(_QUESTION)
    return head, between, tail


def truncate_prefix(prefix: DocumentPrefix, max_tokens: int, mode: Truncate,
                    elision: Sequence[int] = ()) -> DocumentPrefix:
    """Shorten the document so the whole prefix holds at most ``max_tokens`` tokens.

    ``head`` keeps the document's beginning; ``head_tail`` keeps its beginning and end with ``elision`` between
    (often the abstract and the conclusion). ``none`` returns the prefix unchanged. The template head is never cut.
    """
    if mode == "none" or len(prefix) <= max_tokens:
        return prefix
    budget = max_tokens - prefix.body_start
    if budget <= 0:
        raise ValueError(f"max_tokens={max_tokens} leaves no room for the document after the "
                         f"{prefix.body_start}-token prompt head")
    head, body = list(prefix.ids[:prefix.body_start]), list(prefix.ids[prefix.body_start:])
    if mode == "head":
        kept = body[:budget]
    elif mode == "head_tail":
        mark = list(elision)
        room = budget - len(mark)
        if room <= 1:
            kept = body[:budget]
        else:
            front = (room + 1) // 2
            kept = body[:front] + mark + body[len(body) - (room - front):]
    else:
        raise ValueError(f"unknown truncate mode '{mode}'; use none, head or head_tail")
    return DocumentPrefix(tuple(head + kept), body_start=prefix.body_start, truncated=True)
