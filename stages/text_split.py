"""Split a text into pages: at form feeds when the file has them, else into pages of about ``page_chars`` characters.

A page ends at a paragraph boundary (a blank line). In Markdown a page prefers to start at a heading, fenced code
blocks are never cut at their blank lines, and ``#`` lines inside them are not headings. A paragraph longer than a
page is cut at a line end, else a sentence end, else a space, else exactly at ``page_chars``. Pages are spans of the
original text, so everything between two paragraphs on one page (blank lines, indentation) is kept as written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ATX_HEADING = re.compile(r" {0,3}#{1,6}(?:[ \t]|$)")
_SETEXT_UNDERLINE = re.compile(r" {0,3}(?:=+|-+)[ \t]*$")
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s")
_LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")

#: A Markdown page breaks at an earlier heading rather than at the last paragraph when that keeps it this full.
HEADING_MIN_FILL = 0.5


@dataclass(frozen=True)
class Block:
    """A paragraph (or heading section start, or fenced code block) as a span of the text."""

    start: int
    end: int
    heading: bool = False


def split_pages(text: str, page_chars: int, markdown: bool = False) -> list[str]:
    """The pages of ``text``; form feeds win over ``page_chars``. Blank pages between form feeds are kept."""
    if "\f" in text:
        parts = text.split("\f")
        if not parts[-1].strip():  # a file that ends every page with \f (pdftotext) has no page after the last one
            parts.pop()
        return [_trim(part) for part in parts]
    blocks = [piece for block in paragraph_blocks(text, markdown) for piece in _cut_long(text, block, page_chars)]
    return [_trim(text[first.start:last.end]) for first, last in _pack(blocks, page_chars)]


def paragraph_blocks(text: str, markdown: bool) -> list[Block]:
    """Maximal runs of non-blank lines; in Markdown a heading starts a block and a code fence holds blank lines."""
    blocks: list[Block] = []
    start: int | None = None
    end = 0
    heading = False
    fence: str | None = None
    offset = 0
    lines = text.split("\n")
    for i, line in enumerate(lines):
        line_start, line_end = offset, offset + len(line)
        offset = line_end + 1
        if markdown and fence is not None:  # inside a fenced code block: nothing splits it
            if line.lstrip(" ").startswith(fence):
                fence = None
            end = line_end
            continue
        if not line.strip():
            if start is not None:
                blocks.append(Block(start, end, heading))
                start = None
            continue
        fence_match = _FENCE.match(line) if markdown else None
        starts_heading = markdown and (
            bool(_ATX_HEADING.match(line))
            or (start is None and i + 1 < len(lines) and lines[i + 1].strip() and bool(_SETEXT_UNDERLINE.match(lines[i + 1])))
        )
        if starts_heading and start is not None:
            blocks.append(Block(start, end, heading))
            start = None
        if start is None:
            start, heading = line_start, starts_heading
        end = line_end
        if fence_match:
            fence = fence_match.group(1)
    if start is not None:
        blocks.append(Block(start, end, heading))
    return blocks


def _cut_long(text: str, block: Block, page_chars: int) -> list[Block]:
    """Cut a block longer than a page at line, sentence or word ends, so that no piece exceeds ``page_chars``."""
    pieces: list[Block] = []
    start, heading = block.start, block.heading
    while block.end - start > page_chars:
        window = text[start:start + page_chars + 1]  # +1: a break right after the last allowed character is fine
        cut = _best_cut(window, page_chars)
        piece_end = start + len(window[:cut].rstrip())
        if piece_end > start:
            pieces.append(Block(start, piece_end, heading))
            heading = False
        start += cut
        while start < block.end and text[start].isspace():
            start += 1
    if start < block.end:
        pieces.append(Block(start, block.end, heading))
    return pieces


def _best_cut(window: str, page_chars: int) -> int:
    """Where to cut a window: last newline, else last sentence end, else last space (in the later half), else hard."""
    floor = page_chars // 2
    newline = window.rfind("\n", 0, page_chars + 1)
    if newline >= floor:
        return newline + 1
    sentence_ends = [m.end() for m in _SENTENCE_END.finditer(window) if m.end() <= page_chars + 1]
    if sentence_ends and sentence_ends[-1] >= floor:
        return sentence_ends[-1]
    space = max(window.rfind(" ", 0, page_chars + 1), window.rfind("\t", 0, page_chars + 1))
    if space >= floor:
        return space + 1
    return page_chars


def _pack(blocks: list[Block], page_chars: int) -> list[tuple[Block, Block]]:
    """Greedy: fill a page with whole blocks; on overflow, break before a late heading if there is one."""
    pages: list[tuple[Block, Block]] = []
    first = 0
    while first < len(blocks):
        last = first
        while last + 1 < len(blocks) and blocks[last + 1].end - blocks[first].start <= page_chars:
            last += 1
        if last + 1 < len(blocks) and not blocks[last + 1].heading:
            for k in range(last, first, -1):
                if blocks[k].heading and blocks[k].start - blocks[first].start >= HEADING_MIN_FILL * page_chars:
                    last = k - 1
                    break
        pages.append((blocks[first], blocks[last]))
        first = last + 1
    return pages


def _trim(page: str) -> str:
    """Drop blank lines before a page and whitespace after it; keep the first line's indentation."""
    return _LEADING_BLANK_LINES.sub("", page).rstrip()
