"""Line-level repairs of a page's text layer before its layout: what MuPDF's lines get wrong on common layouts.

- **Margin line numbers** (court transcripts, pleadings, depositions): a column of small integers in a margin, one
  beside each text line. MuPDF makes each number a line of its own, so the layout would read them as a column (and a
  table finder as a table). ``take_line_numbers`` lifts them off the page before tables are looked for;
  ``restore_line_numbers`` puts each back at the start of the line it numbers (``keep``, as a transcript is cited:
  "page 4, line 12") or leaves it out (``drop``). A number beside no text (the blank lines of pleading paper) goes.
- **Raised markers** (footnote and reference markers set as superscripts): a small word on a raised baseline
  becomes a line of its own and splits the paragraph it sits in. ``attach_raised_markers`` moves it into the line it
  is raised above, after the word it follows.
- **Letter-spaced words** ("S U M M A R Y" in a heading): each letter is a word of its own. ``join_spaced_letters``
  joins runs of evenly spaced single capitals back into words, splitting where the gap is a word gap.
- **Label/value rows** of forms ("Name:" with its value far to its right): ``join_label_values`` joins the value to
  its label's line, so that a form reads row by row ("Name: Ada Lovelace") and group by group, not all labels then
  all values.

- **Duplicated text layers** (an invisible OCR layer over visible text, text drawn twice for a bold effect): the same
  word in the same box more than once. ``drop_duplicate_words`` keeps the first.

Each other repair keeps every word (only its line changes), so the words, boxes and tables downstream see the same
text.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from docfuse.stages.pdf_extract import Line, PageContent, Word

LineNumbers = Literal["keep", "drop"]

MIN_NUMBERED_LINES = 5       # a margin column needs this many numbers
MAX_LINE_NUMBER = 99
ALIGN_TOLERANCE = 3.0        # pt: numbers of one column share their right (or left) edge within this
MIN_ASCENDING = 0.8          # share of consecutive numbers (top to bottom) that go up by one
MIN_BESIDE_TEXT = 0.4        # share of the numbers that sit beside a text line (pleading paper numbers blanks too)
RAISED_SIZE = 0.85           # a marker's size is at most this share of its line's
MAX_MARKER_CHARS = 3
MIN_SPACED_LETTERS = 4
MAX_LABEL_WORDS = 6

_NUMBER = re.compile(r"^\d{1,2}$")
_MARKER = re.compile(r"^(\d{1,3}|[*†‡§¶]+|[a-z])$")


class _Rows:
    """Lines indexed by height on the page: the lines near a height in constant time on average, so that a page of
    thousands of tiny lines is not compared line against line."""

    def __init__(self, lines: list[Line], step: float = 6.0) -> None:
        self.step = step
        self.buckets: dict[int, list[tuple[Line, tuple[float, float, float, float], float]]] = {}
        for line in lines:
            box = line.bbox
            entry = (line, box, line.size)
            for k in range(int(box[1] // step), int(box[3] // step) + 1):
                self.buckets.setdefault(k, []).append(entry)

    def near(self, y0: float, y1: float) -> list[tuple[Line, tuple[float, float, float, float], float]]:
        """(line, box, size) of the lines whose box reaches near ``[y0, y1]``, each once."""
        seen: dict[int, tuple] = {}
        for k in range(int(y0 // self.step) - 1, int(y1 // self.step) + 2):
            for entry in self.buckets.get(k, ()):
                seen[id(entry[0])] = entry
        return list(seen.values())


@dataclass
class LineNumber:
    """A margin line number lifted off the page, and the text line it numbers (None: a blank line's number)."""

    word: Word
    line: Line | None


def _keep_lines(content: PageContent, keep: Callable[[Line], bool]) -> None:
    """Leave only the lines ``keep`` accepts in ``content``'s blocks (in place); blocks left empty go."""
    content.blocks = [kept for kept in ([line for line in block if keep(line)] for block in content.blocks) if kept]


def _single_words(content: PageContent) -> list[tuple[Word, Line]]:
    return [(line.words[0], line) for block in content.blocks for line in block
            if line.horizontal and len(line.words) == 1]


def _aligned_groups(candidates: list[tuple[Word, Line]], edge) -> list[list[tuple[Word, Line]]]:
    ordered = sorted(candidates, key=lambda c: edge(c[0]))
    groups: list[list[tuple[Word, Line]]] = []
    for c in ordered:
        if groups and edge(c[0]) - edge(groups[-1][0][0]) <= ALIGN_TOLERANCE:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def _beside(number: Word, rows: _Rows, left_margin: bool) -> Line | None:
    """The text line on the number's baseline, on the text side of the margin (nearest first)."""
    best, best_gap = None, float("inf")
    for line, (x0, y0, x1, y1), _ in rows.near(number.y0, number.y1):
        if abs((y0 + y1) / 2 - number.cy) > 0.5 * max(number.y1 - number.y0, y1 - y0):
            continue
        gap = x0 - number.x1 if left_margin else number.x0 - x1
        if -1.0 <= gap < best_gap:
            best, best_gap = line, gap
    return best


def take_line_numbers(content: PageContent) -> list[LineNumber]:
    """Lift a margin column of line numbers off ``content`` (in place); returns them with the lines they number."""
    candidates = [(w, line) for w, line in _single_words(content)
                  if _NUMBER.match(w.text) and 0 < int(w.text) <= MAX_LINE_NUMBER]
    if len(candidates) < MIN_NUMBERED_LINES:
        return []
    for edge in (lambda w: w.x1, lambda w: w.x0):
        for group in _aligned_groups(candidates, edge):
            found = _numbered_column(content, group)
            if found:
                taken = {id(n.word) for n in found}
                _keep_lines(content, lambda line: not (len(line.words) == 1 and id(line.words[0]) in taken))
                return found
    return []


def _numbered_column(content: PageContent, group: list[tuple[Word, Line]]) -> list[LineNumber]:
    if len(group) < MIN_NUMBERED_LINES:
        return []
    group = sorted(group, key=lambda c: c[0].cy)
    values = [int(w.text) for w, _ in group]
    # line numbers count up by one (a contents page's right-aligned page numbers jump)
    steps = sum(b == a + 1 for a, b in zip(values, values[1:]))
    # and start the page at 1 (a transcript's or a pleading's page); a contents page lists pages 37, 38, 39, ...
    if steps < MIN_ASCENDING * (len(values) - 1) or values[0] > 2:
        return []
    own = {id(line) for _, line in group}
    text_lines = [line for block in content.blocks for line in block if line.horizontal and id(line) not in own]
    if not text_lines:
        return []
    x0 = min(w.x0 for w, _ in group)
    x1 = max(w.x1 for w, _ in group)
    left = sum(line.bbox[0] >= x1 - 1.0 for line in text_lines)
    right = sum(line.bbox[2] <= x0 + 1.0 for line in text_lines)
    # a margin: (nearly) all the page's text lies on one side of the column
    if max(left, right) < 0.9 * len(text_lines):
        return []
    left_margin = left >= right
    rows = _Rows(text_lines)
    found = [LineNumber(w, _beside(w, rows, left_margin)) for w, _ in group]
    if sum(n.line is not None for n in found) < MIN_BESIDE_TEXT * len(found):
        return []
    return found


def restore_line_numbers(numbers: list[LineNumber], mode: LineNumbers) -> None:
    """``keep``: each number goes back at the start of the line it numbers; ``drop``: they stay out."""
    if mode != "keep":
        return
    for n in numbers:
        if n.line is not None and n.line.words:
            n.line.words.insert(0, n.word)


def attach_raised_markers(content: PageContent) -> None:
    """Move each raised marker (a short, smaller word on a line of its own, its baseline above the middle of a text
    line it touches horizontally) into that line, after the word it follows."""
    rows = _Rows([line for block in content.blocks for line in block if line.horizontal])
    moved: set[int] = set()
    for w, own in _single_words(content):
        if not _MARKER.match(w.text) or len(w.text) > MAX_MARKER_CHARS:
            continue
        host = _raised_over(w, own, rows.near(w.y0, w.y1))
        if host is None:
            continue
        at = sum(x.x0 < w.x0 for x in host.words)
        host.words.insert(at, w)
        moved.add(id(own))
    if moved:
        _keep_lines(content, lambda line: id(line) not in moved)


def _raised_over(w: Word, own: Line, near: list[tuple]) -> Line | None:
    for line, (x0, y0, x1, y1), size in near:
        if line is own or not line.words or w.size > RAISED_SIZE * size or w.x1 < x0 - size or w.x0 > x1 + size:
            continue
        mid = (y0 + y1) / 2
        # raised: the marker's middle above the line's, its top no higher than a third of a line above it
        if not (w.cy < mid - 0.05 * (y1 - y0) and w.y0 > y0 - 0.35 * (y1 - y0)):
            continue
        # touching: right after one of the line's words (or right before the first one)
        if any(-1.0 <= w.x0 - word.x1 <= 0.5 * word.size for word in line.words) or \
                -1.0 <= line.words[0].x0 - w.x1 <= 0.3 * size:
            return line
    return None


def join_spaced_letters(content: PageContent) -> None:
    """Join runs of evenly spaced single capitals ("S U M M A R Y") into words, in place."""
    for block in content.blocks:
        for line in block:
            if line.horizontal and len(line.words) >= MIN_SPACED_LETTERS:
                line.words = _joined(line.words)


def _joined(words: list[Word]) -> list[Word]:
    out: list[Word] = []
    i = 0
    while i < len(words):
        j = i
        while j < len(words) and _spaced_letter(words[j]):
            j += 1
        if j - i >= MIN_SPACED_LETTERS and _even(words[i:j]):
            out.extend(_words_of(words[i:j]))
            i = j
        else:
            out.append(words[i])
            i += 1
    return out


def _spaced_letter(w: Word) -> bool:
    return len(w.text) == 1 and (w.text.isupper() or w.text.isdigit() or w.text == "&")


def _even(letters: list[Word]) -> bool:
    """Letters one letter-spacing apart (a word gap may be up to about three of them): not cells of a grid."""
    gaps = [b.x0 - a.x1 for a, b in zip(letters, letters[1:])]
    size = max(w.size for w in letters)
    small = min(gaps)
    return small > 0.05 * size and small < 1.2 * size and max(gaps) <= 4.0 * max(small, 0.25 * size)


def _words_of(letters: list[Word]) -> list[Word]:
    gaps = [b.x0 - a.x1 for a, b in zip(letters, letters[1:])]
    letter_gap = statistics.median(gaps)
    groups: list[list[Word]] = [[letters[0]]]
    for gap, w in zip(gaps, letters[1:]):
        if gap > 1.6 * letter_gap:
            groups.append([w])
        else:
            groups[-1].append(w)
    return [Word("".join(w.text for w in g), g[0].x0, min(w.y0 for w in g), g[-1].x1, max(w.y1 for w in g),
                 max(w.size for w in g), any(w.bold for w in g)) for g in groups]


def join_label_values(content: PageContent) -> None:
    """Join each form value to its label's line, in place: a short line ending in ':' and the nearest line to its right
    on the same baseline. Only where the layout is a form's: the label is a block of its own (or of labels alone),
    and the value is a block of its own (or of values each beside a label of that block). A line of prose that ends
    in a colon, beside the next column's text, is left alone."""
    block_of = {id(line): block for block in content.blocks for line in block}
    lines = [line for block in content.blocks for line in block if line.horizontal and line.words]
    rows = _Rows(lines)
    taken: set[int] = set()
    for label in lines:
        words = label.words
        if id(label) in taken or not _is_label(label):
            continue
        labels = block_of[id(label)]
        if len(labels) > 1 and not all(_is_label(line) for line in labels):
            continue
        _, y0, _, y1 = label.bbox
        value = _right_neighbour(label, rows.near(y0, y1), content.width)
        if value is None or id(value) in taken or _is_label(value):
            continue
        values = block_of[id(value)]
        if len(values) > 1 and not all(any(_same_row(v, lab) for lab in labels) for v in values):
            continue
        label.words = words + value.words
        taken.add(id(value))
    if taken:
        _keep_lines(content, lambda line: id(line) not in taken)


def _is_label(line: Line) -> bool:
    return bool(line.words) and line.words[-1].text.endswith(":") and len(line.words) <= MAX_LABEL_WORDS


def _same_row(a: Line, b: Line) -> bool:
    return _boxes_same_row(a.bbox, b.bbox)


def _boxes_same_row(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return abs((a[1] + a[3]) / 2 - (b[1] + b[3]) / 2) <= 0.3 * max(a[3] - a[1], b[3] - b[1])


def _right_neighbour(label: Line, near: list[tuple], page_width: float) -> Line | None:
    box = label.bbox
    best, best_gap = None, 0.45 * page_width
    for line, other, _ in near:
        if line is label:
            continue
        gap = other[0] - box[2]
        if 0.0 <= gap < best_gap and _boxes_same_row(box, other):
            best, best_gap = line, gap
    return best


def drop_duplicate_words(content: PageContent) -> None:
    """Keep one of each word drawn more than once in the same place (same text, box within a point), in place."""
    seen: set[tuple] = set()
    changed = False
    for block in content.blocks:
        for line in block:
            kept = []
            for w in line.words:
                key = (w.text, round(w.x0), round(w.y0), round(w.x1), round(w.y1))
                if key in seen:
                    changed = True
                    continue
                seen.add(key)
                kept.append(w)
            line.words = kept
    if changed:
        _keep_lines(content, lambda line: bool(line.words))
